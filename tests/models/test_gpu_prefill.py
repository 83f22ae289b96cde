"""models/layers/gpu_prefill.py: whole MoE layers computed from the CPU pool's packed weights
(the GPU path of prefill-sized steps). On the CPU: the grouped computation over the blocked
layout against the torch MoE reference, the fetch/prefetch bookkeeping, the backend's options.
On the GPU (marked): the same against the pool, the backend switching by token count, a model
against HF and against the pool path, graphs untouched."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tandem.ext.cpu import CpuExpertPool, moe_reference
from tandem.models.layers.cpu_expert_options import parse_gpu_prefill
from tandem.models.layers.cpu_experts import CpuPoolExpertBackend
from tandem.models.layers.gpu_prefill import GpuExpertPrefill, experts_from_shards


def _layer(pool: CpuExpertPool, layer: int, E: int, inter: int, H: int, fmt: str, group: int = 64):
    gen = torch.Generator().manual_seed(layer * 7 + E)
    w13 = torch.randn(E, 2 * inter, H, generator=gen) * 0.1
    w2 = torch.randn(E, H, inter, generator=gen) * 0.1
    pool.add_layer(layer, w13, w2, fmt, group)
    return pool.dequantize(layer)  # the weights as the pool has them, fp32


def _routing(T: int, E: int, k: int, seed: int, skip: bool = False):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
    w = torch.rand(T, k, generator=gen)
    w = w / w.sum(-1, keepdim=True)
    if skip:
        ids[::3, 0] = -1
    return ids, w


@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4"])
@pytest.mark.parametrize("E,inter,H,k,T,split", [(8, 96, 80, 2, 13, 0), (6, 200, 128, 3, 40, 2),
                                             (4, 64, 64, 4, 1, 0)])  # fmt: skip
@pytest.mark.parametrize("grouped", [True, False])
def test_experts_from_shards_equal_the_reference(fmt, E, inter, H, k, T, split, grouped) -> None:
    """fp32 on the CPU: the blocked layout, padding, node shards and skipped slots give the
    torch reference's sum, with grouped GEMMs and with the per-expert loop."""
    with CpuExpertPool(2, split_nodes=split) as pool:
        w13, w2 = _layer(pool, 0, E, inter, H, fmt)
        ids, w = _routing(T, E, k, seed=T, skip=True)
        x = torch.randn(T, H)
        shards = []
        for s in pool.layer_shards(0):
            if s.Is:
                from tandem.ext.cpu.layout import shard_weights

                shards.append(shard_weights(pool.shard_memory(s), s, torch.float32))
        got = experts_from_shards(x, ids, w, shards, {"grouped": grouped})
        want = moe_reference(x, w13, w2, ids, w)
        assert got.dtype == torch.float32 and got.shape == (T, H)
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-5), (got - want).abs().max()


@pytest.mark.parametrize("fmt", ["bf16", "int4"])
def test_prefill_runs_layers_and_prefetches_the_next(fmt) -> None:
    """Layer by layer (the next one fetched during the current one), out of order, and again:
    each call equals the pool's own result on the same tokens (bf16 model: bf16 tolerance)."""
    E, inter, H, k, T = 8, 128, 128, 2, 24
    with CpuExpertPool(2) as pool:
        layers = [1, 3, 4]
        weights = {layer: _layer(pool, layer, E, inter, H, fmt) for layer in layers}
        gp = GpuExpertPrefill(pool, layers, torch.device("cpu"))
        for step, order in enumerate([layers, layers, [4, 1, 3]]):
            for layer in order:
                ids, w = _routing(T, E, k, seed=10 * step + layer)
                x = torch.randn(T, H)
                ref = pool.forward(layer, x, ids, w)
                got = gp.run(layer, x.bfloat16(), ids, w)
                rel = float((got - ref).abs().max() / ref.abs().max())
                assert rel < 3e-2, (step, layer, rel)
                # fp32 model: exactly the reference on the pool's weights (the pool itself
                # rounds activations to bf16 / int8 on this path)
                got32 = gp.run(layer, x, ids, w)
                want = moe_reference(x, *weights[layer], ids, w)
                assert torch.allclose(got32, want, rtol=1e-4, atol=1e-5)
        assert gp.calls == 18
        assert gp.h2d_bytes == 6 * sum(gp.layer_bytes(layer) for layer in layers)
        gp.close()


@pytest.mark.parametrize("split,inter", [(2, 200), (3, 33)])
def test_prefill_over_node_shards(split: int, inter: int) -> None:
    """Node shards (split_nodes) are summed in one pass; a node whose shard holds no columns
    (I = 33 pads to one 64-column chunk, three nodes) is skipped."""
    E, H, k, T = 6, 128, 3, 17
    with CpuExpertPool(3, split_nodes=split) as pool:
        weights = _layer(pool, 0, E, inter, H, "int8")
        assert (split == 3) == any(s.Is == 0 for s in pool.layer_shards(0))
        gp = GpuExpertPrefill(pool, [0], torch.device("cpu"))
        ids, w = _routing(T, E, k, seed=5, skip=True)
        x = torch.randn(T, H)
        got = gp.run(0, x, ids, w)
        assert torch.allclose(got, moe_reference(x, *weights, ids, w), rtol=1e-4, atol=1e-5)


def test_pool_releases_the_prefill_before_it_unmaps() -> None:
    """Replacing a layer or closing the pool calls the prefill path's release first (on CUDA:
    unpin before munmap), once per hand-out; the path then reads the new layer."""
    E, inter, H, k, T = 4, 64, 64, 2, 5
    pool = CpuExpertPool(1)
    _layer(pool, 0, E, inter, H, "bf16")
    gp = GpuExpertPrefill(pool, [0], torch.device("cpu"))
    released = []
    real = gp.release
    gp.release = lambda: (released.append(1), real())[1]
    ids, w = _routing(T, E, k, seed=1)
    x = torch.randn(T, H)
    gp.run(0, x, ids, w)
    _layer(pool, 1, E, inter, H, "bf16")  # a new layer: nothing of it handed out
    assert released == []
    gen = torch.Generator().manual_seed(9)
    w13, w2 = torch.randn(E, 2 * inter, H, generator=gen), torch.randn(E, H, inter, generator=gen)
    pool.add_layer(0, w13, w2, "bf16")  # replaced: released before the old memory goes
    assert released == [1] and not gp._host
    got = gp.run(0, x, ids, w)  # maps the new layer
    want = moe_reference(x, *pool.dequantize(0), ids, w)
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-5)
    pool.close()
    assert released == [1, 1]


def test_gpu_prefill_option_parsing(monkeypatch) -> None:
    assert parse_gpu_prefill(None) is None and parse_gpu_prefill("auto") is None
    assert parse_gpu_prefill("off") == 0 and parse_gpu_prefill("0") == 0
    assert parse_gpu_prefill("512") == 512 and parse_gpu_prefill(64) == 64
    for bad in ("-1", "lots", -3, "1.5"):
        with pytest.raises(ValueError, match="gpu_prefill"):
            parse_gpu_prefill(bad)
    with CpuExpertPool(1) as pool:
        _layer(pool, 0, 4, 64, 64, "int4")
        _layer(pool, 1, 4, 64, 64, "bf16")
        monkeypatch.delenv("TANDEM_GPU_PREFILL", raising=False)
        b = CpuPoolExpertBackend(fmt="int4", pool=pool)
        assert b.gpu_prefill_tokens(0) == 384 and b.gpu_prefill_tokens(1) == 1024
        monkeypatch.setenv("TANDEM_GPU_PREFILL", "off")
        assert CpuPoolExpertBackend(pool=pool).gpu_prefill_tokens(0) == 0
        monkeypatch.setenv("TANDEM_GPU_PREFILL", "1000")
        assert CpuPoolExpertBackend(pool=pool).gpu_prefill_tokens(1) == 1000
        # never within the decode graphs' sizes: warm-up and capture take the same path
        monkeypatch.setenv("TANDEM_GPU_PREFILL", "32")
        assert CpuPoolExpertBackend(pool=pool).gpu_prefill_tokens(1) == 257
        assert CpuPoolExpertBackend(pool=pool, gpu_prefill="off").gpu_prefill_tokens(1) == 0
        monkeypatch.setenv("TANDEM_GPU_PREFILL", "never")
        with pytest.raises(ValueError, match="gpu_prefill"):
            CpuPoolExpertBackend(pool=pool)


def test_cli_takes_gpu_prefill() -> None:
    import argparse

    from tandem.app.engine_args import add_engine_arguments, engine_config_from_args

    p = argparse.ArgumentParser()
    add_engine_arguments(p)
    assert (
        engine_config_from_args(p.parse_args(["--gpu-prefill", "256"])).model.gpu_prefill == "256"
    )
    assert engine_config_from_args(p.parse_args([])).model.gpu_prefill is None
    with pytest.raises(SystemExit):
        p.parse_args(["--gpu-prefill", "-4"])


# -- GPU ------------------------------------------------------------------------------------


def _cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA")


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,group", [("bf16", 64), ("int8", 64), ("int4", 64), ("int4", 32)])
@pytest.mark.parametrize("split", [0, 2])
def test_cuda_prefill_equals_the_pool(fmt, group, split) -> None:
    """bf16 model on the GPU: the widening kernel + grouped GEMMs on the pool's raw bytes,
    through both staging slots and their prefetch, match the pool within bf16 rounding."""
    _cuda()
    E, inter, H, k, T = 16, 192, 256, 4, 300
    with CpuExpertPool(4, split_nodes=split) as pool:
        layers = [0, 1, 2]
        weights = {layer: _layer(pool, layer, E, inter, H, fmt, group) for layer in layers}
        gp = GpuExpertPrefill(pool, layers, torch.device("cuda"))
        for rep in range(2):
            outs, refs = [], []
            for layer in layers:
                ids, w = _routing(T, E, k, seed=rep * 10 + layer, skip=rep == 1)
                x = torch.randn(T, H).bfloat16()
                # fp32 on the pool's weights (the pool itself rounds activations to int8 on
                # AMX machines, so it is no closer to this than the GPU path)
                refs.append(moe_reference(x.float(), *weights[layer], ids, w))
                outs.append(gp.run(layer, x.cuda(), ids.cuda(), w.cuda()))
            for got, ref in zip(outs, refs, strict=True):
                rel = float((got.cpu() - ref).abs().max() / ref.abs().max())
                assert rel < 2e-2, rel
        assert gp.calls == 6 and gp._mm_state.get("grouped", True)
        assert gp._registered  # page-locked; the pool's close unpins them first


def _qwen3_bf16(path: Path):
    import transformers as hf

    cfg = hf.Qwen3MoeConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=16,
        num_experts_per_tok=4, moe_intermediate_size=96, norm_topk_prob=True,
        initializer_range=0.05,
    )  # fmt: skip
    torch.manual_seed(0)
    model = hf.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    model.save_pretrained(path)
    return model


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["bf16", "int4"])
def test_model_prefill_on_gpu_is_as_close_to_hf_as_the_pool(fmt: str, tmp_path: Path) -> None:
    """A bf16 Qwen3-MoE on CUDA: a 300-token prefill with gpu_prefill=64 (taken as 257) goes to
    the GPU (calls and bytes counted) and is as close to HF in float32 as the same model with
    the path off (the pool); both differ from HF by the bf16 model's own rounding (~7% of the
    largest logit for this random model, the same on the CPU), so each is held to the other."""
    from tandem.models.batch import KVCache
    from tandem.models.loader import load_model
    from tests.models.test_cpu_pool_cuda import _one_sequence_batch

    _cuda()
    hf_model = _qwen3_bf16(tmp_path)
    logits = {}
    for mode in ("64", "off"):
        model, config = load_model(
            tmp_path, dtype=torch.bfloat16, device="cuda", expert_backend="cpu_pool",
            expert_options={"fmt": fmt, "gpu_prefill": mode, "expert_cache": False},
        )  # fmt: skip
        n = 300
        kv = KVCache.allocate(3, 20, 16, config.num_key_value_heads, config.head_dim,
                              torch.bfloat16, "cuda")  # fmt: skip
        ids, pos, batch = _one_sequence_batch(n, "cuda", kv)
        ids = (ids * 13) % config.vocab_size
        with torch.no_grad():
            logits[mode] = model.compute_logits(model(ids, pos, batch)).float().cpu()
        s = model.expert_backend.stats()
        if mode == "64":
            assert s.gpu_prefill_calls == 3 and s.h2d_bytes > 0
        else:
            assert s.gpu_prefill_calls == 0
        model.expert_backend.close()
    with torch.no_grad():
        ref = hf_model(ids.cpu()[None]).logits[0].float()

    def rel(a: torch.Tensor) -> float:
        return float((a - ref).abs().max() / ref.abs().max())

    err_gpu, err_pool = rel(logits["64"]), rel(logits["off"])
    assert err_gpu <= 1.25 * err_pool + 1e-2, (err_gpu, err_pool)
    agree = (logits["64"].argmax(-1) == ref.argmax(-1)).float().mean()
    agree_pool = (logits["off"].argmax(-1) == ref.argmax(-1)).float().mean()
    assert agree >= agree_pool - 0.03, (agree, agree_pool)


@pytest.mark.gpu
def test_engine_with_gpu_prefill_decodes_in_graphs(tmp_path: Path) -> None:
    """The engine on CUDA with int4 CPU experts: long prompts prefill on the GPU (counted),
    decode steps keep the pool inside the graphs, and the greedy tokens equal the same engine
    with the GPU path off (bf16: a late flip is rounding)."""
    from tandem.runtime.config import CacheConfig, EngineConfig, ModelSpec, SchedulerConfig
    from tandem.runtime.cuda_runner import CudaRunnerOptions
    from tandem.runtime.llm import LLM
    from tandem.runtime.sampling_params import SamplingParams

    _cuda()
    _qwen3_bf16(tmp_path)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 256, (n,), generator=gen).tolist() for n in (300, 400, 5, 60)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outs = {}
    for mode in ("32", "off"):  # 32: taken as 257
        ec = EngineConfig(
            model=ModelSpec(model=str(tmp_path), device="cuda", dtype="bfloat16",
                            cpu_experts="all", cpu_threads=4, cpu_expert_format="int4",
                            gpu_prefill=mode),
            cache=CacheConfig(block_size=16, num_blocks=96),
            scheduler=SchedulerConfig(max_num_seqs=4, max_model_len=512,
                                      max_num_batched_tokens=512),
        )  # fmt: skip
        llm = LLM(engine_config=ec, runner_options=CudaRunnerOptions(cuda_graphs=True))
        outs[mode] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        runner = llm.engine.runner
        assert not runner.counters.fallbacks and runner.counters.graph_steps > 0
        stats = llm.engine.stats().hybrid
        assert (stats.gpu_prefill_calls > 0) == (mode == "32"), stats.gpu_prefill_calls
        assert stats.stream_errors == 0
        llm.engine.model.expert_backend.close()
    same = sum(a == b for a, b in zip(outs["32"], outs["off"], strict=True))
    assert same >= 3, outs

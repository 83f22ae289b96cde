"""The "gpu" expert backend (models/layers/gpu_experts.py) and its routed-experts kernel
(ext/cuda/skinny_gemm.cu: moe_gemv_kernel, launched by ext/cuda/skinny.py).

CPU tests: the grouped-GEMM path and the fallbacks against the torch reference, the launcher's
checks, the auto choice of backend. GPU tests (`gpu` marker): the kernel against a float32
reference over token counts, top-k, expert counts and both grid modes, inside a CUDA graph,
the backend's path choice, and a tiny Mixtral through the engine with decode graphs.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import transformers as hf

import tandem.ext.cuda as cuda_ext
from tandem.ext.cuda import skinny
from tandem.models.layers.expert_registry import get_expert_backend
from tandem.models.layers.experts import TorchExpertBackend
from tandem.models.layers.gpu_experts import GpuExpertBackend, grouped_experts
from tests.models.test_cpu_pool_cuda import _mixtral_cuda_config, _one_sequence_batch

_requires_cuda = pytest.mark.skipif(not cuda_ext.is_available(), reason="needs CUDA and CuPy")


def gpu_test(fn):
    return pytest.mark.gpu(_requires_cuda(fn))


def _layer(t, k, e, h, inter, dtype, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(t, h, generator=g).to(dtype)
    w13 = (torch.randn(e, 2 * inter, h, generator=g) / h**0.5).to(dtype)
    w2 = (torch.randn(e, h, inter, generator=g) / inter**0.5).to(dtype)
    probs = torch.softmax(torch.randn(t, e, generator=g), dim=-1)
    weights, ids = torch.topk(probs, k, dim=-1)
    return [x.to(device) for x in (hidden, ids, weights, w13, w2)]


def _reference(hidden, ids, weights, w13, w2) -> torch.Tensor:
    """float32 on the CPU, whatever the inputs' dtype and device."""
    args = [x.cpu().float() if x.is_floating_point() else x.cpu() for x in (hidden, ids, weights)]
    return TorchExpertBackend().forward(0, *args, w13.cpu().float(), w2.cpu().float())


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.cpu().float() - ref).norm() / ref.norm()).item()


# ------------------------------------------------------------------------------------ CPU


@pytest.mark.parametrize("t,k,e", [(1, 1, 4), (5, 2, 8), (33, 8, 16), (200, 4, 8), (3, 2, 64)])
def test_grouped_experts_match_the_reference(t: int, k: int, e: int) -> None:
    layer = _layer(t, k, e, 64, 32, torch.float32)
    assert _rel(grouped_experts(*layer), _reference(*layer)) < 1e-6
    layer = _layer(t, k, e, 64, 32, torch.bfloat16)
    assert _rel(grouped_experts(*layer), _reference(*layer)) < 2e-2


def test_backend_paths_off_cuda(monkeypatch, caplog) -> None:
    layer = _layer(9, 2, 8, 64, 32, torch.float32)
    ref = _reference(*layer)
    backend = get_expert_backend("gpu")
    assert isinstance(backend, GpuExpertBackend) and backend.supports_cuda_graphs
    assert _rel(backend.forward(0, *layer), ref) < 1e-6
    no_packed = {"qdecode": 0, "qgemv": 0, "qgrouped": 0}
    assert backend.calls == {"decode": 0, "gemv": 0, "grouped": 1, "torch": 0, **no_packed}

    def broken(*args, **kwargs):
        raise RuntimeError("no grouped GEMM here")

    monkeypatch.setattr(torch, "_grouped_mm", broken)
    with caplog.at_level(logging.WARNING):
        assert _rel(backend.forward(0, *layer), ref) < 1e-6  # said once, then the loop
    assert "grouped GEMMs unavailable" in caplog.text
    assert _rel(backend.forward(0, *layer), ref) < 1e-6
    assert backend.calls == {"decode": 0, "gemv": 0, "grouped": 1, "torch": 2, **no_packed}
    monkeypatch.delattr(torch, "_grouped_mm")
    fresh = GpuExpertBackend()
    assert _rel(fresh.forward(0, *layer), ref) < 1e-6
    assert fresh.calls["torch"] == 1


def test_backend_options(monkeypatch) -> None:
    with pytest.raises(ValueError, match="gemv_max_tokens"):
        GpuExpertBackend(gemv_max_tokens=-1)
    monkeypatch.setenv("TANDEM_MOE_GEMV_TOKENS", "7")
    assert GpuExpertBackend().gemv_max_tokens == 7
    assert GpuExpertBackend(gemv_max_tokens=3).gemv_max_tokens == 3
    assert GpuExpertBackend().decode_max_slot_ratio == 0.5
    monkeypatch.setenv("TANDEM_MOE_DECODE_SLOT_RATIO", "inf")
    assert GpuExpertBackend().decode_max_slot_ratio == float("inf")


def test_auto_expert_backend_by_device() -> None:
    from tandem.runtime.engine_setup import _auto_expert_backend

    assert _auto_expert_backend(torch.device("cuda")) == "gpu"
    assert _auto_expert_backend(torch.device("cpu")) == "torch"


def test_moe_launcher_rejects_bad_operands() -> None:
    hidden, ids, weights, w13, w2 = _layer(2, 2, 4, 64, 32, torch.bfloat16)
    sorted_ids, order = torch.sort(ids.reshape(-1), stable=True)
    act = torch.empty(4, 32, dtype=torch.bfloat16)
    assert not skinny.moe_supported(hidden, w13, w2)  # CPU tensors
    with pytest.raises(ValueError, match="shapes"):
        skinny.launch_moe_gemv(hidden, w13, sorted_ids, order, None, None, act[:, :16], 2, True)
    with pytest.raises(ValueError, match="rows for"):
        skinny.launch_moe_gemv(hidden, w13, sorted_ids, order, None, None, act, 1, True)
    with pytest.raises(ValueError, match="int64"):
        skinny.launch_moe_gemv(hidden, w13, sorted_ids.int(), order, None, None, act, 2, True)
    with pytest.raises(ValueError, match="slot_weights"):
        y = torch.empty(4, 64, dtype=torch.float32)
        skinny.launch_moe_gemv(act, w2, sorted_ids, order, None, None, y, 2, False)
    with pytest.raises(ValueError, match="out must be"):
        skinny.launch_moe_gemv(hidden, w13, sorted_ids, order, None, None, act.float(), 2, True)
    with pytest.raises(ValueError, match="CUDA"):
        skinny.launch_moe_gemv(hidden, w13, sorted_ids, order, None, None, act, 2, True)
    with pytest.raises(ValueError, match="moe_supported"):
        torch.ops.tandem.moe_routed_experts(hidden, ids, weights, w13, w2)


def test_moe_block_takes_the_backends_logits_path_where_it_answers() -> None:
    """SparseMoeBlock asks `forward_logits` first; None: torch routes and `forward` computes.
    The shared expert is added either way."""
    from tandem.models.config import ModelConfig
    from tandem.models.layers.moe import SparseMoeBlock

    cfg = ModelConfig(
        architecture="Qwen2MoeForCausalLM", vocab_size=16, hidden_size=64, intermediate_size=96,
        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
    )  # fmt: skip

    class Direct(GpuExpertBackend):
        def forward_logits(self, layer_idx, hidden, logits, top_k, renormalize, w13, w2):
            self.seen = (top_k, renormalize, tuple(logits.shape))
            return torch.zeros_like(hidden)

    torch.manual_seed(0)
    plain = SparseMoeBlock(cfg, 0, GpuExpertBackend())
    for p in plain.parameters():
        torch.nn.init.normal_(p, std=0.1)
    direct = SparseMoeBlock(cfg, 0, Direct())
    direct.load_state_dict(plain.state_dict())
    x = torch.randn(5, 64)
    with torch.no_grad():
        ids, w = plain.route(x)
        ref = _reference(x, ids, w, plain.w13, plain.w2) + plain._shared_expert(x)
        assert _rel(plain(x), ref) < 1e-5  # no kernels on the CPU: forward_logits says None
        assert plain.backend.calls["grouped"] == 1
        assert torch.allclose(direct(x), direct._shared_expert(x))
    assert direct.backend.seen == (2, direct.renormalize, (5, 8))


def test_decode_launchers_reject_bad_operands() -> None:
    from tandem.ext.cuda import moe_stage

    hidden, ids, weights, w13, w2 = _layer(2, 2, 4, 64, 32, torch.bfloat16)
    logits = torch.zeros(2, 4, dtype=torch.bfloat16)
    assert not skinny.moe_decode_supported(hidden, logits, w13, w2, 2)  # CPU tensors
    with pytest.raises(ValueError, match="CUDA"):
        moe_stage.route_sort(logits, 2, True)
    act = torch.zeros(4, 32, dtype=torch.bfloat16)
    out = torch.zeros(2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="shapes"):
        skinny.launch_moe_down(act[:3], w2, ids, weights, out)
    with pytest.raises(ValueError, match="int64"):
        skinny.launch_moe_down(act, w2, ids.int(), weights, out)
    with pytest.raises(ValueError, match="CUDA"):
        skinny.launch_moe_down(act, w2, ids, weights, out)
    with pytest.raises(ValueError, match="moe_decode_supported"):
        torch.ops.tandem.moe_decode_experts(hidden, logits, w13, w2, 2, True)


# ------------------------------------------------------------------------------------ GPU


@gpu_test
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "t,k,e,h,inter",
    [
        (1, 1, 8, 256, 96),  # one slot; rows not a multiple of a block's
        (1, 8, 128, 2048, 768),  # the Qwen3-30B-A3B layer at batch 1
        (3, 2, 8, 256, 96),
        (5, 8, 16, 128, 64),  # S = 40 > E: one block row per expert
        (16, 8, 128, 512, 128),
        (33, 4, 8, 256, 40),  # runs longer than 8 slots: several chunks per expert
        (256, 8, 128, 256, 96),
        # real layer shapes: Qwen1.5-MoE-A2.7B (60 experts), GPT-OSS-like dims, a hidden size
        # that is a multiple of 8 only (Mixtral-8x7B's in the decode test below)
        (4, 4, 60, 2048, 1408),
        (7, 4, 32, 2880, 2880),
        (3, 6, 60, 72, 1408),
    ],
)
def test_moe_kernel_matches_float32(dtype, t, k, e, h, inter) -> None:
    layer = _layer(t, k, e, h, inter, dtype, "cuda", seed=t * 31 + k)
    out = torch.ops.tandem.moe_routed_experts(*layer)
    torch.cuda.synchronize()
    assert out.shape == (t, h) and out.dtype == dtype
    assert _rel(out, _reference(*layer)) < 1e-2


@gpu_test
@pytest.mark.parametrize("by_expert", [False, True])
def test_moe_passes_write_every_slot(by_expert: bool) -> None:
    """Both passes, outputs poisoned with NaN: every slot row written, right values."""
    hidden, ids, weights, w13, w2 = _layer(6, 4, 16, 128, 48, torch.bfloat16, "cuda")
    s = ids.numel()
    sorted_ids, order = torch.sort(ids.reshape(-1), stable=True)
    offsets = torch.searchsorted(sorted_ids, torch.arange(17, device="cuda")) if by_expert else None
    act = torch.full((s, 48), float("nan"), dtype=torch.bfloat16, device="cuda")
    skinny.launch_moe_gemv(hidden, w13, sorted_ids, order, offsets, None, act, 4, glu=True)
    y = torch.full((s, 128), float("nan"), dtype=torch.float32, device="cuda")
    w = weights.reshape(-1).contiguous()
    skinny.launch_moe_gemv(act, w2, sorted_ids, order, offsets, w, y, 4, glu=False)
    torch.cuda.synchronize()
    assert not act.isnan().any() and not y.isnan().any()
    flat = ids.reshape(-1).cpu()
    x = hidden.cpu().float().repeat_interleave(4, dim=0)  # row s = token s // 4
    gate_up = torch.einsum("sh,sih->si", x, w13.cpu().float()[flat])
    gate, up = gate_up.chunk(2, dim=-1)
    ref_act = torch.nn.functional.silu(gate) * up
    assert _rel(act, ref_act) < 1e-2
    ref_y = torch.einsum("si,shi->sh", act.cpu().float(), w2.cpu().float()[flat]) * w.cpu()[:, None]
    assert _rel(y, ref_y) < 1e-3


@gpu_test
def test_moe_kernel_in_a_cuda_graph() -> None:
    """Captured once, replayed with new routing: the graph follows the ids (no host sync)."""
    hidden, ids, weights, w13, w2 = _layer(4, 8, 64, 256, 64, torch.bfloat16, "cuda")
    static = [hidden.clone(), ids.clone(), weights.clone()]
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.ops.tandem.moe_routed_experts(*static, w13, w2)  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            out = torch.ops.tandem.moe_routed_experts(*static, w13, w2)
    for seed in (1, 2):
        h2, ids2, w2_, _, _ = _layer(4, 8, 64, 256, 64, torch.bfloat16, "cuda", seed=seed)
        for dst, src in zip(static, (h2, ids2, w2_), strict=True):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        assert _rel(out, _reference(h2, ids2, w2_, w13, w2)) < 1e-2


@gpu_test
@pytest.mark.parametrize("t,e,k,renorm", [(1, 128, 8, True), (8, 128, 8, False), (3, 8, 2, True),
                                          (32, 64, 8, True), (5, 1024, 16, False)])  # fmt: skip
def test_route_sort_matches_torch(t, e, k, renorm) -> None:
    from tandem.ext.cuda import moe_stage

    g = torch.Generator().manual_seed(t + e)
    logits = torch.randn(t, e, generator=g).to(torch.bfloat16).cuda()
    ids, weights, sorted_ids, order = moe_stage.route_sort(logits, k, renorm)
    ref_ids, ref_w = moe_stage.route_ref(logits, k, renorm)
    torch.cuda.synchronize()
    assert torch.equal(ids.sort(dim=-1).values, ref_ids.sort(dim=-1).values)
    assert torch.allclose(weights.gather(1, ids.argsort(dim=-1)),
                          ref_w.gather(1, ref_ids.argsort(dim=-1)), rtol=1e-5, atol=1e-7)  # fmt: skip
    ref_sorted, ref_order = torch.sort(ids.reshape(-1), stable=True)
    assert torch.equal(sorted_ids, ref_sorted) and torch.equal(order, ref_order)


@gpu_test
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("t,k,e,h,inter", [(1, 8, 128, 2048, 768), (3, 2, 8, 256, 96),
                                           (8, 8, 64, 512, 128), (2, 16, 32, 128, 40),
                                           (1, 2, 8, 4096, 14336), (5, 4, 60, 2048, 1408),
                                           (8, 6, 64, 2880, 1408), (2, 3, 5, 72, 24)])  # fmt: skip
def test_moe_decode_experts_from_logits(dtype, t, k, e, h, inter) -> None:
    """Route + sort, gate_up runs, down summed per token (out poisoned: every row written)
    against torch's router and the float32 reference."""
    from tandem.ext.cuda import moe_stage

    hidden, _, _, w13, w2 = _layer(t, k, e, h, inter, dtype, "cuda", seed=t + k)
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(t, e, generator=g).to(dtype).cuda()
    assert skinny.moe_decode_supported(hidden, logits, w13, w2, k)
    out = torch.ops.tandem.moe_decode_experts(hidden, logits, w13, w2, k, True)
    ids, weights = moe_stage.route_ref(logits, k, True)
    assert _rel(out, _reference(hidden, ids, weights, w13, w2)) < 1e-2
    act = torch.full((t * k, inter), float("nan"), dtype=dtype, device="cuda")
    sorted_ids, order = torch.sort(ids.reshape(-1), stable=True)
    skinny.launch_moe_gemv(hidden, w13, sorted_ids, order, None, None, act, k, glu=True)
    down = torch.full((t, h), float("nan"), dtype=dtype, device="cuda")
    skinny.launch_moe_down(act, w2, ids, weights, down)
    torch.cuda.synchronize()
    assert not down.isnan().any()
    assert _rel(down, _reference(hidden, ids, weights, w13, w2)) < 1e-2


@gpu_test
def test_moe_decode_experts_in_a_cuda_graph() -> None:
    from tandem.ext.cuda import moe_stage

    hidden, _, _, w13, w2 = _layer(2, 8, 64, 256, 64, torch.bfloat16, "cuda")
    logits = torch.randn(2, 64, device="cuda").to(torch.bfloat16)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.ops.tandem.moe_decode_experts(hidden, logits, w13, w2, 8, False)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            out = torch.ops.tandem.moe_decode_experts(hidden, logits, w13, w2, 8, False)
    for _ in range(2):
        hidden.copy_(torch.randn_like(hidden))
        logits.copy_(torch.randn_like(logits))
        graph.replay()
        torch.cuda.synchronize()
        ids, weights = moe_stage.route_ref(logits, 8, False)
        assert _rel(out, _reference(hidden, ids, weights, w13, w2)) < 1e-2


@gpu_test
def test_backend_paths_on_cuda() -> None:
    backend = GpuExpertBackend(gemv_max_tokens=8)
    for t in (1, 8, 9, 300):
        layer = _layer(t, 8, 32, 256, 64, torch.bfloat16, "cuda", seed=t)
        assert _rel(backend.forward(0, *layer), _reference(*layer)) < 1e-2
    grouped = 2 if hasattr(torch, "_grouped_mm") else 0
    assert backend.calls == {
        "decode": 0,
        "gemv": 4 - grouped,
        "grouped": grouped,
        "torch": 0,
        "qdecode": 0,
        "qgemv": 0,
        "qgrouped": 0,
    }
    fp16 = _layer(300, 8, 32, 256, 64, torch.float16, "cuda")  # CUDA grouped GEMMs: bf16 only
    assert _rel(backend.forward(0, *fp16), _reference(*fp16)) < 1e-2
    assert backend.calls["gemv"] == 5 - grouped


@gpu_test
def test_decode_kernels_only_while_the_slots_fill_half_the_experts() -> None:
    """Mixtral's 8 experts top-2: 1 and 2 tokens through the decode kernels, 3 and 8 (experts
    shared by tokens) through the torch router and the routed kernels; same sums either way."""
    backend = GpuExpertBackend(gemv_max_tokens=8)
    hidden, _, _, w13, w2 = _layer(8, 2, 8, 256, 64, torch.bfloat16, "cuda")
    logits = torch.randn(8, 8, device="cuda").to(torch.bfloat16)
    for t, path in ((1, "decode"), (2, "decode"), (3, None), (8, None)):
        before = backend.calls["decode"]
        out = backend.forward_logits(0, hidden[:t], logits[:t], 2, True, w13, w2)
        if path is None:
            assert out is None and backend.calls["decode"] == before
            continue
        assert backend.calls["decode"] == before + 1
        from tandem.ext.cuda import moe_stage

        ids, weights = moe_stage.route_ref(logits[:t], 2, True)
        assert _rel(out, _reference(hidden[:t], ids, weights, w13, w2)) < 1e-2


@torch.no_grad()
def _three_paths_match_hf(model, hf_model, ids, pos, batch) -> None:
    """One sequence's logits through the gpu backend's decode kernels, routed kernels and
    grouped GEMMs (the backend's switches set for the step's size), each against HF's."""
    backend, n = model.expert_backend, ids.shape[0]
    ref = hf_model(ids.cpu()[None]).logits[0].float()
    for gemv_max, decode_kernels in ((n, True), (n, False), (0, True)):
        backend.gemv_max_tokens, backend.decode_kernels = gemv_max, decode_kernels
        ours = model.compute_logits(model(ids, pos, batch)).float().cpu()
        rel = float((ours - ref).abs().max() / ref.abs().max())
        assert rel < 3e-2, (n, gemv_max, decode_kernels, rel)


@gpu_test
def test_engine_on_cuda_decodes_moe_in_graphs(tmp_path: Path) -> None:
    """A tiny Mixtral on CUDA (bf16) picks the gpu backend, captures its decode graphs with the
    experts inside, and decodes what the torch reference backend decodes eagerly; its logits
    match HF's."""
    from tandem.models.batch import KVCache
    from tandem.models.loader import load_model
    from tandem.runtime.config import CacheConfig, EngineConfig, ModelSpec, SchedulerConfig
    from tandem.runtime.cuda_runner import CudaRunnerOptions
    from tandem.runtime.llm import LLM
    from tandem.runtime.sampling_params import SamplingParams

    torch.manual_seed(0)
    hf_model = hf.AutoModelForCausalLM.from_config(_mixtral_cuda_config()).eval()
    hf_model.save_pretrained(tmp_path)
    model, config = load_model(tmp_path, dtype=torch.bfloat16, device="cuda", expert_backend="gpu")
    backend = model.expert_backend
    backend.decode_max_slot_ratio = float("inf")  # the decode kernels at any fill
    n = 23
    ids, pos, batch = _one_sequence_batch(n, "cuda", KVCache.allocate(
        2, 4, 16, config.num_key_value_heads, config.head_dim, torch.bfloat16, "cuda"))  # fmt: skip
    ids = ids * 5 % 128
    _three_paths_match_hf(model, hf_model, ids, pos, batch)
    calls = backend.calls
    assert calls["decode"] == calls["gemv"] == 2 and calls["grouped"] + calls["torch"] == 2
    del model
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, 128, (n,), generator=gen).tolist() for n in (3, 30, 7, 19, 44)]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    outs = {}
    for experts, graphs in (("auto", True), ("torch", False)):
        ec = EngineConfig(
            model=ModelSpec(
                model=str(tmp_path), device="cuda", dtype="bfloat16", expert_backend=experts
            ),  # fmt: skip
            cache=CacheConfig(block_size=16, num_blocks=64),
            scheduler=SchedulerConfig(max_num_seqs=8, max_model_len=256, max_num_batched_tokens=64),
        )
        llm = LLM(engine_config=ec, runner_options=CudaRunnerOptions(cuda_graphs=graphs))
        runner = llm.engine.runner
        assert llm.engine.model.expert_backend.name == ("gpu" if experts == "auto" else "torch")
        outs[experts] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        if graphs:
            assert not runner.counters.fallbacks, runner.counters.fallbacks
            assert runner.counters.graph_steps > 0
            assert llm.engine.model.expert_backend.calls["decode"] > 0
        del llm, runner
    same = sum(a == b for a, b in zip(outs["auto"], outs["torch"], strict=True))
    assert same >= 4, f"gpu backend (graphs) vs torch (eager): {same}/5 identical"


@gpu_test
@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe"])
def test_each_moe_architecture_through_the_gpu_backend_matches_hf(arch: str, tmp_path: Path):
    """The tiny checkpoints of the cpu_pool model tests (Qwen3-MoE with a dense first layer,
    Qwen2-MoE's gated shared expert and unnormalised top-k, Mixtral, OLMoE's whole-row q/k
    norms, clip_qkv and unnormalised top-k) in bf16 on CUDA through the decode kernels, the
    routed kernels and the grouped GEMMs, against HF in float32."""
    from tandem.models.batch import KVCache
    from tandem.models.loader import load_model
    from tests.models.moe_cases import _save

    hf_model = _save(arch, tmp_path)
    model, config = load_model(tmp_path, dtype=torch.bfloat16, device="cuda", expert_backend="gpu")
    backend = model.expert_backend
    backend.decode_max_slot_ratio = float("inf")  # the decode kernels at any fill
    kv = KVCache.allocate(2, 4, 16, config.num_key_value_heads, config.head_dim, torch.bfloat16,
                          "cuda")  # fmt: skip
    for n in (1, 8, 29):
        ids, pos, batch = _one_sequence_batch(n, "cuda", kv)
        _three_paths_match_hf(model, hf_model, (ids * 11 + 3) % config.vocab_size, pos, batch)
    assert backend.calls["decode"] > 0 and backend.calls["gemv"] > 0


@gpu_test
def test_engine_on_cuda_compiles_the_moe_decode(tmp_path: Path) -> None:
    """TANDEM_COMPILE with the gpu backend: the decode forward under torch.compile (the
    kernels are custom ops), captured in graphs, no fallback, and greedy output as the
    uncompiled graphs'. (TANDEM_COMPILE_PREFILL with a MoE model hits the recompile limit and
    runs prefill eagerly, counted: the layers' graph breaks guard per layer.)"""
    from tandem.runtime.config import CacheConfig, EngineConfig, ModelSpec, SchedulerConfig
    from tandem.runtime.cuda_runner import CudaRunnerOptions
    from tandem.runtime.llm import LLM
    from tandem.runtime.sampling_params import SamplingParams

    torch.manual_seed(0)
    hf.AutoModelForCausalLM.from_config(_mixtral_cuda_config()).save_pretrained(tmp_path)
    ec = EngineConfig(
        model=ModelSpec(model=str(tmp_path), device="cuda", dtype="bfloat16"),
        cache=CacheConfig(block_size=16, num_blocks=64),
        scheduler=SchedulerConfig(max_num_seqs=8, max_model_len=256, max_num_batched_tokens=64),
    )
    gen = torch.Generator().manual_seed(6)
    prompts = [torch.randint(1, 128, (n,), generator=gen).tolist() for n in (4, 21, 9)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outs = []
    for mode in ("default", None):
        opts = CudaRunnerOptions(cuda_graphs=True, compile_mode=mode)
        llm = LLM(engine_config=ec, runner_options=opts)
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
        fb = llm.engine.runner.counters.fallbacks
        assert not fb, fb
        assert llm.engine.runner.counters.graph_steps > 0
        del llm
    same = sum(a == b for a, b in zip(*outs, strict=True))
    assert same >= 2, f"compiled vs eager graphs: {same}/3 identical"


@gpu_test
@pytest.mark.parametrize("t", [1, 5, 8, 40, 300])
def test_gpu_resident_share_of_a_hybrid_layer(t: int) -> None:
    """cpu_pool's GPU-resident experts (local ids, -1 = on the CPU pool) through the routed
    kernels (T <= 8: slots elsewhere skipped) or the grouped GEMMs (weight 0 for them), against
    the dense reference."""
    from tandem.models.layers.local_experts import _dense_experts, _local_experts

    hidden, ids, weights, w13, w2 = _layer(t, 8, 16, 256, 64, torch.bfloat16, "cuda", seed=t)
    local = torch.where(ids % 3 == 0, ids // 3, -1)  # experts 0, 3, ..., 15 of 16 are "here"
    g13, g2 = w13[:6].contiguous(), w2[:6].contiguous()
    ours = _local_experts(hidden, local, weights, g13, g2)
    ref = _dense_experts(hidden.float(), local, weights, g13.float(), g2.float())
    torch.cuda.synchronize()
    assert ours.dtype == torch.float32 and _rel(ours, ref.cpu()) < 1e-2
    none_here = _local_experts(hidden, torch.full_like(local, -1), weights, g13, g2)
    assert torch.count_nonzero(none_here) == 0

"""The cpu_pool expert backend on CUDA (GPU tests): the hybrid forward against HF, the MoE
block and the CUDA runner's decode graphs with the pool inside (flag and host-function sync),
and the engine on CUDA with CPU experts. Checkpoints from tests/models/moe_cases.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers as hf

from tandem.models.loader import load_model
from tests.models.moe_cases import _save


def _one_sequence_batch(n: int, device: str, kv) -> tuple[torch.Tensor, torch.Tensor, object]:
    from tandem.models.batch import ForwardBatch

    blocks = -(-n // kv.block_size)
    batch = ForwardBatch(
        query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([n], dtype=torch.int32, device=device),
        block_tables=torch.arange(blocks, dtype=torch.int32, device=device)[None],
        slot_mapping=torch.arange(n, dtype=torch.int64, device=device),
        logits_indices=torch.arange(n, dtype=torch.int64, device=device),
        query_lens_cpu=[n],
        seq_lens_cpu=[n],
        kv_cache=kv,
        max_query_len=n,
        max_seq_len=n,
    )
    return torch.arange(n, device=device), torch.arange(n, device=device), batch


@pytest.mark.gpu
@pytest.mark.parametrize("gpu_experts", [0, 3])
def test_cuda_hybrid_matches_hf(gpu_experts: int, tmp_path: Path) -> None:
    """On CUDA: pinned copies, pool on the CPU, GPU-resident experts (3 of 8) meanwhile, sum."""
    from tandem.models.batch import KVCache

    if not torch.cuda.is_available():
        pytest.skip("no CUDA")
    hf_model = _save("qwen2_moe", tmp_path)
    model, config = load_model(
        tmp_path,
        dtype=torch.float32,
        device="cuda",
        expert_backend="cpu_pool",
        expert_options={"isa": "scalar", "gpu_experts": gpu_experts, "rebalance_after_tokens": 0},
    )
    backend = model.expert_backend
    assert all(b.w13.device.type == "cpu" for b in model.modules() if hasattr(b, "w13"))
    n = 37
    kv = KVCache.allocate(2, 4, 16, config.num_key_value_heads, config.head_dim, torch.float32,
                          "cuda")  # fmt: skip
    ids, pos, batch = _one_sequence_batch(n, "cuda", kv)
    ids = (ids * 7) % config.vocab_size
    with torch.no_grad():
        ours = model.compute_logits(model(ids, pos, batch)).cpu()
        ref = hf_model(ids.cpu()[None]).logits[0].float()
    rel = float((ours - ref).abs().max() / ref.abs().max())
    assert rel < 1e-4, rel
    s = backend.stats()
    assert s.d2h_bytes > 0 and s.h2d_bytes > 0 and s.layer_calls == 2
    if gpu_experts:
        backend.rebalance()
        with torch.no_grad():
            ids2, pos2, batch2 = _one_sequence_batch(n, "cuda", kv)
            again = model.compute_logits(model((ids2 * 7) % config.vocab_size, pos2, batch2))
        assert float((again.cpu() - ref).abs().max() / ref.abs().max()) < 1e-4
    backend.close()


def _mixtral_cuda_config() -> hf.MixtralConfig:
    # head_dim 64: the cupy attention backend applies, and with it decode graphs
    return hf.MixtralConfig(
        vocab_size=128,
        hidden_size=256,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=8,
        num_experts_per_tok=2,
        initializer_range=0.05,
    )


def _cuda_engine_config(path: Path):
    from tandem.runtime.config import CacheConfig, EngineConfig, ModelSpec, SchedulerConfig

    return EngineConfig(
        model=ModelSpec(
            model=str(path), device="cuda", dtype="bfloat16", cpu_experts="all", cpu_threads=4
        ),
        cache=CacheConfig(block_size=16, num_blocks=64),
        scheduler=SchedulerConfig(max_num_seqs=8, max_model_len=256, max_num_batched_tokens=64),
    )


@pytest.mark.gpu
def test_engine_on_cuda_with_cpu_experts_decodes_in_graphs_with_and_without_overlap(
    tmp_path: Path,
) -> None:
    """The whole engine on CUDA (bf16, cupy attention) with every expert on the CPU pool: the
    decode graphs are captured with the pool's host functions inside, replayed, and the greedy
    output is the same with overlap, without it, and with graphs off (eager)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from tandem.runtime.cuda_runner import CudaRunnerOptions
    from tandem.runtime.llm import LLM
    from tandem.runtime.sampling_params import SamplingParams

    torch.manual_seed(0)
    hf.AutoModelForCausalLM.from_config(_mixtral_cuda_config()).save_pretrained(tmp_path)
    ec = _cuda_engine_config(tmp_path)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, 128, (n,), generator=gen).tolist() for n in (3, 30, 7, 19, 44)]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    outs = {}
    for graphs, overlap in ((True, False), (True, True), (False, False)):
        opts = CudaRunnerOptions(cuda_graphs=graphs, overlap=overlap)
        llm = LLM(engine_config=ec, runner_options=opts, overlap=overlap)
        runner = llm.engine.runner
        assert getattr(llm.engine.model.attn_backend, "name", None) == "cupy"
        assert llm.engine.model.expert_backend.supports_cuda_graphs
        outs[graphs, overlap] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert all(len(t) == 10 for t in outs[graphs, overlap])
        if graphs:
            assert not runner.counters.fallbacks, runner.counters.fallbacks
            assert runner.counters.graph_steps > 0
        stats = llm.engine.stats().hybrid
        assert stats.layer_calls > 0 and stats.stream_errors == 0
        assert stats.d2h_bytes > 0 and stats.h2d_bytes > 0
        llm.engine.model.expert_backend.close()
    assert outs[True, True] == outs[True, False]
    same = sum(a == b for a, b in zip(outs[True, False], outs[False, False], strict=True))
    assert same >= 4, f"graphs vs eager: {same}/5 identical"  # bf16: a late flip is rounding


@pytest.mark.gpu
@pytest.mark.parametrize("gpu_experts", [0, 2])
@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral", "qwen2_moe", "olmoe"])
@pytest.mark.parametrize("sync", ["flags", "host_func"])
def test_moe_block_in_a_cuda_graph_matches_eager_and_torch(
    name: str, gpu_experts: int, sync: str, tmp_path: Path
) -> None:
    """One MoE block with the cpu_pool backend captured in a CUDA graph (D2H copies, the pool's
    start and wait in stream order: go/done words or host nodes, H2D copy, the shared expert
    and any GPU-resident experts in between): replays with new inputs equal the eager block,
    and the torch expert backend on the pool's own weights; with GPU experts, also after a
    rebalance moved them (in place)."""
    from tandem.models.layers.experts import TorchExpertBackend

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    _save(name, tmp_path)
    model, config = load_model(
        tmp_path,
        dtype=torch.float32,
        device="cuda",
        expert_backend="cpu_pool",
        expert_options={
            "isa": "scalar", "gpu_experts": gpu_experts, "rebalance_after_tokens": 0,
            "sync": sync,
        },
    )  # fmt: skip
    backend = model.expert_backend
    assert backend.sync == sync and backend.supports_cuda_graphs
    block = [m for m in model.modules() if hasattr(m, "w13") and hasattr(m, "layer_idx")][-1]
    w13, w2 = (w.cuda() for w in backend.pool.dequantize(block.layer_idx))
    torch_backend = TorchExpertBackend()

    def reference(x: torch.Tensor) -> torch.Tensor:  # the same block on the torch backend
        ids, weights = block.route(x)
        out = torch_backend.forward(block.layer_idx, x, ids, weights, w13, w2)
        shared = block._shared_expert(x)
        return out if shared is None else out + shared

    gen = torch.Generator().manual_seed(3)
    T, H = 5, config.hidden_size
    x = torch.zeros(T, H, device="cuda")  # the graph's static input
    s = torch.cuda.Stream()
    with torch.no_grad():
        x.copy_(torch.randn(T, H, generator=gen))
        eager = block(x)  # also the warm-up that sizes the pinned buffers
        torch.testing.assert_close(eager, reference(x), rtol=1e-4, atol=1e-5)
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            block(x)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = block(x)
        torch.cuda.synchronize()  # the eager calls' host functions have run
        calls = backend.stats().layer_calls
        for _ in range(4):
            x.copy_(torch.randn(T, H, generator=gen))
            graph.replay()
            got = static_out.clone()
            torch.testing.assert_close(got, block(x), rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(got, reference(x), rtol=1e-4, atol=1e-5)
        if gpu_experts:  # move other experts to the GPU; the graph must follow
            before = backend.stats().gpu_experts[block.layer_idx]
            counts = {
                layer: torch.arange(c.numel(), 0, -1, device=c.device)
                for layer, c in backend._counts.items()
            }
            counts[block.layer_idx] = torch.arange(counts[block.layer_idx].numel(), device="cuda")
            backend.rebalance(counts)
            assert backend.stats().gpu_experts[block.layer_idx] != before
            x.copy_(torch.randn(T, H, generator=gen))
            graph.replay()
            got = static_out.clone()
            torch.testing.assert_close(got, block(x), rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(got, reference(x), rtol=1e-4, atol=1e-5)
    torch.cuda.synchronize()
    stats = backend.stats()
    assert stats.stream_errors == 0
    assert stats.layer_calls == calls + (10 if gpu_experts else 8)  # replays + eager calls
    del graph
    backend.close()


@pytest.mark.gpu
def test_cuda_runner_decode_graphs_with_cpu_pool_match_hf(tmp_path: Path) -> None:
    """The CUDA runner's decode graphs (cupy attention, every expert on the CPU pool) give the
    logits HF transformers computes for the same sequences, to bf16 accuracy."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from tandem.runtime.cuda_runner import CudaRunnerOptions
    from tandem.runtime.llm import LLM
    from tandem.runtime.sampling_params import SamplingParams

    torch.manual_seed(0)
    hf_model = hf.AutoModelForCausalLM.from_config(_mixtral_cuda_config()).eval()
    with torch.no_grad():  # bf16-exact weights: what differs is bf16 activations only
        for p in hf_model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    hf_model.save_pretrained(tmp_path)
    opts = CudaRunnerOptions(cuda_graphs=True, overlap=False)
    llm = LLM(engine_config=_cuda_engine_config(tmp_path), runner_options=opts, overlap=False)
    eng, runner = llm.engine, llm.engine.runner
    assert not runner.counters.fallbacks and runner._graphs, runner.counters.fallbacks
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    gen = torch.Generator().manual_seed(7)
    for i, n in enumerate((4, 23, 11)):
        eng.add_request(str(i), torch.randint(1, 128, (n,), generator=gen).tolist(), greedy)
    while any(eng.scheduler.get_request(str(i)).num_output_tokens == 0 for i in range(3)):
        eng.step()  # prefill (eager)
    worst, agree, total = 0.0, 0, 0
    for _ in range(4):  # decode steps: graph replays (3 sequences -> bucket 4)
        sched = eng.scheduler.schedule()
        with torch.inference_mode():
            prep = runner._prepare(sched)
            with torch.cuda.stream(runner.stream):
                logits = runner._forward(prep)
            runner.stream.synchronize()
        assert prep.graph_bs == 4
        logits = logits.float().cpu()
        seqs = [s for s in sched.seqs if s.sample]
        for row, s in enumerate(seqs):
            tokens = list(s.request.prompt_token_ids) + list(s.request.output_token_ids)
            with torch.no_grad():
                ref = hf_model(torch.tensor([tokens])).logits[0, -1].float()
            worst = max(worst, float((logits[row] - ref).abs().max() / ref.abs().max()))
            agree += int(logits[row].argmax() == ref.argmax())
            total += 1
        eng.scheduler.update(sched, logits.argmax(-1).tolist())
    assert worst < 5e-2, worst
    # near-flat logits of a tiny random model: a rare argmax flip is bf16 rounding
    assert 4 * agree >= 3 * total, f"{agree}/{total} greedy tokens agree"
    stats = eng.stats().hybrid
    assert stats.stream_errors == 0 and runner.counters.graph_steps >= 4
    while eng.has_unfinished_requests():
        eng.step()
    eng.model.expert_backend.close()

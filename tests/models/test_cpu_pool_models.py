"""Qwen3-MoE, Qwen2-MoE and Mixtral through the "cpu_pool" expert backend against HF transformers.

What is exactly comparable: the checkpoint's expert weights are rounded to bf16 before saving,
so the pool's bf16 conversion is lossless; for int8/int4 the HF reference gets the same
quantization (ext/cpu/reference.quantize, which the C++ converter follows). With the "scalar"
ISA the pool computes in fp32 (fp32 activations x converted weights), so logits must match HF
to fp32 accuracy. The SIMD ISAs round activations to bf16: a bf16-sized tolerance applies.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers as hf

from ext.cpu import quantize, supported_isas
from models.layers.cpu_experts import CpuPoolExpertBackend, hybrid_moe_metrics, num_gpu_experts
from models.loader import load_model

COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    initializer_range=0.05,
)
CASES = {
    "qwen3_moe": lambda: hf.Qwen3MoeConfig(
        **COMMON,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        mlp_only_layers=[0],
    ),
    "qwen2_moe": lambda: hf.Qwen2MoeConfig(
        **COMMON,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
    ),
    "mixtral": lambda: hf.MixtralConfig(**COMMON, num_local_experts=8, num_experts_per_tok=2),
}
PROMPT_LENS = [5, 17, 9]


def _expert_params(model: torch.nn.Module):
    return [(n, p) for n, p in model.named_parameters() if ".experts." in n]


def _save(name: str, path: Path) -> torch.nn.Module:
    torch.manual_seed(0)
    model = hf.AutoModelForCausalLM.from_config(CASES[name](), attn_implementation="eager").eval()
    with torch.no_grad():
        for _, p in _expert_params(model):
            p.copy_(p.to(torch.bfloat16).float())
    model.save_pretrained(path)
    return model


def _quantize_reference(model: torch.nn.Module, fmt: str) -> None:
    with torch.no_grad():
        for _, p in _expert_params(model):
            p.copy_(quantize(p, fmt))


def _run(model, config, paged_runner) -> tuple[dict[int, list[int]], dict[int, torch.Tensor]]:
    """Chunked prefill + mixed decode steps; returns the sequences and their logits rows."""
    runner = paged_runner(model, config, block_size=4)
    gen = torch.Generator().manual_seed(1)
    seqs = {
        i: torch.randint(0, config.vocab_size, (n,), generator=gen).tolist()
        for i, n in enumerate(PROMPT_LENS)
    }
    rows: dict[int, list[torch.Tensor]] = {i: [] for i in seqs}
    steps = [[(0, seqs[0]), (1, seqs[1][:8])], [(1, seqs[1][8:]), (2, seqs[2])]]
    for work in steps:
        for seq_id, logits in runner.step(work).items():
            rows[seq_id].append(logits)
    for _ in range(3):
        for seq_id in seqs:
            seqs[seq_id].append(int(rows[seq_id][-1][-1].argmax()))
        for seq_id, logits in runner.step([(i, seqs[i][-1:]) for i in seqs]).items():
            rows[seq_id].append(logits)
    return seqs, {i: torch.cat(r) for i, r in rows.items()}


def _max_rel_diff(hf_model, seqs, rows) -> float:
    worst = 0.0
    for seq_id, ours in rows.items():
        ids = torch.tensor([seqs[seq_id][: ours.shape[0]]])
        with torch.no_grad():
            ref = hf_model(ids).logits[0].float()
        worst = max(worst, float((ours - ref).abs().max() / ref.abs().max()))
    return worst


@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4"])
@pytest.mark.parametrize("name", list(CASES))
def test_scalar_pool_matches_hf_exactly(name: str, fmt: str, tmp_path: Path, paged_runner) -> None:
    hf_model = _save(name, tmp_path)
    if fmt != "bf16":
        _quantize_reference(hf_model, fmt)
    model, config = load_model(
        tmp_path,
        dtype=torch.float32,
        device="cpu",
        expert_backend="cpu_pool",
        expert_options={"fmt": fmt, "isa": "scalar", "num_threads": 2},
    )
    backend = model.expert_backend
    assert isinstance(backend, CpuPoolExpertBackend)
    # The torch copies are gone: the pool holds the experts.
    moe_blocks = [m for m in model.modules() if hasattr(m, "w13")]
    assert moe_blocks and all(b.w13.numel() == 0 and b.w2.numel() == 0 for b in moe_blocks)
    seqs, rows = _run(model, config, paged_runner)
    assert _max_rel_diff(hf_model, seqs, rows) < 1e-4
    stats = backend.stats()
    num_moe_layers = len(moe_blocks)
    assert stats.layer_calls == 5 * num_moe_layers
    routed = sum(len(s) for s in seqs.values())  # every token ran once
    for counts in stats.routing_counts.values():
        assert sum(counts) == routed * config.num_experts_per_tok
    backend.close()


@pytest.mark.parametrize("name", list(CASES))
def test_simd_pool_matches_hf_to_bf16(name: str, tmp_path: Path, paged_runner) -> None:
    isa = supported_isas()[-1]
    if isa == "scalar":
        pytest.skip("this CPU has no SIMD path")  # pragma: no cover
    hf_model = _save(name, tmp_path)
    model, config = load_model(
        tmp_path,
        dtype=torch.float32,
        device="cpu",
        expert_backend="cpu_pool",
        expert_options={"isa": isa},
    )
    seqs, rows = _run(model, config, paged_runner)
    rel = _max_rel_diff(hf_model, seqs, rows)
    assert rel < 2e-2, f"{isa}: {rel:.3e}"
    model.expert_backend.close()


@pytest.mark.parametrize("name", ["qwen2_moe", "mixtral"])
def test_split_placement_and_rebalance_match_hf(name: str, tmp_path: Path, paged_runner) -> None:
    """3 experts per layer "on the GPU" (torch, here on the CPU) and 5 on the pool, summed; then
    re-placed by routing counts. Still HF's logits."""
    hf_model = _save(name, tmp_path)
    model, config = load_model(
        tmp_path,
        dtype=torch.float32,
        device="cpu",
        expert_backend="cpu_pool",
        expert_options={"isa": "scalar", "cpu_experts": 5, "rebalance_after_tokens": 0},
    )
    backend = model.expert_backend
    assert backend.stats().gpu_experts == {i: [0, 1, 2] for i in backend.stats().gpu_experts}
    seqs, rows = _run(model, config, paged_runner)
    assert _max_rel_diff(hf_model, seqs, rows) < 1e-4
    counts = backend.stats().routing_counts
    ptrs = {layer: p.w13.data_ptr() for layer, p in backend._placements.items()}
    backend.rebalance()
    # in place: CUDA graphs captured before a rebalance read these tensors by address
    assert {layer: p.w13.data_ptr() for layer, p in backend._placements.items()} == ptrs
    for layer, ids in backend.stats().gpu_experts.items():
        hottest = sorted(range(8), key=lambda e: -counts[layer][e])[:3]
        assert sorted(counts[layer][e] for e in ids) == sorted(counts[layer][e] for e in hottest)
    seqs2, rows2 = _run(model, config, paged_runner)
    assert _max_rel_diff(hf_model, seqs2, rows2) < 1e-4
    metrics = hybrid_moe_metrics(model)
    assert metrics["tandem_moe_layer_calls_total"] == backend.stats().layer_calls > 0
    assert 0.0 < metrics["tandem_moe_pool_utilisation"] <= 1.0
    backend.close()


@pytest.mark.parametrize("tokens", [1, 5, 300])
def test_dense_and_grouped_local_experts_agree(tokens: int) -> None:
    """GPU-resident experts: the dense path (graph sizes, no host sync) equals the grouped one,
    including tokens routed to several local experts and slots routed elsewhere (-1)."""
    from models.layers.cpu_experts import _dense_experts, _grouped_experts, _local_experts

    g = torch.Generator().manual_seed(tokens)
    G, H, inter, k = 4, 32, 24, 3
    hidden = torch.randn(tokens, H, generator=g)
    local = torch.randint(-1, G, (tokens, k), generator=g)
    weights = torch.rand(tokens, k, generator=g)
    w13 = torch.randn(G, 2 * inter, H, generator=g) * 0.1
    w2 = torch.randn(G, H, inter, generator=g) * 0.1
    grouped = _grouped_experts(hidden, local, weights, w13, w2)
    dense = _dense_experts(hidden, local, weights, w13, w2)
    torch.testing.assert_close(dense, grouped, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        _local_experts(hidden, local, weights, w13, w2), grouped, rtol=1e-5, atol=1e-5
    )
    none_here = torch.full_like(local, -1)
    assert _dense_experts(hidden, none_here, weights, w13, w2).abs().max() == 0


def test_placement_arithmetic() -> None:
    assert num_gpu_experts(8, "all", None) == 0
    assert num_gpu_experts(8, None, 2) == 2
    assert num_gpu_experts(8, "all", 3) == 3
    assert num_gpu_experts(8, "6", None) == 2
    assert num_gpu_experts(8, 6, 2) == 2
    with pytest.raises(ValueError):
        num_gpu_experts(8, 6, 3)
    with pytest.raises(ValueError):
        CpuPoolExpertBackend(fmt="fp8")


def _llm(path: Path, **spec: object):
    from runtime.config import CacheConfig, EngineConfig, ModelSpec, SchedulerConfig
    from runtime.llm import LLM

    ec = EngineConfig(
        model=ModelSpec(model=str(path), device="cpu", dtype="float32", **spec),
        cache=CacheConfig(block_size=4, num_blocks=96),
        scheduler=SchedulerConfig(max_num_seqs=8, max_model_len=128, max_num_batched_tokens=24),
    )
    return LLM(engine_config=ec)


def test_engine_greedy_equals_torch_backend(tmp_path: Path, monkeypatch) -> None:
    """The offline API through ModelSpec(cpu_experts="all"): 6 concurrent requests (chunked
    prefill, mixed steps), then a second round on the same pool. The expert weights are bf16
    values and the scalar pool computes in fp32, so greedy tokens equal the torch backend's."""
    from runtime.sampling_params import SamplingParams

    monkeypatch.setenv("TANDEM_CPU_ISA", "scalar")
    _save("mixtral", tmp_path)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 128, (n,), generator=gen).tolist() for n in (3, 30, 7, 19, 1, 44)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in _llm(tmp_path).generate(prompts, params)]
    llm = _llm(tmp_path, cpu_experts="all", cpu_threads=1)
    backend = llm.engine.model.expert_backend
    assert isinstance(backend, CpuPoolExpertBackend)
    for _ in range(2):  # pool reuse across requests
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert got == ref
    stats = backend.stats()
    assert stats.pool_threads == 1 and stats.pool_busy_seconds > 0
    from runtime.metrics import render_hybrid_moe

    engine_stats = llm.engine.stats()
    assert engine_stats.hybrid is not None and engine_stats.hybrid.layer_calls > 0
    text = render_hybrid_moe(engine_stats.hybrid)
    assert 'tandem:moe_expert_routed_total{expert="0",layer="0"}' in text
    assert "tandem:moe_pool_wait_seconds_total" in text and "tandem:moe_pool_utilisation" in text
    first_round = sum(len(p) + 11 for p in prompts)  # the 12th token is sampled, never run
    routed = [sum(c) for c in stats.routing_counts.values()]  # round 2 hits the prefix cache
    assert routed[0] == routed[1] and 2 * first_round < routed[0] < 4 * first_round
    backend.close()


def _one_sequence_batch(n: int, device: str, kv) -> tuple[torch.Tensor, torch.Tensor, object]:
    from models.batch import ForwardBatch

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
    from models.batch import KVCache

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


@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0", "Q4_1", "Q4_K"])
def test_gguf_experts_into_pool(qtype: str, tmp_path: Path) -> None:
    """Stacked GGUF expert tensors -> pool formats. Q4_0 -> int4/32 is lossless; the others
    equal the pool's quantizer applied to the decoded values (ext/cpu/reference.quantize)."""
    gguf = pytest.importorskip("gguf")
    import numpy as np

    from ext.cpu import CpuExpertPool
    from models.gguf_dequant import dequantize
    from models.loader.gguf_experts import AUTO_FORMATS, load_gguf_experts

    Q = gguf.GGMLQuantizationType
    qt = Q[qtype]
    E, inter, H = 3, 256, 256  # Q4_K rows hold whole 256-element super-blocks
    rng = np.random.default_rng(int(qt))
    block, size = gguf.GGML_QUANT_SIZES[qt]

    def packed(shape):  # [E, out, in] -> raw blocks [E, out, in / block * size]
        if qtype == "Q4_K":
            raw = rng.integers(0, 256, (int(np.prod(shape)) // block, size), dtype=np.uint8)
            raw[:, 0:4] = (
                rng.uniform(-0.05, 0.05, (raw.shape[0], 2)).astype(np.float16).view(np.uint8)
            )
            return raw.reshape(*shape[:-1], -1)
        return gguf.quants.quantize(rng.standard_normal(shape).astype(np.float32) * 0.02, qt)

    tensors = {f"blk.1.ffn_{w}_exps.weight": packed(s) for w, s in
               (("gate", (E, inter, H)), ("up", (E, inter, H)), ("down", (E, H, inter)))}  # fmt: skip
    path = tmp_path / "experts.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen3moe")
    for name, arr in tensors.items():
        writer.add_tensor(name, arr, raw_dtype=qt)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    def decoded(name, shape):
        raw = np.ascontiguousarray(tensors[name]).view(np.uint8).reshape(-1)
        return dequantize(raw, int(qt), shape, torch.float32, name=name)

    gate = decoded("blk.1.ffn_gate_exps.weight", (E, inter, H))
    up = decoded("blk.1.ffn_up_exps.weight", (E, inter, H))
    down = decoded("blk.1.ffn_down_exps.weight", (E, H, inter))
    src13 = torch.cat([gate, up], dim=1)
    with CpuExpertPool(num_threads=1, isa="scalar") as pool:
        assert load_gguf_experts(path, pool) == {1: AUTO_FORMATS[qtype]}
        w13, w2 = pool.dequantize(1)
    fmt, group = AUTO_FORMATS[qtype]
    if qtype == "Q4_0":
        assert torch.equal(w13, src13) and torch.equal(w2, down)
    else:
        torch.testing.assert_close(w13, quantize(src13, fmt, group), rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(w2, quantize(down, fmt, group), rtol=1e-6, atol=1e-7)
    rel = float((w13 - src13).norm() / src13.norm())
    assert rel < (0.02 if qtype == "Q8_0" else 0.12), rel


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
    from runtime.config import CacheConfig, EngineConfig, ModelSpec, SchedulerConfig

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
    from runtime.cuda_runner import CudaRunnerOptions
    from runtime.llm import LLM
    from runtime.sampling_params import SamplingParams

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
@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral", "qwen2_moe"])
@pytest.mark.parametrize("sync", ["flags", "host_func"])
def test_moe_block_in_a_cuda_graph_matches_eager_and_torch(
    name: str, gpu_experts: int, sync: str, tmp_path: Path
) -> None:
    """One MoE block with the cpu_pool backend captured in a CUDA graph (D2H copies, the pool's
    start and wait in stream order: go/done words or host nodes, H2D copy, the shared expert
    and any GPU-resident experts in between): replays with new inputs equal the eager block,
    and the torch expert backend on the pool's own weights; with GPU experts, also after a
    rebalance moved them (in place)."""
    from models.layers.experts import TorchExpertBackend

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
    from runtime.cuda_runner import CudaRunnerOptions
    from runtime.llm import LLM
    from runtime.sampling_params import SamplingParams

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


@pytest.mark.parametrize("fmt", ["bf16", "int4"])
def test_second_start_loads_converted_experts_from_the_cache(
    fmt: str, tmp_path: Path, monkeypatch
) -> None:
    """The first LLM converts each MoE layer and saves it under $TANDEM_HOME/expert_cache; the
    second maps the saved layers (no conversion) and generates the same greedy tokens. A
    corrupted file falls back to converting; TANDEM_EXPERT_CACHE=0 turns the cache off."""
    from runtime.sampling_params import SamplingParams

    monkeypatch.setenv("TANDEM_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("TANDEM_EXPERT_CACHE", raising=False)
    model_dir = tmp_path / "model"
    _save("qwen3_moe", model_dir)  # layer 0 dense, layer 1 MoE
    prompts = [[5, 9, 17, 3], list(range(1, 30))]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    def start() -> tuple[list[list[int]], CpuPoolExpertBackend]:
        llm = _llm(model_dir, cpu_experts="all", cpu_threads=1, cpu_expert_format=fmt)
        backend = llm.engine.model.expert_backend
        tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        backend.close()
        return tokens, backend

    first, b1 = start()
    assert (b1.pool.layers_converted, b1.pool.layers_loaded) == (1, 0)
    files = list((tmp_path / "home" / "expert_cache").glob("*/layer_1.bin"))
    assert len(files) == 1
    second, b2 = start()
    assert (b2.pool.layers_converted, b2.pool.layers_loaded) == (0, 1)
    assert second == first
    files[0].write_bytes(files[0].read_bytes()[:-7])  # short: converted again, then re-saved
    third, b3 = start()
    assert (b3.pool.layers_converted, b3.pool.layers_loaded) == (1, 0) and third == first
    assert start()[1].pool.layers_loaded == 1
    monkeypatch.setenv("TANDEM_EXPERT_CACHE", "0")
    off, b5 = start()
    assert (b5.pool.layers_converted, b5.pool.layers_loaded) == (1, 0) and off == first


def _count_reads(monkeypatch) -> list[tuple[str, int]]:
    """(name, bytes) of every tensor the safetensors loader reads from now on."""
    import models.loader.safetensors as st_loader

    reads: list[tuple[str, int]] = []
    real = st_loader.safe_open

    class Counting:
        def __init__(self, *args: object, **kwargs: object) -> None:
            self._open = real(*args, **kwargs)

        def __enter__(self) -> Counting:
            self._file = self._open.__enter__()
            return self

        def __exit__(self, *exc: object) -> None:
            self._open.__exit__(*exc)

        def keys(self) -> list[str]:
            return self._file.keys()

        def get_tensor(self, name: str) -> torch.Tensor:
            t = self._file.get_tensor(name)
            reads.append((name, t.numel() * t.element_size()))
            return t

    monkeypatch.setattr(st_loader, "safe_open", Counting)
    return reads


def _expert_layers_read(reads: list[tuple[str, int]]) -> set[int]:
    from models.weights import expert_layer

    return {expert_layer(n) for n, _ in reads} - {None}


@pytest.mark.parametrize(
    "name,fmt,cpu_experts", [("qwen3_moe", "int4", "all"), ("mixtral", "int8", 5)]
)
def test_cache_hit_reads_no_expert_tensor(
    name: str, fmt: str, cpu_experts: str | int, tmp_path: Path, monkeypatch, paged_runner, caplog
) -> None:
    """A second start maps every MoE layer from the expert cache without reading one expert
    tensor of the checkpoint, and computes the first start's logits exactly (with 3 experts a
    layer "on the GPU" for Mixtral, placed from the pool's weights either way). A layer whose
    file is damaged before the start is read and converted again, alone; one damaged after the
    loader's header check (the read has skipped it) is re-read alone, with a warning."""
    from models.layers.cpu_experts import CpuPoolExpertBackend

    # a directory of its own (TANDEM_HOME would also move the built extension: a rebuild)
    monkeypatch.setenv("TANDEM_EXPERT_CACHE", str(tmp_path / "expert_cache"))
    model_dir = tmp_path / "model"
    _save(name, model_dir)
    reads = _count_reads(monkeypatch)
    opts = {"fmt": fmt, "isa": "scalar", "num_threads": 2, "cpu_experts": cpu_experts,
            "rebalance_after_tokens": 0}  # fmt: skip

    def start() -> tuple[dict[int, torch.Tensor], CpuPoolExpertBackend, set[int]]:
        reads.clear()
        model, config = load_model(
            model_dir, dtype=torch.float32, device="cpu", expert_backend="cpu_pool",
            expert_options=opts,
        )  # fmt: skip
        backend = model.expert_backend
        _, rows = _run(model, config, paged_runner)
        backend.close()
        return rows, backend, _expert_layers_read(reads)

    first, b1, read1 = start()
    moe_layers = set(b1._counts)
    assert moe_layers == ({1} if name == "qwen3_moe" else {0, 1})
    assert read1 == moe_layers and b1.pool.layers_converted == len(moe_layers)
    all_bytes = sum(n for _, n in reads)

    second, b2, read2 = start()
    assert read2 == set() and (b2.pool.layers_converted, b2.pool.layers_loaded) == (
        0,
        len(moe_layers),
    )
    assert not any(".experts." in n for n, _ in reads) and reads  # the rest is still read
    assert sum(n for _, n in reads) < all_bytes
    for seq, rows in first.items():
        assert torch.equal(rows, second[seq])
    if cpu_experts != "all":
        for b in (b1, b2):  # (stats() needs the open pool)
            assert {i: p.expert_ids.tolist() for i, p in b._placements.items()} == {
                0: [0, 1, 2],
                1: [0, 1, 2],
            }

    bad = max(moe_layers)
    path = next((tmp_path / "expert_cache").glob(f"*/layer_{bad}.bin"))
    path.write_bytes(path.read_bytes()[:-1])  # before the start: the header check refuses it
    third, b3, read3 = start()
    assert read3 == {bad} and (b3.pool.layers_converted, b3.pool.layers_loaded) == (
        1,
        len(moe_layers) - 1,
    )
    for seq, rows in first.items():
        assert torch.equal(rows, third[seq])

    real_skip = CpuPoolExpertBackend.skip_expert_layers

    def skip_then_damage(self, *args):  # the file goes bad between the check and attach
        skipped = real_skip(self, *args)
        assert skipped == frozenset(moe_layers)
        data = bytearray(path.read_bytes())
        data[20] ^= 1  # header checksum
        path.write_bytes(bytes(data))
        return skipped

    monkeypatch.setattr(CpuPoolExpertBackend, "skip_expert_layers", skip_then_damage)
    with caplog.at_level("WARNING"):
        fourth, b4, read4 = start()
    assert read4 == {bad} and b4.pool.layers_converted == 1
    assert "checksum" in caplog.text and f"re-reading layer {bad}'s experts" in caplog.text
    for seq, rows in first.items():
        assert torch.equal(rows, fourth[seq])
    monkeypatch.setattr(CpuPoolExpertBackend, "skip_expert_layers", real_skip)
    fifth, b5, read5 = start()  # re-saved by the fall-back: a clean hit again
    assert read5 == set() and b5.pool.layers_loaded == len(moe_layers)


def test_skipped_layers_are_not_expected(tmp_path: Path) -> None:
    """Leaving out a layer's experts leaves out exactly those: a missing router or shared
    expert of that layer is still an error, and so is a missing expert of another layer."""
    from safetensors.torch import load_file, save_file

    from models.config import ModelConfig, UnsupportedModelError
    from models.loader import build_model
    from models.weights import expert_layer

    _save("qwen2_moe", tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    model = build_model(ModelConfig.from_pretrained(tmp_path), dtype=torch.float32, device="cpu")

    def not_layer_1(name: str) -> bool:
        return expert_layer(name) != 1

    kept = {n: t for n, t in tensors.items() if not_layer_1(n)}
    assert len(kept) < len(tensors)
    assert any("layers.1.mlp.shared_expert." in n for n in kept)
    assert "model.layers.1.mlp.gate.weight" in kept
    model.load_weights(kept.items(), expected=not_layer_1)
    for missing in ("model.layers.1.mlp.gate.weight", "model.layers.1.mlp.shared_expert_gate.weight",
                    "model.layers.0.mlp.experts.3.up_proj.weight"):  # fmt: skip
        partial = {n: t for n, t in kept.items() if n != missing}
        with pytest.raises(UnsupportedModelError, match="missing"):
            model.load_weights(partial.items(), expected=not_layer_1)
    save_file(kept, tmp_path / "model.safetensors")  # a checkpoint really without them
    with pytest.raises(UnsupportedModelError, match=r"missing tensors.*layers\.1\.mlp\.experts"):
        load_model(tmp_path, dtype=torch.float32, device="cpu")


def _tiny_qwen3moe_gguf(path: Path) -> None:
    """Two MoE layers, F32 tensors holding bf16 values (the pool's bf16 is then lossless)."""
    gguf = pytest.importorskip("gguf")
    import numpy as np

    g = torch.Generator().manual_seed(0)
    vocab, hidden, heads, kv_heads, hd, experts, inter = 128, 64, 4, 2, 16, 8, 32

    def rand(*shape: int, std: float = 0.05) -> np.ndarray:
        return (torch.randn(*shape, generator=g) * std).bfloat16().float().numpy()

    tensors = {"token_embd.weight": rand(vocab, hidden), "output_norm.weight": rand(hidden) + 1,
               "output.weight": rand(vocab, hidden)}  # fmt: skip
    for i in range(2):
        tensors |= {
            f"blk.{i}.attn_norm.weight": rand(hidden) + 1,
            f"blk.{i}.attn_q.weight": rand(heads * hd, hidden),
            f"blk.{i}.attn_k.weight": rand(kv_heads * hd, hidden),
            f"blk.{i}.attn_v.weight": rand(kv_heads * hd, hidden),
            f"blk.{i}.attn_output.weight": rand(hidden, heads * hd),
            f"blk.{i}.attn_q_norm.weight": rand(hd) + 1,
            f"blk.{i}.attn_k_norm.weight": rand(hd) + 1,
            f"blk.{i}.ffn_norm.weight": rand(hidden) + 1,
            f"blk.{i}.ffn_gate_inp.weight": rand(experts, hidden, std=0.5),
            f"blk.{i}.ffn_gate_exps.weight": rand(experts, inter, hidden),
            f"blk.{i}.ffn_up_exps.weight": rand(experts, inter, hidden),
            f"blk.{i}.ffn_down_exps.weight": rand(experts, hidden, inter),
        }
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    for key, value in {"block_count": 2, "embedding_length": hidden, "vocab_size": vocab,
                       "feed_forward_length": 96,
                       "attention.head_count": heads, "attention.head_count_kv": kv_heads,
                       "attention.key_length": hd, "expert_count": experts,
                       "expert_used_count": 2, "expert_feed_forward_length": inter,
                       "context_length": 256}.items():  # fmt: skip
        w.add_uint32(f"qwen3moe.{key}", value)
    w.add_float32("qwen3moe.rope.freq_base", 1e6)
    w.add_float32("qwen3moe.attention.layer_norm_rms_epsilon", 1e-6)
    for name, array in tensors.items():
        w.add_tensor(name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_experts_are_never_decoded_by_the_loader(
    tmp_path: Path, monkeypatch, paged_runner
) -> None:
    """A GGUF's stacked experts go into the pool from the file's blocks: the loader never
    decodes them into torch (first start), and a cache hit reads them not at all (second)."""
    import models.loader.gguf as gguf_loader
    import models.loader.gguf_experts as gguf_experts

    # a directory of its own (TANDEM_HOME would also move the built extension: a rebuild)
    monkeypatch.setenv("TANDEM_EXPERT_CACHE", str(tmp_path / "expert_cache"))
    path = tmp_path / "moe.gguf"
    _tiny_qwen3moe_gguf(path)
    decoded: list[str] = []
    for module in (gguf_loader, gguf_experts):
        monkeypatch.setattr(
            module,
            "dequantize_tensor",
            lambda reader, info, *a, _real=module.dequantize_tensor, **k: (
                decoded.append(info.name) or _real(reader, info, *a, **k)
            ),
        )
    ref_model, config = load_model(path, dtype=torch.float32, device="cpu")
    _, ref = _run(ref_model, config, paged_runner)
    assert sum("_exps" in n for n in decoded) == 6  # the torch backend needs them

    def start():
        decoded.clear()
        model, config = load_model(
            path, dtype=torch.float32, device="cpu", expert_backend="cpu_pool",
            expert_options={"fmt": "auto", "isa": "scalar", "num_threads": 2},
        )  # fmt: skip
        _, rows = _run(model, config, paged_runner)
        model.expert_backend.close()
        return rows, model.expert_backend.pool, [n for n in decoded if "_exps" in n]

    first, pool1, exps1 = start()
    assert pool1.layers_converted == 2 and len(exps1) == 6  # once each, by gguf_experts only
    for seq, rows in ref.items():
        assert float((first[seq] - rows).abs().max() / rows.abs().max()) < 1e-4
    second, pool2, exps2 = start()
    assert (pool2.layers_converted, pool2.layers_loaded) == (0, 2) and exps2 == []
    for seq, rows in first.items():
        assert torch.equal(rows, second[seq])

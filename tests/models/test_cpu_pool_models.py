"""Qwen3-MoE, Qwen2-MoE, Mixtral and OLMoE through the "cpu_pool" expert backend against HF
transformers.

What is exactly comparable: the checkpoint's expert weights are rounded to bf16 before saving,
so the pool's bf16 conversion is lossless; for int8/int4 the HF reference gets the same
quantization (ext/cpu/reference.quantize, which the C++ converter follows). With the "scalar"
ISA the pool computes in fp32 (fp32 activations x converted weights), so logits must match HF
to fp32 accuracy. The SIMD ISAs round activations to bf16: a bf16-sized tolerance applies.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tandem.ext.cpu import quantize, supported_isas
from tandem.models.layers.cpu_expert_options import num_gpu_experts
from tandem.models.layers.cpu_experts import CpuPoolExpertBackend
from tandem.models.layers.cpu_pool_stats import hybrid_moe_metrics
from tandem.models.loader import load_model
from tests.models.moe_cases import (
    CASES,
    ODD_CASES,
    _llm,
    _max_rel_diff,
    _quantize_reference,
    _run,
    _save,
)

ROOT = Path(__file__).resolve().parents[2]


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


@pytest.mark.parametrize(
    "isa,fmt,group", [("scalar", "int4", 32), ("scalar", "int8", 64), ("simd", "int4", 32),
                      ("simd", "bf16", 64)],
)  # fmt: skip
@pytest.mark.parametrize("name", list(ODD_CASES))
def test_odd_shapes_match_hf(
    name: str, isa: str, fmt: str, group: int, tmp_path: Path, paged_runner
) -> None:
    """Hidden and expert sizes the pool pads (72, 136, 200; 40, 100), head_dim 34, one expert,
    top-k of all experts, a sparse step, an mlp-only layer, tied embeddings: HF's logits, to
    fp32 accuracy on the scalar ISA, to a bf16-sized tolerance on the SIMD one (int4 groups of
    32 there: activations quantized to int8 per block)."""
    if isa == "simd":
        isa = supported_isas()[-1]
        if isa == "scalar":
            pytest.skip("this CPU has no SIMD path")  # pragma: no cover
    hf_model = _save(name, tmp_path)
    if fmt != "bf16":
        _quantize_reference(hf_model, fmt, group)
    model, config = load_model(
        tmp_path,
        dtype=torch.float32,
        device="cpu",
        expert_backend="cpu_pool",
        expert_options={"fmt": fmt, "group_size": group, "isa": isa, "num_threads": 2},
    )
    seqs, rows = _run(model, config, paged_runner)
    rel = _max_rel_diff(hf_model, seqs, rows)
    assert rel < (1e-4 if isa == "scalar" else 2e-2), f"{isa}: {rel:.3e}"
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
    from tandem.models.layers.local_experts import _dense_experts, _grouped_experts, _local_experts

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


@pytest.mark.parametrize("name", ["mixtral", "olmoe"])  # every layer MoE
def test_engine_greedy_equals_torch_backend(name: str, tmp_path: Path, monkeypatch) -> None:
    """The offline API through ModelSpec(cpu_experts="all") (`tandem generate --cpu-experts
    all`): 6 concurrent requests (chunked prefill, mixed steps), then a second round on the same
    pool. The expert weights are bf16 values and the scalar pool computes in fp32, so greedy
    tokens equal the torch backend's."""
    from tandem.runtime.sampling_params import SamplingParams

    monkeypatch.setenv("TANDEM_CPU_ISA", "scalar")
    _save(name, tmp_path)
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
    from tandem.runtime.metrics import render_hybrid_moe

    engine_stats = llm.engine.stats()
    assert engine_stats.hybrid is not None and engine_stats.hybrid.layer_calls > 0
    text = render_hybrid_moe(engine_stats.hybrid)
    assert 'tandem:moe_expert_routed_total{expert="0",layer="0"}' in text
    assert "tandem:moe_pool_wait_seconds_total" in text and "tandem:moe_pool_utilisation" in text
    first_round = sum(len(p) + 11 for p in prompts)  # the 12th token is sampled, never run
    routed = [sum(c) for c in stats.routing_counts.values()]  # round 2 hits the prefix cache
    assert routed[0] == routed[1] and 2 * first_round < routed[0] < 4 * first_round
    backend.close()


@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0", "Q4_1", "Q4_K"])
def test_gguf_experts_into_pool(qtype: str, tmp_path: Path) -> None:
    """Stacked GGUF expert tensors -> pool formats. Q4_0 -> int4/32 is lossless; the others
    equal the pool's quantizer applied to the decoded values (ext/cpu/reference.quantize)."""
    gguf = pytest.importorskip("gguf")
    import numpy as np

    from tandem.ext.cpu import CpuExpertPool
    from tandem.models.gguf_dequant import dequantize
    from tandem.models.loader.gguf_experts import AUTO_FORMATS, load_gguf_experts

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
    with CpuExpertPool(num_threads=1, isa="scalar") as pool:  # --cpu-expert-group-size 64
        assert load_gguf_experts(path, pool, "int4", group_size=64) == {1: ("int4", 64)}
        torch.testing.assert_close(pool.dequantize(1)[1], quantize(down, "int4", 64))


@pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs Linux affinity and two allowed cpus",
)
def test_backend_confines_the_process_on_cuda_only_and_close_undoes_it() -> None:
    """`confine` (called by attach): nothing off CUDA or with TANDEM_POOL_CONFINE=off; on CUDA
    the process's threads go to the pool's spare cpus and torch's CPU threads to that many;
    close puts both back. In a child process: affinity sticks to the process."""
    code = textwrap.dedent(
        """
        import os, torch
        from tandem.models.layers.cpu_experts import CpuPoolExpertBackend
        allowed, threads = os.sched_getaffinity(0), torch.get_num_threads()
        b = CpuPoolExpertBackend(fmt="bf16", num_threads=1)
        assert b.confine() == []  # the model is not on CUDA
        b._on_cuda = True  # as add_block sets it for a CUDA model
        os.environ["TANDEM_POOL_CONFINE"] = "off"
        assert b.confine() == [] and os.sched_getaffinity(0) == allowed
        os.environ["TANDEM_POOL_CONFINE"] = "auto"
        cpus = b.confine()
        assert cpus == b.pool.spare_cpus and len(cpus) == len(allowed) - 1
        assert os.sched_getaffinity(0) == set(cpus) and torch.get_num_threads() == len(cpus)
        b.close()
        assert os.sched_getaffinity(0) == allowed and torch.get_num_threads() == threads
        print("ok")
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]


def test_pool_spin_from_the_environment(monkeypatch) -> None:
    """With the model on the CPU the workers sleep as soon as a job is done (spin 0);
    TANDEM_POOL_SPIN_US sets the spin where the caller gave none; a bad value is a clear
    error."""
    monkeypatch.delenv("TANDEM_POOL_SPIN_US", raising=False)
    b = CpuPoolExpertBackend(fmt="bf16", num_threads=1)
    assert b.pool.spin_us == 0
    b.close()
    monkeypatch.setenv("TANDEM_POOL_SPIN_US", "300")
    b = CpuPoolExpertBackend(fmt="bf16", num_threads=1)
    assert b.pool.spin_us == 300
    b.close()
    b = CpuPoolExpertBackend(fmt="bf16", num_threads=1, spin_us=50)  # the argument wins
    assert b.pool.spin_us == 50
    b.close()
    monkeypatch.setenv("TANDEM_POOL_SPIN_US", "fast")
    with pytest.raises(ValueError, match="TANDEM_POOL_SPIN_US"):
        CpuPoolExpertBackend(fmt="bf16", num_threads=1).pool  # noqa: B018

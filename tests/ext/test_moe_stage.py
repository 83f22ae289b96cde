"""The CPU-pool MoE layer's GPU side in two kernels (ext/cuda/moe_stage.cu): the router +
staging kernel against the torch router and the pinned buffers it fills, the gather kernel,
and a bf16 MoE block on the cpu_pool backend with the kernels against the same block without
them (eager and in a CUDA graph).

GPU tests carry the `gpu` marker and skip without CUDA/CuPy; pinned outputs are poisoned
before each launch, so an unwritten element fails.
"""

from __future__ import annotations

import pytest
import torch

import tandem.ext.cuda as cuda_ext
from tandem.ext.cuda import moe_stage

_requires_cuda = pytest.mark.skipif(not cuda_ext.is_available(), reason="needs CUDA and CuPy")


def gpu_test(fn):
    return pytest.mark.gpu(_requires_cuda(fn))


def test_supported_needs_cuda_16bit_and_sane_k():
    h, lg = torch.zeros(2, 64, dtype=torch.bfloat16), torch.zeros(2, 8, dtype=torch.bfloat16)
    assert not moe_stage.supported(h, lg, 2)  # CPU


def test_backend_route_and_start_declines_on_cpu():
    from tandem.models.layers.cpu_experts import CpuPoolExpertBackend

    b = CpuPoolExpertBackend()
    x = torch.zeros(2, 64, dtype=torch.bfloat16)
    assert b.route_and_start(0, x, torch.zeros(2, 8, dtype=torch.bfloat16), 2, True) is None


def _pinned(T, H, k):
    return (
        torch.full((T + 3, H), float("nan"), pin_memory=True),
        torch.full((T + 3, k), -7, dtype=torch.int64, pin_memory=True),
        torch.full((T + 3, k), float("nan"), pin_memory=True),
    )


@gpu_test
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("T,H,E,k,renorm", [(1, 2048, 128, 8, True), (5, 512, 64, 4, False),
                                            (300, 256, 8, 2, True), (17, 128, 1000, 1, True)])  # fmt: skip
def test_route_stage_matches_torch_router(dtype, T, H, E, k, renorm):
    g = torch.Generator(device="cuda").manual_seed(T * 31 + E)
    hidden = torch.randn(T, H, device="cuda", generator=g).to(dtype)
    logits = (torch.randn(T, E, device="cuda", generator=g) * 2).to(dtype)
    local = torch.full((E,), -1, dtype=torch.int64, device="cuda")
    local[1::3] = torch.arange(len(range(1, E, 3)), device="cuda")
    counts = torch.zeros(E, dtype=torch.int64, device="cuda")
    x_h, ids_h, w_h = _pinned(T, H, k)
    ids, w = moe_stage.route_stage(hidden, logits, k, renorm, x_h, ids_h, w_h, local, counts)
    torch.cuda.synchronize()
    _, ref_w = moe_stage.route_ref(logits, k, renorm)
    torch.testing.assert_close(w, ref_w, rtol=1e-5, atol=1e-6)
    # bf16 logits tie exactly now and then, and torch.topk orders tied experts its own way: so
    # check that every chosen expert is distinct and has the probability of its rank
    probs = torch.softmax(logits.float(), dim=-1)
    top = probs.topk(k, dim=-1).values
    torch.testing.assert_close(probs.gather(1, ids), top, rtol=1e-6, atol=0)
    assert bool((ids.sort(dim=1).values.diff(dim=1) > 0).all())
    assert torch.equal(ids_h[:T], torch.where(local[ids] >= 0, -1, ids).cpu())
    assert torch.equal(w_h[:T], w.cpu())
    assert torch.equal(x_h[:T], hidden.float().cpu())
    assert bool(x_h[T:].isnan().all()) and bool((ids_h[T:] == -7).all())  # rows past T untouched
    assert torch.equal(counts, torch.bincount(ids.flatten(), minlength=E))


@gpu_test
@pytest.mark.parametrize("T", [1, 200])  # zero-copy read, and the staged copy of a large call
@pytest.mark.parametrize("with_extra", [False, True])
def test_gather(T, with_extra):
    H = 2048
    pool_out = torch.randn(T, H).pin_memory()
    extra = torch.randn(T, H, device="cuda") if with_extra else None
    staging = torch.full((256, H), float("nan"), device="cuda")
    out = moe_stage.gather(pool_out, extra, torch.bfloat16, staging)
    ref = pool_out.cuda() + (extra if extra is not None else 0)
    assert torch.equal(out, ref.to(torch.bfloat16))


@gpu_test
@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral", "qwen2_moe"])
@pytest.mark.parametrize("gpu_experts", [0, 2])
def test_moe_block_with_fused_stage_equals_torch_router(name, gpu_experts, tmp_path, monkeypatch):
    """A bf16 MoE block on the cpu_pool backend: with the fused stage (eager and captured) it
    equals the same block routed in torch (TANDEM_FUSED_MOE_STAGE=0), up to the last bit of
    bf16 (the kernel's softmax rounds differently in fp32, so a weight may differ in its last
    float bits)."""
    from tandem.models.layers import cpu_pool_cuda
    from tandem.models.loader import load_model
    from tests.models.moe_cases import _save

    _save(name, tmp_path)
    model, config = load_model(
        tmp_path, dtype=torch.bfloat16, device="cuda", expert_backend="cpu_pool",
        expert_options={"isa": "scalar", "gpu_experts": gpu_experts, "rebalance_after_tokens": 0},
    )  # fmt: skip
    backend = model.expert_backend
    block = [m for m in model.modules() if hasattr(m, "w13") and hasattr(m, "layer_idx")][-1]
    gen = torch.Generator().manual_seed(4)
    x = torch.zeros(3, config.hidden_size, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        x.copy_(torch.randn(x.shape, generator=gen))
        calls = backend.stats().layer_calls
        fused = block(x)
        torch.cuda.synchronize()  # stream jobs are counted when the pool has run them
        assert backend.stats().layer_calls == calls + 1
        monkeypatch.setattr(cpu_pool_cuda, "FUSED_MOE_STAGE", False)
        plain = block(x)
        torch.testing.assert_close(fused, plain, rtol=1e-2, atol=1e-3)
        monkeypatch.setattr(cpu_pool_cuda, "FUSED_MOE_STAGE", True)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            block(x)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static = block(x)
        for _ in range(3):
            x.copy_(torch.randn(x.shape, generator=gen))
            graph.replay()
            got = static.clone()
            monkeypatch.setattr(cpu_pool_cuda, "FUSED_MOE_STAGE", False)
            torch.testing.assert_close(got, block(x), rtol=1e-2, atol=1e-3)
            monkeypatch.setattr(cpu_pool_cuda, "FUSED_MOE_STAGE", True)
    torch.cuda.synchronize()
    assert backend.stats().stream_errors == 0
    del graph
    backend.close()

"""The fused q/k norm + rotary + KV write (ext/cuda/qk_norm_rope.cu, torch.ops.tandem.qk_norm_rope)
against the torch expression it replaces; the model-level swap for Qwen3-style attention.

GPU tests carry the `gpu` marker and skip without CUDA/CuPy; q and the caches are poisoned, so
an unwritten element (or a write to a skipped slot) fails.
"""

from __future__ import annotations

import pytest
import torch

import tandem.ext.cuda as cuda_ext
from tandem.ext.cuda import qk_norm_rope as qnr

_requires_cuda = pytest.mark.skipif(not cuda_ext.is_available(), reason="needs CUDA and CuPy")


def gpu_test(fn):
    return pytest.mark.gpu(_requires_cuda(fn))


def _case(T, H, KVH, D, dtype, device, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    qkv = (torch.randn(T, (H + 2 * KVH) * D, device=device, generator=g) * 2).to(dtype)
    q_w = (1 + 0.3 * torch.randn(D, device=device, generator=g)).to(dtype)
    k_w = (1 + 0.3 * torch.randn(D, device=device, generator=g)).to(dtype)
    ang = torch.rand(T, 1, D // 2, device=device, generator=g) * 6.3
    ang = torch.cat([ang, ang], dim=-1)
    cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
    NB, BS = 8, 16
    kc = torch.full((NB, BS, KVH, D), float("nan"), device=device).to(dtype)
    vc = torch.full((NB, BS, KVH, D), float("nan"), device=device).to(dtype)
    slots = torch.randperm(NB * BS, device="cpu", generator=torch.Generator().manual_seed(seed))
    slots = slots[:T].to(device)
    if T > 1:
        slots[1] = -1  # a padding row: nothing written
    return qkv, q_w, k_w, cos, sin, kc, vc, slots


def test_reference_runs_on_cpu_and_the_op_falls_back():
    args = _case(3, 4, 2, 64, torch.float32, "cpu")
    qkv, q_w, k_w, cos, sin, kc, vc, slots = args
    q = torch.ops.tandem.qk_norm_rope(qkv, q_w, k_w, cos, sin, kc, vc, slots, 4, 2, 1e-6)
    assert q.shape == (3, 4, 64)
    written = kc.view(-1, 2, 64)[slots[slots >= 0]]
    assert not written.isnan().any()
    assert int((~kc.isnan()).any(-1).any(-1).sum()) == int((slots >= 0).sum())


@gpu_test
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "T,H,KVH,D", [(1, 32, 4, 128), (5, 8, 8, 64), (37, 16, 2, 256), (128, 4, 1, 128)]
)
def test_kernel_matches_torch_expression(dtype, T, H, KVH, D):
    args = _case(T, H, KVH, D, dtype, "cuda", seed=T + D)
    qkv, q_w, k_w, cos, sin, kc, vc, slots = args
    kc2, vc2 = kc.clone(), vc.clone()
    assert qnr.supported(qkv, q_w, k_w, cos, sin, kc, vc, H, KVH)
    q = torch.ops.tandem.qk_norm_rope(qkv, q_w, k_w, cos, sin, kc, vc, slots, H, KVH, 1e-6)
    q_ref = qnr.qk_norm_rope_ref(qkv, q_w, k_w, cos, sin, kc2, vc2, slots, H, KVH, 1e-6)
    # the same rounding steps; the fp32 sum order and rsqrt may move a value by an ulp or two
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=4e-3, atol=4e-3)
    torch.testing.assert_close(q, q_ref, **tol)
    assert (q != q_ref).float().mean().item() < 0.05
    torch.testing.assert_close(kc, kc2, equal_nan=True, **tol)
    assert torch.equal(vc.isnan(), vc2.isnan()) and torch.equal(vc.nan_to_num(), vc2.nan_to_num())


@gpu_test
def test_kernel_in_a_cuda_graph():
    qkv, q_w, k_w, cos, sin, kc, vc, slots = _case(2, 32, 4, 128, torch.bfloat16, "cuda")
    op = torch.ops.tandem.qk_norm_rope
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        op(qkv, q_w, k_w, cos, sin, kc, vc, slots, 32, 4, 1e-6)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q = op(qkv, q_w, k_w, cos, sin, kc, vc, slots, 32, 4, 1e-6)
    for seed in range(3):
        qkv.copy_(torch.randn(qkv.shape, generator=torch.Generator().manual_seed(seed)))
        graph.replay()
        kc2, vc2 = kc.clone(), vc.clone()
        ref = qnr.qk_norm_rope_ref(qkv, q_w, k_w, cos, sin, kc2, vc2, slots, 32, 4, 1e-6)
        torch.testing.assert_close(q, ref, rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(kc, kc2, rtol=2e-2, atol=2e-2, equal_nan=True)


def test_rope_kv_reference_on_cpu_is_rotary_plus_kv_write():
    qkv, _, _, cos, sin, kc, vc, slots = _case(3, 4, 2, 64, torch.float32, "cpu")
    q = torch.ops.tandem.rope_kv(qkv, cos, sin, kc, vc, slots, 4, 2, 64)
    from tandem.ext.attention_ref import rotate_neox

    expected = rotate_neox(qkv[:, : 4 * 64].reshape(3, 4, 64), cos, sin)
    torch.testing.assert_close(q, expected)
    keep = slots >= 0
    v = qkv[:, 6 * 64 :].reshape(3, 2, 64)
    torch.testing.assert_close(vc.view(-1, 2, 64)[slots[keep]], v[keep])


@gpu_test
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("T,H,KVH,D", [(1, 32, 8, 128), (5, 8, 8, 64), (37, 16, 2, 256)])
def test_rope_kv_kernel_matches_torch_expression(dtype, T, H, KVH, D):
    qkv, _, _, cos, sin, kc, vc, slots = _case(T, H, KVH, D, dtype, "cuda", seed=T + D)
    kc2, vc2 = kc.clone(), vc.clone()
    assert qnr.rope_supported(qkv, D, cos, sin, kc, vc, H, KVH)
    q = torch.ops.tandem.rope_kv(qkv, cos, sin, kc, vc, slots, H, KVH, D)
    q_ref = qnr.rope_kv_ref(qkv, cos, sin, kc2, vc2, slots, H, KVH, D)
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=4e-3, atol=4e-3)
    torch.testing.assert_close(q, q_ref, **tol)
    assert (q != q_ref).float().mean().item() < 0.01  # the same rounding steps
    torch.testing.assert_close(kc, kc2, equal_nan=True, **tol)
    assert torch.equal(vc.isnan(), vc2.isnan()) and torch.equal(vc.nan_to_num(), vc2.nan_to_num())

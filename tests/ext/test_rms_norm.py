"""The fused RMSNorm kernel (ext/cuda/rms_norm.cu, `torch.ops.tandem.rms_norm`) against the
torch expression (HF's LlamaRMSNorm) and a float32 reference; its fall-backs, its launcher's
checks and the model-level RMSNorm that uses it on CUDA.

GPU tests carry the `gpu` marker and skip without CUDA/CuPy; outputs are poisoned with NaN
before each launch, so an unwritten element fails.
"""

from __future__ import annotations

import pytest
import torch

import tandem.ext.cuda as cuda_ext
from tandem.ext.cuda import norm
from tandem.models.layers import norm as model_norm
from tandem.models.layers.norm import RMSNorm

_requires_cuda = pytest.mark.skipif(not cuda_ext.is_available(), reason="needs CUDA and CuPy")


def gpu_test(fn):
    return pytest.mark.gpu(_requires_cuda(fn))


def _f32_ref(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.double()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.double()).float()


# ------------------------------------------------------------------------------- CPU


def test_cpu_op_and_module_equal_the_torch_expression():
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(5, 3, 64, generator=g).to(dtype)
        w = (1 + 0.1 * torch.randn(64, generator=g)).to(dtype)
        ref = norm.rms_norm_ref(x, w, 1e-6)
        assert torch.equal(torch.ops.tandem.rms_norm(x, w, 1e-6), ref)
        m = RMSNorm(64, 1e-6).to(dtype)
        m.weight.data.copy_(w)
        assert torch.equal(m(x), ref)
    assert not norm.supported(torch.zeros(2, 8), torch.zeros(8))  # CPU: the torch expression


def test_op_gradients_match_the_torch_expression():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 16, generator=g, requires_grad=True)
    w = torch.randn(16, generator=g, requires_grad=True)
    torch.ops.tandem.rms_norm(x, w, 1e-5).pow(2).sum().backward()
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    norm.rms_norm_ref(x, w, 1e-5).pow(2).sum().backward()
    torch.testing.assert_close(gx, x.grad)
    torch.testing.assert_close(gw, w.grad)


def test_launcher_rejects_bad_operands():
    bf = dict(dtype=torch.bfloat16)
    x, w = torch.zeros(2, 16, **bf), torch.zeros(16, **bf)
    with pytest.raises(ValueError, match="shapes"):
        norm.launch_rms_norm(x, torch.zeros(8, **bf), torch.zeros(2, 16, **bf), 1e-6)
    with pytest.raises(ValueError, match="dtypes"):
        norm.launch_rms_norm(x, w, torch.zeros(2, 16), 1e-6)
    with pytest.raises(ValueError, match="multiple of 8"):
        norm.launch_rms_norm(torch.zeros(2, 12, **bf), torch.zeros(12, **bf),
                             torch.zeros(2, 12, **bf), 1e-6)  # fmt: skip


def test_cpu_add_norm_equals_add_then_norm():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 64, generator=g).bfloat16()
    d = torch.randn(4, 64, generator=g).bfloat16()
    m = RMSNorm(64, 1e-6).bfloat16()
    m.weight.data.copy_(1 + 0.1 * torch.randn(64, generator=g))
    s, y = m.add_norm(x, d)
    assert torch.equal(s, x + d) and torch.equal(y, m(x + d))
    s, y = torch.ops.tandem.add_rms_norm(x, d, m.weight, 1e-6)
    assert torch.equal(s, x + d) and torch.equal(y, m(x + d))
    same, y = m.add_norm(x, None)
    assert same is x and torch.equal(y, m(x))


def test_add_launcher_rejects_bad_operands():
    bf = dict(dtype=torch.bfloat16)
    x, w = torch.zeros(2, 16, **bf), torch.zeros(16, **bf)
    with pytest.raises(ValueError, match="must match"):
        norm.launch_add_rms_norm(x, torch.zeros(2, 8, **bf), w, torch.zeros_like(x),
                                 torch.zeros_like(x), 1e-6)  # fmt: skip
    with pytest.raises(ValueError, match="must match"):
        norm.launch_add_rms_norm(x, x, w, torch.zeros(2, 16), torch.zeros_like(x), 1e-6)
    with pytest.raises(ValueError, match="shapes"):
        norm.launch_add_rms_norm(x, x, torch.zeros(8, **bf), torch.zeros_like(x),
                                 torch.zeros_like(x), 1e-6)  # fmt: skip


# ------------------------------------------------------------------------------- GPU


@gpu_test
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "rows,cols",
    [(1, 2048), (3, 4096), (7, 128), (256, 128), (8192, 64), (1, 8), (33, 1024), (5, 1032),
     (2, 8192), (300, 2048), (4097, 128)],
)  # fmt: skip
def test_kernel_matches_torch_expression_and_f32(dtype, rows, cols):
    g = torch.Generator(device="cuda").manual_seed(rows * 7919 + cols)
    x = (torch.randn(rows, cols, device="cuda", generator=g) * 3).to(dtype)
    w = (1 + 0.2 * torch.randn(cols, device="cuda", generator=g)).to(dtype)
    out = torch.full_like(x, float("nan"))
    norm.launch_rms_norm(x, w, out, 1e-6)
    assert not out.isnan().any()
    ref = norm.rms_norm_ref(x, w, 1e-6)
    # the same rounding steps; only the fp32 sum order and rsqrt differ: at most a unit in the
    # last place of a few elements
    diff = (out.float() - ref.float()).abs()
    ulp = ref.float().abs().clamp_min(1e-3) * (2**-7 if dtype == torch.bfloat16 else 2**-10)
    assert bool((diff <= 2 * ulp).all()), diff.max()
    assert (diff > 0).float().mean().item() < 0.02
    f32 = _f32_ref(x, w, 1e-6)
    rel = ((out.float() - f32).norm() / f32.norm()).item()
    assert rel < 1e-2, rel


@gpu_test
def test_op_on_views_fallbacks_and_module():
    """Non-contiguous rows (a q/k view), a fall-back shape (D % 8 != 0, fp32) and the model's
    RMSNorm on CUDA (which calls the op) all equal the torch expression."""
    g = torch.Generator(device="cuda").manual_seed(5)
    qkv = torch.randn(6, 3 * 4 * 128, device="cuda", generator=g).bfloat16()
    q = qkv[:, : 4 * 128].view(6, 4, 128)  # rows 3 * 512 apart
    w = torch.randn(128, device="cuda", generator=g).bfloat16()
    got = torch.ops.tandem.rms_norm(q, w, 1e-6)
    assert got.shape == q.shape
    torch.testing.assert_close(got, norm.rms_norm_ref(q, w, 1e-6), rtol=1e-2, atol=1e-2)
    for x, w2 in [
        (torch.randn(3, 12, device="cuda").bfloat16(), torch.randn(12, device="cuda").bfloat16()),
        (torch.randn(3, 64, device="cuda"), torch.randn(64, device="cuda")),
    ]:
        assert not norm.supported(x, w2)
        assert torch.equal(torch.ops.tandem.rms_norm(x, w2, 1e-6), norm.rms_norm_ref(x, w2, 1e-6))
    m = RMSNorm(2048).cuda().bfloat16()
    x = torch.randn(2, 2048, device="cuda").bfloat16()
    assert model_norm.FUSED_CUDA_NORM
    torch.testing.assert_close(m(x), norm.rms_norm_ref(x, m.weight, m.eps), rtol=1e-2, atol=1e-2)


@gpu_test
def test_kernel_in_a_cuda_graph():
    x = torch.randn(4, 2048, device="cuda").bfloat16()
    w = torch.randn(2048, device="cuda").bfloat16()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        torch.ops.tandem.rms_norm(x, w, 1e-6)  # compile + warm-up outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = torch.ops.tandem.rms_norm(x, w, 1e-6)
    for _ in range(3):
        x.copy_(torch.randn(4, 2048, device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(y, norm.rms_norm_ref(x, w, 1e-6), rtol=1e-2, atol=1e-2)


@gpu_test
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,cols", [(1, 4096), (3, 2048), (7, 128), (300, 1024), (5, 1032)])
def test_add_kernel_matches_add_then_norm(dtype, rows, cols):
    """The sum is bit-equal to torch's `x + d`; the norm is the plain kernel's on that sum."""
    g = torch.Generator(device="cuda").manual_seed(rows * 31 + cols)
    x = (torch.randn(rows, cols, device="cuda", generator=g) * 3).to(dtype)
    d = (torch.randn(rows, cols, device="cuda", generator=g) * 2).to(dtype)
    w = (1 + 0.2 * torch.randn(cols, device="cuda", generator=g)).to(dtype)
    s, out = torch.full_like(x, float("nan")), torch.full_like(x, float("nan"))
    norm.launch_add_rms_norm(x, d, w, s, out, 1e-6)
    assert torch.equal(s, x + d)
    plain = torch.full_like(x, float("nan"))
    norm.launch_rms_norm(x + d, w, plain, 1e-6)
    diff = (out.float() - plain.float()).abs()  # same steps: equal up to fp32 contraction
    ulp = plain.float().abs().clamp_min(1e-3) * (2**-7 if dtype == torch.bfloat16 else 2**-10)
    assert bool((diff <= ulp).all()) and (diff > 0).float().mean().item() < 0.01
    f32 = _f32_ref(x + d, w, 1e-6)
    assert ((out.float() - f32).norm() / f32.norm()).item() < 1e-2


@gpu_test
def test_add_op_on_views_and_in_a_cuda_graph():
    g = torch.Generator(device="cuda").manual_seed(9)
    big = torch.randn(4, 3 * 2048, device="cuda", generator=g).bfloat16()
    x, d = big[:, :2048], big[:, 2048:4096]  # strided rows
    w = torch.randn(2048, device="cuda", generator=g).bfloat16()
    s, y = torch.ops.tandem.add_rms_norm(x, d, w, 1e-6)
    assert torch.equal(s, x + d)
    torch.testing.assert_close(y, norm.rms_norm_ref(x + d, w, 1e-6), rtol=1e-2, atol=1e-2)
    xs, ds = x.contiguous(), d.contiguous()
    st = torch.cuda.Stream()
    st.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(st):
        torch.ops.tandem.add_rms_norm(xs, ds, w, 1e-6)
    torch.cuda.current_stream().wait_stream(st)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        s, y = torch.ops.tandem.add_rms_norm(xs, ds, w, 1e-6)
    for _ in range(2):
        xs.copy_(torch.randn(4, 2048, device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(s, xs + ds)
        torch.testing.assert_close(y, norm.rms_norm_ref(xs + ds, w, 1e-6), rtol=1e-2, atol=1e-2)

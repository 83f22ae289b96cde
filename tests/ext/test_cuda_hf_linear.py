"""ext/cuda/hf_linear (GPTQ/AWQ int4, FP8 e4m3) against dequantize-then-matmul and inside a CUDA
graph (GPU tests); whole models: tests/models/test_quant_hf_cuda.py."""

from __future__ import annotations

import pytest
import torch

import tandem.ext.cuda as cuda_ext
from tandem.ext.cuda import hf_linear  # noqa: F401  (registers torch.ops.tandem.*_linear)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not cuda_ext.is_available(), reason="needs CUDA and CuPy"),
]
ROWS = [1, 2, 7, 16, 64, 300]


def _int4(n, k, group, sdt, seed):
    from tests.models.hf_quant_cases import random_int4

    w = random_int4(n, k, group, seed)
    w.scales = w.scales.to(sdt)
    return w.to("cuda")


def _fp8(n, k, scheme, seed):
    from tests.models.hf_quant_cases import random_fp8

    return random_fp8(n, k, scheme, seed).to("cuda")


def _close(got: torch.Tensor, x: torch.Tensor, w) -> None:
    expected = x.double() @ w.dequantize().double().T
    assert got.dtype == x.dtype and got.shape == expected.shape
    torch.testing.assert_close(got.double(), expected, rtol=1e-2, atol=2e-2)


@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize(("k", "group", "sdt"), [(96, 32, torch.float16), (384, 128, torch.float16),
                                                 (160, 160, torch.bfloat16)])  # fmt: skip
def test_int4_matches_dequantize_then_matmul(dt, rows, k, group, sdt) -> None:
    w = _int4(37 + rows % 5, k, group, sdt, rows)
    x = torch.randn(rows, k, device="cuda", generator=None).to(dt)
    _close(torch.ops.tandem.int4_linear(x, w.codes, w.scales, w.zeros, group), x, w)


@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("scheme", ["tensor", "channel", "block"])
def test_fp8_matches_dequantize_then_matmul(dt, rows, scheme) -> None:
    w = _fp8(45 + rows % 3, 160, scheme, rows)
    x = torch.randn(rows, 160, device="cuda").to(dt)
    _close(torch.ops.tandem.fp8_linear(x, w.data, w.scale, *w.block), x, w)


def test_fp8_scaled_mm_close_to_reference() -> None:
    """The tensor-core path rounds activations to e4m3 too: within 8% of the output range."""
    from tandem.ext.cuda.hf_linear import fp8_scaled_mm

    w = _fp8(256, 512, "channel", 0)
    x = torch.randn(300, 512, device="cuda", dtype=torch.bfloat16)
    got = fp8_scaled_mm(x, w.data, w.scale.reshape(-1))
    expected = x.double() @ w.dequantize().double().T
    assert (got.double() - expected).abs().max() <= 0.08 * expected.abs().max()


def test_decode_ops_capture_in_a_cuda_graph() -> None:
    wi = _int4(64, 256, 64, torch.float16, 0)
    wf = _fp8(64, 256, "block", 0)
    x = torch.randn(2, 256, device="cuda", dtype=torch.bfloat16)
    ops = (lambda: torch.ops.tandem.int4_linear(x, wi.codes, wi.scales, wi.zeros, 64),
           lambda: torch.ops.tandem.fp8_linear(x, wf.data, wf.scale, *wf.block))  # fmt: skip
    for op in ops:
        op()  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = op()
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(y, op(), rtol=0, atol=0)


MMA_ROWS = [1, 2, 8, 9, 16, 17, 32, 33, 64]


@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", MMA_ROWS)
@pytest.mark.parametrize(("n", "k", "group", "sdt"), [(48, 384, 128, torch.float16),
                                                      (100, 512, 512, torch.bfloat16)])  # fmt: skip
def test_int4_mma_rows_match_dequantize_then_matmul(dt, rows, n, k, group, sdt) -> None:
    """From 2 rows the tensor-core kernel serves (any N, x rows in passes of 32), within the
    GEMV's tolerance of the reference."""
    w = _int4(n, k, group, sdt, rows)
    assert hf_linear.mma_supported(hf_linear.INT4, (group, 0, 0), k)
    x = torch.randn(rows, k, device="cuda").to(dt)
    _close(torch.ops.tandem.int4_linear(x, w.codes, w.scales, w.zeros, group), x, w)


@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", MMA_ROWS)
@pytest.mark.parametrize("scheme", ["tensor", "channel", "block"])
def test_fp8_mma_rows_match_dequantize_then_matmul(dt, rows, scheme) -> None:
    """e4m3 subnormals and zeros included (row 0 of the random weight); 128x128 blocks."""
    from tandem.models.quant.fp8 import Fp8Tensor
    from tests.models.hf_quant_cases import fp8_quant

    n, k = 40 + rows % 3, 384
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(rows)) * 0.1
    w[0, :7] = torch.tensor([0.0, 1e-6, -1e-6, 3e-4, -2e-5, 0.5, -0.5])
    if scheme == "block":
        q, s, _, _ = fp8_quant(w, scheme, block=128)
        wt = Fp8Tensor(q, s, (128, 128)).to("cuda")
    else:
        wt = _fp8(n, k, scheme, rows)
    x = torch.randn(rows, k, device="cuda").to(dt)
    _close(torch.ops.tandem.fp8_linear(x, wt.data, wt.scale, *wt.block), x, wt)


def test_mma_matches_gemv_at_the_same_rows() -> None:
    """The two decode kernels on one 8B-like shape at 8 rows (the GEMV's last row count)."""
    w = _int4(1024, 4096, 128, torch.float16, 3)
    x = torch.randn(8, 4096, device="cuda", dtype=torch.bfloat16)
    bufs = (hf_linear.ptr(w.codes), hf_linear.ptr(w.scales), hf_linear.ptr(w.zeros))
    a = hf_linear._gemv(hf_linear.INT4, 0, x, bufs, (128, 0, 0), 1024).double()
    b = hf_linear._mma(hf_linear.INT4, 0, x, bufs, (128, 0, 0), 1024).double()
    ref = x.double() @ w.dequantize().double().T
    assert ((a - ref).norm() / ref.norm()).item() < 5e-3
    assert ((b - ref).norm() / ref.norm()).item() < 5e-3
    assert ((a - b).norm() / ref.norm()).item() < 5e-3

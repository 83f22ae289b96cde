"""ext/cuda/hf_linear (GPTQ/AWQ int4, FP8 e4m3) against dequantize-then-matmul, inside a CUDA
graph, and through whole tiny models against the same checkpoint dequantized (GPU tests)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import tandem.ext.cuda as cuda_ext

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


CASES = [("gptq", dict(group=32, sym=False, act_order=True), False),
         ("awq", dict(group=32), True), ("gptq", dict(group=32, sym=True), True),
         ("fp8", dict(scheme="block"), False), ("fp8", dict(scheme="channel"), True)]  # fmt: skip


@pytest.mark.parametrize(("method", "opts", "moe"), CASES)
def test_packed_model_on_cuda_close_to_dequantized(
    tmp_path: Path, method: str, opts: dict, moe: bool, paged_runner
) -> None:
    from tandem.models.loader import load_model
    from tandem.models.quant.linear import QuantLinear, quantized_bytes
    from tests.models.hf_quant_cases import write_quantized
    from tests.models.test_cuda_parity import CudaPagedRunner
    from tests.models.test_quant_hf import _checkpoint_quant_bytes

    write_quantized(tmp_path, method, moe=moe, **opts)
    fast, cfg = load_model(tmp_path, dtype=torch.bfloat16, device="cuda")
    mods = [m for m in fast.modules() if isinstance(m, QuantLinear)]
    assert mods and all(m.kernel is not None and m.segments[0].data.is_cuda for m in mods)
    if not moe:
        assert quantized_bytes(fast) <= 1.05 * _checkpoint_quant_bytes(tmp_path)
    ref, _ = load_model(tmp_path, dtype=torch.bfloat16, device="cuda", quantization="none")
    gen = torch.Generator().manual_seed(2)
    for rows in ROWS:
        ids = [int(i) for i in torch.randint(0, 128, (rows,), generator=gen)]
        a = CudaPagedRunner(paged_runner, fast, cfg, block_size=16, seed=1).step([(0, ids)])[0]
        b = CudaPagedRunner(paged_runner, ref, cfg, block_size=16, seed=1).step([(0, ids)])[0]
        row_ok = (a - b).abs().amax(-1) <= 0.03 * b.abs().max()
        allowed = max(1, rows // 10) if moe else 0
        assert int((~row_ok).sum()) <= allowed, rows

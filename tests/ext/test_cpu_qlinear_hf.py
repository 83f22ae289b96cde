"""ext/cpu/qlinear on the HF formats' layouts (GPTQ/AWQ int4 with group scales and zero
points, FP8 e4m3 with block scales) against dequantize-then-matmul, on odd shapes."""

from __future__ import annotations

import pytest
import torch

from tandem.ext.cpu import supported_isas
from tandem.ext.cpu.qlinear import CpuQuantLinearPool
from tests.models.hf_quant_cases import random_fp8, random_int4

pytestmark = pytest.mark.skipif(
    "avx512" not in supported_isas(), reason="the HF-format CPU kernels need AVX-512 BF16"
)


def _check(pool: CpuQuantLinearPool, got_fn, w, x: torch.Tensor) -> None:
    expected = x.bfloat16().double() @ w.dequantize().double().T
    got = got_fn(x)
    assert got.dtype == torch.float32 and got.shape == expected.shape
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-4)
    got_bf16 = got_fn(x.bfloat16())
    assert got_bf16.dtype == torch.bfloat16
    torch.testing.assert_close(got_bf16.double(), expected, rtol=1e-2, atol=2e-2)


@pytest.mark.parametrize("rows", [1, 2, 7, 16, 64, 300])
@pytest.mark.parametrize(("k", "group"), [(96, 32), (192, 64), (160, 160), (384, 128)])
def test_int4_matches_dequantize_then_matmul(rows: int, k: int, group: int) -> None:
    n = 37 + rows % 5
    w = random_int4(n, k, group, rows)
    pool = CpuQuantLinearPool(num_threads=2)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    _check(pool, lambda x: pool.linear_int4(x, w.codes, w.scales, w.zeros, group), w, x)


@pytest.mark.parametrize("rows", [1, 2, 7, 16, 64, 300])
@pytest.mark.parametrize("scheme", ["tensor", "channel", "block"])
def test_fp8_matches_dequantize_then_matmul(rows: int, scheme: str) -> None:
    n, k = 45 + rows % 3, 160  # partial row and column blocks of 32
    w = random_fp8(n, k, scheme, rows)
    pool = CpuQuantLinearPool(num_threads=2)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    _check(pool, lambda x: pool.linear_fp8(x, w.data, w.scale, w.block), w, x)


def test_every_e4m3_code_decodes_exactly() -> None:
    """All 256 codes (NaN aside) as one row, against torch's own e4m3 -> float."""
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]
    k = 32 * ((codes.numel() + 31) // 32)
    data = torch.zeros(k, dtype=torch.uint8)
    data[: codes.numel()] = codes
    data = data.view(torch.float8_e4m3fn).reshape(1, k).repeat(k, 1)
    pool = CpuQuantLinearPool(num_threads=1)
    eye = torch.eye(k)
    got = pool.linear_fp8(eye, data, torch.ones(1, 1), (k, k))  # got[i, j] = W[j, i]
    torch.testing.assert_close(got[:, 0], data[0].float(), rtol=0, atol=0)


def test_bad_arguments_are_refused() -> None:
    pool = CpuQuantLinearPool(num_threads=1)
    w = random_int4(8, 64, 32, 0)
    with pytest.raises(ValueError, match="group"):
        pool.linear_int4(torch.randn(1, 64), w.codes, w.scales, w.zeros, 48)
    with pytest.raises(ValueError, match="scales"):
        pool.linear_int4(torch.randn(1, 64), w.codes, w.scales.float(), w.zeros, 32)
    with pytest.raises(ValueError, match="x must be"):
        pool.linear_int4(torch.randn(1, 96), w.codes, w.scales, w.zeros, 32)


def test_bf16_scales_reach_the_kernel_when_fp16_holds_them() -> None:
    from torch import nn

    from tandem.models.quant.cpu import use_cpu_quant_kernels
    from tandem.models.quant.linear import QuantLinear

    w = random_int4(40, 96, 32, 0)
    w.scales = w.scales.to(torch.bfloat16)
    lin = QuantLinear(96, [40], ["w"], False, "cpu", ["int4"])
    lin.set_part(0, w)
    lin.finalize()
    model = nn.Sequential(lin)
    assert use_cpu_quant_kernels(model) == 1
    assert lin.segments[0].scales.dtype == torch.float16
    x = torch.randn(3, 96)
    expected = x.bfloat16().double() @ w.dequantize().double().T
    torch.testing.assert_close(lin(x).double(), expected, rtol=1e-5, atol=1e-4)

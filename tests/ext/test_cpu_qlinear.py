"""ext/cpu/qlinear: GGUF-packed weights against dequantize-then-matmul, per ISA and shape."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tandem.ext.cpu import supported_isas
from tandem.ext.cpu.qlinear import CpuQuantLinearPool
from tandem.models.quant.tensor import QuantizedTensor
from tests.models.quant_cases import pack

TYPES = ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]
ISAS = [i for i in ("scalar", "avx512") if i in supported_isas()]


def _weight(qtype: str, n: int, k: int, seed: int) -> QuantizedTensor:
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * 0.1
    return QuantizedTensor(qtype, torch.from_numpy(np.ascontiguousarray(pack(w, qtype))), k)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("rows", [1, 2, 7, 16, 64, 300])
def test_matches_dequantize_then_matmul(isa: str, qtype: str, rows: int) -> None:
    k = 512 if qtype.endswith("_K") else 96  # odd block counts for the 32-blocks
    n = 37 + rows % 5
    w = _weight(qtype, n, k, rows)
    pool = CpuQuantLinearPool(num_threads=2, isa=isa)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    # the vector kernel multiplies bf16 activations exactly; the portable one fp32 activations
    xr = x.bfloat16().float() if pool.isa == "avx512" else x
    expected = xr.double() @ w.dequantize().double().T
    got = pool.linear(x, w.data, qtype)
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-4)
    got_bf16 = pool.linear(x.bfloat16(), w.data, qtype)
    assert got_bf16.dtype == torch.bfloat16
    torch.testing.assert_close(got_bf16.double(), expected, rtol=1e-2, atol=2e-2)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qtype", ["Q4_1", "Q4_K", "Q6_K"])
def test_rows_do_not_depend_on_the_batch(isa: str, qtype: str) -> None:
    w = _weight(qtype, 50, 768 if qtype.endswith("_K") else 608, 3)
    pool = CpuQuantLinearPool(num_threads=2, isa=isa)
    x = torch.randn(300, w.cols).bfloat16()
    whole = pool.linear(x, w.data, qtype)
    for m in (1, 2, 3, 7, 16, 64):
        assert torch.equal(pool.linear(x[:m].contiguous(), w.data, qtype), whole[:m])
    assert torch.equal(pool.linear(x[5:6].contiguous(), w.data, qtype), whole[5:6])


def test_bad_arguments_are_refused() -> None:
    pool = CpuQuantLinearPool(num_threads=1)
    w = _weight("Q4_0", 8, 64, 0)
    with pytest.raises(ValueError, match="qtype"):
        pool.linear(torch.randn(1, 64), w.data, "Q2_K")
    with pytest.raises(ValueError, match="multiple of 32"):
        pool.linear(torch.randn(1, 60), w.data, "Q4_0")
    with pytest.raises(ValueError, match="data must be"):
        pool.linear(torch.randn(1, 96), w.data, "Q4_0")
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        pool.linear(torch.randn(1, 64).half(), w.data, "Q4_0")
    with pytest.raises(ValueError, match="num_threads"):
        CpuQuantLinearPool(num_threads=0)

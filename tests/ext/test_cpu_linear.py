"""CPU dense linear (ext/cpu/linear.*): parity with torch F.linear per weight format and per ISA
path this machine supports (TANDEM_CPU_ISA / isa= forces a lower one), odd shapes, validation."""

from __future__ import annotations

import zlib

import pytest
import torch
import torch.nn.functional as F

from tandem.ext.cpu import quantize, supported_isas
from tandem.ext.cpu.linear import CpuLinearPool, pack_weight

ISAS = supported_isas()
FORMATS = ("bf16", "int8", "int4")
SHAPES = [
    (1, 1, 1),
    (1, 577, 131),
    (2, 33, 64),
    (3, 960, 576),
    (4, 7, 1535),
    (17, 65, 200),
    (64, 129, 97),
]  # (M, N, K)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_parity_with_torch(isa: str, fmt: str) -> None:
    pool = CpuLinearPool(num_threads=2, isa=isa)
    assert pool.isa == isa  # "amx": these formats on its AVX-512 kernel
    g = torch.Generator().manual_seed(zlib.crc32(f"{isa}-{fmt}".encode()))  # same every run
    for M, N, K in SHAPES:
        w = torch.randn(N, K, generator=g).to(torch.bfloat16)
        x = torch.randn(M, K, generator=g)
        bias = torch.randn(N, generator=g)
        pw = pack_weight(w, fmt)
        # The kernels use exactly the expert pool's quantized values.
        ref_w = quantize(w.float(), fmt) if fmt != "bf16" else w.float()
        torch.testing.assert_close(pw.dequantize(), ref_w, rtol=1e-6, atol=1e-6)
        y = pool.linear(x, pw, bias)
        assert y.shape == (M, N) and y.dtype == torch.float32
        exact = F.linear(x, ref_w, bias)
        # avx512 rounds activations to bf16 (as torch's bf16 GEMM does); others keep fp32.
        # Compared without the bias, which can cancel the product and inflate a relative error.
        tol = 1e-2 if isa in ("avx512", "amx") else 1e-5
        assert _rel(y - bias, exact - bias) < tol, (M, N, K)
        if isa in ("avx512", "amx"):
            xb = x.to(torch.bfloat16).float()
            assert _rel(y, F.linear(xb, ref_w, bias)) < 1e-5, (M, N, K)


@pytest.mark.parametrize("isa", ISAS)
def test_bf16_in_bf16_out_and_every_m(isa: str) -> None:
    pool = CpuLinearPool(num_threads=2, isa=isa)
    g = torch.Generator().manual_seed(1)
    w = torch.randn(96, 70, generator=g).to(torch.bfloat16)
    pw = pack_weight(w)
    assert pw.data.data_ptr() == w.data_ptr()  # read in place, no copy
    for M in range(1, 65):
        x = torch.randn(M, 70, generator=g).to(torch.bfloat16)
        y = pool.linear(x, pw)
        assert y.dtype == torch.bfloat16
        assert _rel(y, F.linear(x.float(), w.float())) < 1.5e-2, M


def test_isa_env_forces_lower_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_CPU_ISA", "scalar")
    assert CpuLinearPool().isa == "scalar"


def test_invalid_inputs_raise() -> None:
    pool = CpuLinearPool(num_threads=1)
    w = torch.randn(8, 16).to(torch.bfloat16)
    pw = pack_weight(w)
    with pytest.raises(ValueError):
        pack_weight(w.float(), "bf16")  # bf16 reads in place: needs a bf16 tensor
    with pytest.raises(ValueError):
        pack_weight(w, "int3")
    with pytest.raises(ValueError):
        pack_weight(w, "int4", group_size=48)
    with pytest.raises(ValueError):
        pool.linear(torch.randn(2, 15), pw)  # wrong K
    with pytest.raises(ValueError):
        pool.linear(torch.randn(0, 16), pw)
    with pytest.raises(ValueError):
        pool.linear(torch.randn(2, 16, dtype=torch.float64), pw)
    with pytest.raises(ValueError):
        pool.linear(torch.randn(2, 16), pw, bias=torch.randn(7))
    with pytest.raises(ValueError):
        pool.linear(torch.randn(2, 16), pw, out=torch.empty(2, 9))
    with pytest.raises(ValueError):
        CpuLinearPool(num_threads=0)
    with pytest.raises(ValueError):
        CpuLinearPool(isa="sse9")


VNNI_ISAS = [i for i in ISAS if i in ("avx512", "amx")]


@pytest.mark.parametrize("isa", VNNI_ISAS)
def test_bf16_vnni_rows_do_not_depend_on_the_batch(isa: str) -> None:
    """Every row of a bf16_vnni call is bitwise the same as that row computed alone or in any
    other batch (what makes greedy output batch-invariant), and close to torch's product. On
    "amx" every M runs on tiles: a lone row is a one-row tile, 17 rows a full and a one-row
    tile, and a row's place in its tile changes with the start."""
    pool = CpuLinearPool(num_threads=2, isa=isa)
    assert pool.isa == isa
    g = torch.Generator().manual_seed(11)
    for N, K in [(1, 1), (33, 65), (577, 131), (960, 576)]:
        w = torch.randn(N, K, generator=g).to(torch.bfloat16)
        bias = torch.randn(N, generator=g)
        pw = pack_weight(w, "bf16_vnni")
        assert torch.equal(pw.dequantize(), w.float())
        x = torch.randn(70, K, generator=g).to(torch.bfloat16)
        full = pool.linear(x, pw, bias)
        assert full.dtype == torch.bfloat16
        exact = F.linear(x.float(), w.float(), bias)
        assert _rel(full, exact) < 1e-2, (N, K)
        # fp32 out against a float64 product of the same bf16 values: only fp32 sums differ
        y32 = pool.linear(x, pw, bias, out=torch.empty(70, N))
        ref = F.linear(x.double(), w.double(), bias.double())
        bound = F.linear(x.double().abs(), w.double().abs(), bias.double().abs())
        assert ((y32.double() - ref).abs() <= 1e-6 * bound + 1e-6).all(), (N, K)
        for M in (1, 2, 3, 4, 5, 8, 16, 17, 33, 64):
            for start in (0, 3):
                assert torch.equal(
                    pool.linear(x[start : start + M], pw, bias), full[start : start + M]
                ), (N, K, M, start)


def test_bf16_vnni_is_refused_by_other_isas() -> None:
    pw = pack_weight(torch.randn(16, 64).to(torch.bfloat16), "bf16_vnni")
    for isa in set(ISAS) - {"avx512", "amx"}:
        with pytest.raises(ValueError, match="avx512"):
            CpuLinearPool(num_threads=1, isa=isa).linear(torch.randn(1, 64), pw)

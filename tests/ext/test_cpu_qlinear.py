"""ext/cpu/qlinear: GGUF-packed weights against dequantize-then-matmul, per ISA and shape; the
int8-activation kernels (VNNI, AVX2) against the same with their quantized activations."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tandem.ext.cpu import supported_isas
from tandem.ext.cpu.qlinear import CpuQuantLinearPool
from tandem.ext.cpu.reference import quantize_activations
from tandem.models.quant.tensor import QuantizedTensor
from tests.models.quant_cases import pack

TYPES = ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]
INT8_TYPES = ("Q4_0", "Q4_1", "Q8_0")
K_TYPES = ("Q4_K", "Q5_K", "Q6_K")
ISAS = [i for i in ("scalar", "avx2", "avx512") if i in supported_isas()]
# (isa, int8 activations): the float kernels, and the int8 one where this CPU has it
POOLS = [(i, False) for i in ISAS] + [
    (i, True) for i in ISAS if CpuQuantLinearPool(1, isa=i, int8=True).int8_isa
]


def _activations(pool: CpuQuantLinearPool, qtype: str, x: torch.Tensor) -> torch.Tensor:
    """x as the kernel multiplies it: int8 per 32 values, bf16, or as given (portable)."""
    if pool.int8_serves(qtype):
        return quantize_activations(x)
    return x.bfloat16().float() if pool.isa == "avx512" else x  # avx2: the portable kernel


def _weight(qtype: str, n: int, k: int, seed: int) -> QuantizedTensor:
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * 0.1
    return QuantizedTensor(qtype, torch.from_numpy(np.ascontiguousarray(pack(w, qtype))), k)


@pytest.mark.parametrize("pool_kind", POOLS, ids=lambda p: f"{p[0]}{'-int8' if p[1] else ''}")
@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("rows", [1, 2, 7, 16, 64, 300])
def test_matches_dequantize_then_matmul(pool_kind: tuple[str, bool], qtype: str, rows: int) -> None:
    isa, int8 = pool_kind
    # odd block counts: 3 (K = 96) and 19 (608) 32-blocks, a partial group of 4 for int8;
    # 1 to 5 super-blocks of 256 for the k-quants
    k = 256 * (1 + rows % 5) if qtype.endswith("_K") else (96 if rows % 2 else 608)
    n = 37 + rows % 5
    w = _weight(qtype, n, k, rows)
    pool = CpuQuantLinearPool(num_threads=2, isa=isa, int8=int8)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    expected = _activations(pool, qtype, x).double() @ w.dequantize().double().T
    got = pool.linear(x, w.data, qtype)
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-4)
    got_bf16 = pool.linear(x.bfloat16(), w.data, qtype)
    assert got_bf16.dtype == torch.bfloat16
    exact_bf16 = (
        _activations(pool, qtype, x.bfloat16().float()).double() @ w.dequantize().double().T
    )
    torch.testing.assert_close(got_bf16.double(), exact_bf16, rtol=1e-2, atol=2e-2)


@pytest.mark.parametrize("qtype", INT8_TYPES + K_TYPES)
def test_int8_path_is_taken_and_close_to_float_activations(qtype: str) -> None:
    """Where the CPU has the int8 kernel for a type it is the default; its error against
    unquantized activations stays within the int8 rounding (absmax / 254 per value)."""
    pool = CpuQuantLinearPool(num_threads=1)
    w = _weight(qtype, 64, 1536, 5)
    x = torch.randn(3, 1536, generator=torch.Generator().manual_seed(5))
    x[0, 32:64] = 0  # an all-zero block
    x[1] = 0
    got = pool.linear(x, w.data, qtype).double()
    floats = CpuQuantLinearPool(num_threads=1, int8=False).linear(x, w.data, qtype).double()
    if not pool.int8_serves(qtype):  # no int8 kernel for it on this CPU: the float one
        assert torch.equal(got, floats)
        return
    assert torch.equal(got[1], torch.zeros(64, dtype=torch.float64))
    float_x = x.double() @ w.dequantize().double().T
    assert not torch.allclose(got, float_x, rtol=1e-5, atol=1e-5)  # activations were quantized
    bound = (x.abs().amax() / 254) * w.dequantize().double().abs().sum(-1).max()
    assert (got - float_x).abs().max() <= bound
    assert (got - float_x).abs().max() <= 0.02 * float_x.abs().max()


@pytest.mark.parametrize("pool_kind", POOLS, ids=lambda p: f"{p[0]}{'-int8' if p[1] else ''}")
@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"])
def test_rows_do_not_depend_on_the_batch(pool_kind: tuple[str, bool], qtype: str) -> None:
    w = _weight(qtype, 50, 768 if qtype.endswith("_K") else 608, 3)
    pool = CpuQuantLinearPool(num_threads=2, isa=pool_kind[0], int8=pool_kind[1])
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


def test_helper_threads_compute_every_block_once_over_many_calls() -> None:
    """Helpers join calls only when awake (ext/cpu/helpers.h) and only for weights of 1 MiB or
    more; back-to-back calls of both kinds must each see every row block computed once."""
    one = CpuQuantLinearPool(num_threads=1)
    three = CpuQuantLinearPool(num_threads=3)
    assert three.num_threads == 3
    gen = torch.Generator().manual_seed(7)
    weights = [_weight("Q4_1", n, 96, n) for n in (17, 300, 18000)]  # the last: 1.08 MB
    for i in range(60):
        w = weights[i % 3]
        x = torch.randn(1 + i % 2, 96, generator=gen)
        assert torch.equal(three.linear(x, w.data, "Q4_1"), one.linear(x, w.data, "Q4_1"))


@pytest.mark.parametrize("qtype", K_TYPES)
def test_k_quants_split_over_helpers_as_on_one_thread(qtype: str) -> None:
    """A k-quant matrix over 1 MiB is split among helper threads by rows; every row as on one."""
    w = _weight(qtype, 64, 512, 9)
    data = w.data.repeat(130, 1).contiguous()  # 8320 rows, 2.4 MB (Q4_K) to 3.5 MB (Q6_K)
    data[64:128] = _weight(qtype, 64, 512, 10).data  # not all row blocks alike
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(9))
    one, three = CpuQuantLinearPool(num_threads=1), CpuQuantLinearPool(num_threads=3)
    for m in (1, 3):
        assert torch.equal(three.linear(x[:m], data, qtype), one.linear(x[:m], data, qtype))


def test_int_path_off_keeps_float_activations(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_CPU_INT_PATH", "off")
    off = CpuQuantLinearPool(num_threads=1)
    assert off.int8_isa == ""
    assert not any(off.int8_serves(q) for q in TYPES)
    w = _weight("Q4_K", 24, 512, 4)
    x = torch.randn(2, 512, generator=torch.Generator().manual_seed(4))
    floats = CpuQuantLinearPool(num_threads=1, int8=False).linear(x, w.data, "Q4_K")
    assert torch.equal(off.linear(x, w.data, "Q4_K"), floats)
    monkeypatch.setenv("TANDEM_CPU_INT_PATH", "auto")
    has_int8 = any(i in supported_isas() for i in ("avx2", "avx512"))
    auto = CpuQuantLinearPool(num_threads=1)
    assert bool(auto.int8_isa) == has_int8
    if auto.int8_serves("Q4_K"):  # VNNI or AVX2: the k-quants' activations are quantized
        assert not torch.equal(auto.linear(x, w.data, "Q4_K"), floats)


@pytest.mark.parametrize("pool_kind", POOLS, ids=lambda p: f"{p[0]}{'-int8' if p[1] else ''}")
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("qtype", ["Q4_1", "Q4_K", "Q5_K", "Q6_K"])
def test_non_finite_activations_reach_the_output(
    pool_kind: tuple[str, bool], bad: float, qtype: str
) -> None:
    """A NaN or inf activation must not vanish in quantization: its row's outputs are not
    finite (so the sampler sees a failed row), the other rows are untouched."""
    k = 512 if qtype.endswith("_K") else 96
    w = _weight(qtype, 20, k, 1)
    pool = CpuQuantLinearPool(num_threads=1, isa=pool_kind[0], int8=pool_kind[1])
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(2))
    clean = pool.linear(x, w.data, qtype)
    x[1, 40 + k // 2] = bad  # in the second super-block of a k-quant
    got = pool.linear(x, w.data, qtype)
    assert not torch.isfinite(got[1]).any()
    assert torch.equal(got[0], clean[0]) and torch.equal(got[2], clean[2])

"""ext/cpu/norm: the bf16 RMSNorm (and residual add) against the torch expression."""

from __future__ import annotations

import pytest
import torch

from tandem.ext.cpu.norm import rms_norm_cpu
from tandem.ext.cuda.norm import rms_norm_ref


@pytest.mark.parametrize("shape", [(1, 576), (7, 64), (3, 5, 100), (300, 33)])
def test_matches_the_torch_expression(shape: tuple[int, ...]) -> None:
    gen = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=gen) * 3).bfloat16()
    w = (torch.rand(shape[-1], generator=gen) + 0.5).bfloat16()
    got = rms_norm_cpu(x, w, 1e-5)[1]
    ref = rms_norm_ref(x, w, 1e-5)
    assert got.dtype == torch.bfloat16 and got.shape == x.shape
    # the mean of squares is summed in another order: at most one bf16 step apart, rarely
    step = ref.float().abs() * 2**-7
    assert ((got.float() - ref.float()).abs() <= step).all()
    assert (got == ref).float().mean() >= 0.99


def test_delta_is_added_first_and_no_input_changes() -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, 96, generator=gen).bfloat16()
    delta = torch.randn(5, 96, generator=gen).bfloat16()
    w = torch.rand(96, generator=gen).bfloat16()
    x0, delta0 = x.clone(), delta.clone()
    total, got = rms_norm_cpu(x, w, 1e-6, delta=delta)
    assert torch.equal(total, x0 + delta0)  # the sum, bitwise as torch adds bf16
    assert torch.equal(x, x0) and torch.equal(delta, delta0)
    ref = rms_norm_ref(total, w, 1e-6).float()
    assert ((got.float() - ref).abs() <= ref.abs() * 2**-7).all()


def test_bad_arguments_are_refused() -> None:
    x = torch.randn(2, 8).bfloat16()
    with pytest.raises(ValueError, match="bf16"):
        rms_norm_cpu(x.float(), torch.ones(8).bfloat16(), 1e-6)
    with pytest.raises(ValueError, match="bf16"):
        rms_norm_cpu(x, torch.ones(9).bfloat16(), 1e-6)
    with pytest.raises(ValueError, match="delta"):
        rms_norm_cpu(x, torch.ones(8).bfloat16(), 1e-6, delta=torch.zeros(2, 9).bfloat16())

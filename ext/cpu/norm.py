"""`rms_norm_cpu`: the Python face of the C++ bf16 RMSNorm (ext/cpu/norm.*), optionally fused
with the residual add before it (into a new tensor); one call instead of the ~8 torch ops of the expression, which
dominate a CPU decode step's per-layer overhead. Validates every tensor before its address
reaches C++. Knows nothing about models."""

from __future__ import annotations

import torch

from .build import load_extension


def supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `rms_norm_cpu` takes these (bf16 CPU rows and weight of the same width)."""
    return (
        x.device.type == "cpu"
        and x.dtype == torch.bfloat16
        and weight.dtype == torch.bfloat16
        and weight.device.type == "cpu"
        and x.dim() >= 1
        and weight.shape == (x.shape[-1],)
    )


def rms_norm_cpu(
    x: torch.Tensor,  # [..., D] bf16, CPU
    weight: torch.Tensor,  # [D] bf16, CPU
    eps: float,
    delta: torch.Tensor | None = None,  # like x: normalize x + delta instead
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta or x, its RMSNorm times weight), as ext/cuda/norm.py's rms_norm_ref computes
    it (the mean of squares summed in another order); no input is modified."""
    if not supported(x, weight):
        raise ValueError("x must be [..., D] bf16 on the CPU and weight [D] bf16")
    x = x.contiguous()
    weight = weight.contiguous()
    total = x
    if delta is not None:
        if delta.shape != x.shape or delta.dtype != x.dtype or delta.device.type != "cpu":
            raise ValueError("delta must be a bf16 CPU tensor shaped like x")
        delta = delta.contiguous()
        total = torch.empty_like(x)
    out = torch.empty_like(x)
    dim = x.shape[-1]
    rows = x.numel() // dim if dim else 0
    if rows:
        load_extension().rms_norm_bf16(
            x.data_ptr(), 0 if delta is None else delta.data_ptr(),
            0 if delta is None else total.data_ptr(), weight.data_ptr(), out.data_ptr(), rows,
            dim, float(eps),
        )  # fmt: skip
    return total, out

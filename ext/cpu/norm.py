"""`rms_norm_cpu`: the Python face of the C++ bf16 RMSNorm (ext/cpu/norm.*), optionally fused
with the residual add before it; one call instead of the ~8 torch ops of the expression, which
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
    residual: torch.Tensor | None = None,  # like x: replaced by x + residual (in place)
) -> torch.Tensor:
    """RMSNorm of x (or of x + residual, which is written into `residual`) times weight, as
    ext/cuda/norm.py's rms_norm_ref computes it (the mean of squares summed in another order)."""
    if not supported(x, weight):
        raise ValueError("x must be [..., D] bf16 on the CPU and weight [D] bf16")
    x = x.contiguous()
    weight = weight.contiguous()
    res_ptr = 0
    if residual is not None:
        if (
            residual.shape != x.shape
            or residual.dtype != x.dtype
            or residual.device.type != "cpu"
            or not residual.is_contiguous()
        ):
            raise ValueError("residual must be a contiguous bf16 CPU tensor shaped like x")
        res_ptr = residual.data_ptr()
    out = torch.empty_like(x)
    dim = x.shape[-1]
    rows = x.numel() // dim if dim else 0
    if rows:
        load_extension().rms_norm_bf16(
            x.data_ptr(), res_ptr, weight.data_ptr(), out.data_ptr(), rows, dim, float(eps)
        )
    return out

"""`rope_neox_cpu_`: the Python face of the C++ in-place rotary embedding (ext/cpu/rope.*),
bitwise ext/attention_ref.py's `rotate_neox` for bf16 heads; one call instead of its ~6 torch
ops a tensor. Validates every tensor before its address reaches C++. Knows nothing about
models."""

from __future__ import annotations

import torch

from .build import load_extension

MAX_HEAD_DIM = 1024


def supported(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether `rope_neox_cpu_` takes x [T, H, D] with cos, sin [T, 1, D] (bf16 CPU, unit
    stride along D, an even D up to MAX_HEAD_DIM, contiguous cos and sin)."""
    return (
        x.device.type == "cpu"
        and x.dtype == torch.bfloat16
        and x.dim() == 3
        and x.stride(-1) == 1
        and x.shape[-1] % 2 == 0
        and x.shape[-1] <= MAX_HEAD_DIM
        and cos.dtype == torch.bfloat16
        and cos.device.type == "cpu"
        and cos.shape == (x.shape[0], 1, x.shape[-1])
        and cos.is_contiguous()
        and sin.dtype == torch.bfloat16
        and sin.device.type == "cpu"
        and sin.shape == cos.shape
        and sin.is_contiguous()
    )


def rope_neox_cpu_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates x `[T, H, D]` (bf16, a view with unit stride along D is fine) in place by
    cos/sin `[T, 1, D]` bf16; returns x."""
    if not supported(x, cos, sin):
        raise ValueError("rope_neox_cpu_: x must be [T, H, D] bf16 (D even, unit stride), "
                         "cos/sin contiguous [T, 1, D] bf16, all on the CPU")  # fmt: skip
    T, H, D = x.shape
    if T and H:
        load_extension().rope_neox_bf16(
            x.data_ptr(), T, H, D, x.stride(0), x.stride(1), cos.data_ptr(), sin.data_ptr()
        )
    return x

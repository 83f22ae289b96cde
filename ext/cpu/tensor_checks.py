"""Argument checks shared by the CPU expert pool's calls: a tensor's device, dtype and rank,
overlapping buffers, non-negative counts; each failure a ValueError naming the argument."""

from __future__ import annotations

from typing import Any

import torch


def _check_cpu_tensor(name: str, t: Any, dtypes: tuple[torch.dtype, ...], ndim: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"{name} must be on the CPU, got {t.device}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name} must have dtype {' or '.join(map(str, dtypes))}, got {t.dtype}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")


def _non_negative_int(name: str, value: Any) -> int:
    if not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    return value


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    a0, b0 = a.data_ptr(), b.data_ptr()
    a1, b1 = a0 + a.numel() * a.element_size(), b0 + b.numel() * b.element_size()
    return a0 < b1 and b0 < a1


def output_buffer(out: Any, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """A linear's result: a new [rows, cols] `dtype` CPU tensor when `out` is None, else `out`
    checked to be a contiguous [rows, cols] float32/bfloat16 CPU tensor."""
    if out is None:
        return torch.empty(rows, cols, dtype=dtype)
    if (
        not isinstance(out, torch.Tensor)
        or out.device.type != "cpu"
        or out.dtype not in (torch.float32, torch.bfloat16)
        or tuple(out.shape) != (rows, cols)
        or not out.is_contiguous()
    ):
        raise ValueError(f"out must be a contiguous [{rows}, {cols}] float32/bfloat16 CPU tensor")
    return out

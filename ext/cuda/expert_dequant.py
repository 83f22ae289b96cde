"""The CPU expert pool's packed int8/int4 expert rows widened to fp16/bf16 on the GPU
(`expert_dequant.cu`); `ext.cpu.layout.dequantize` is its torch reference (and the fall-back
for what the kernel does not take: bf16 rows, float32 output, CPU tensors)."""

from __future__ import annotations

import torch

from tandem.ext.cpu.layout import dequantize as dequantize_ref
from tandem.ext.cuda._loader import i32, i64, launch, ptr

_DT = {torch.float16: 0, torch.bfloat16: 1}
_FMT = {"int8": 1, "int4": 2}


def supported(q: torch.Tensor, fmt: str, dtype: torch.dtype) -> bool:
    """Whether the kernel takes these rows (else the torch reference)."""
    return q.is_cuda and fmt in _FMT and dtype in _DT


def dequantize(
    q: torch.Tensor,  # [E, R, row_bytes] uint8, cuda (a strided view of the raw shard)
    scales: torch.Tensor | None,  # [E, R, spr] float32, cuda
    fmt: str,
    group: int,
    dtype: torch.dtype,
    out: torch.Tensor | None = None,  # [E, R, K] dtype, contiguous: written in place
    packed: bool = False,  # int rows in the pool's packed order (ext/cpu/layout.py)
) -> torch.Tensor:
    """Rows of the pool's encoding as `dtype` [E, R, K], on q's device and current stream."""
    E, R, nb = q.shape
    K = nb * 2 if fmt == "int4" else nb
    if out is not None and (tuple(out.shape) != (E, R, K) or out.dtype != dtype):
        raise ValueError(f"out must be {dtype} {(E, R, K)}, got {out.dtype} {tuple(out.shape)}")
    if not supported(q, fmt, dtype):
        ref = dequantize_ref(q, scales, fmt, group, dtype, packed)
        if out is None:
            return ref
        out.copy_(ref)
        return out
    if scales is None or scales.dtype != torch.float32 or not scales.is_cuda:
        raise ValueError("int8/int4 rows need float32 scales on the same device")
    if q.dtype != torch.uint8 or q.stride(2) != 1 or scales.stride(2) != 1:
        raise ValueError("q must be uint8 with contiguous rows, scales with contiguous rows")
    if K % 64 or q.stride(1) % 8 or q.stride(0) % 8 or q.data_ptr() % 8:
        raise ValueError("K must be a multiple of 64 and q rows 8-byte aligned")
    if fmt == "int4" and group not in (32, 64):
        raise ValueError(f"int4 group must be 32 or 64, got {group}")
    spr = scales.shape[2]
    if (fmt == "int8" and spr != 1) or (fmt == "int4" and spr != K // group):
        raise ValueError(f"scales per row {spr} do not fit {fmt} K={K} group={group}")
    if scales.shape[:2] != (E, R):
        raise ValueError(f"scales must be [{E}, {R}, spr], got {tuple(scales.shape)}")
    if out is None:
        out = torch.empty(E, R, K, dtype=dtype, device=q.device)
    elif not out.is_contiguous() or out.data_ptr() % 16:
        raise ValueError("out must be contiguous and 16-byte aligned")
    total = E * R * (K // 16)
    if total == 0:
        return out
    grid = min(-(-total // 256), 132 * 16)
    launch(
        "expert_dequant.cu",
        f"expert_dequant_kernel<{_FMT[fmt]},{_DT[dtype]},{'true' if packed else 'false'}>",
        q.device,
        (grid, 1, 1),
        (256, 1, 1),
        (ptr(q), ptr(scales), ptr(out), i32(E), i32(R), i32(K), i64(q.stride(0)),
         i64(q.stride(1)), i64(scales.stride(0)), i64(scales.stride(1)),
         i32(group if fmt == "int4" else 0)),
    )  # fmt: skip
    return out

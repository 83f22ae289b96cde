"""The CPU expert pool's weight layout, read from torch: views of one node shard's raw bytes
and their dequantization, in pure torch (any device).

A layer's experts live in one shard per NUMA node, each a contiguous region (ext/cpu/moe.h:
Shard) of `[w13 of every expert][w2 of every expert][s13][s2]`:
  w13: per expert `Is / 32` blocks of 32 gate rows then 32 up rows, each row `Hp` elements
       (the shard's intermediate columns [i0, i0 + Is), padded with zero rows past I);
  w2:  per expert `Hp` rows of `Is` elements (zero columns past I, zero rows past H);
  s13/s2: fp32 scales (int8: one a row; int4: one per `group` elements; bf16: none).
Row encodings (ext/cpu/kernels.h): bf16; int8 (value = q * scale); int4 (value = (nibble - 8)
* scale, each 64-element chunk 32 bytes, byte j holding element j low and j + 32 high).
Packed layers (`packed`, kernels.h: packed_at) store each int8/int4 row permuted into the
order the CPU's integer kernel reads: super-blocks of 512 elements (the last one m = rest / 32
blocks), int8 as 8 runs of 4m bytes, run j holding elements [32 l + 4 j, +4) of each block l;
int4 as 4 runs u of 4m bytes, byte 4 l + b holding element 32 l + 4 u + b (low nibble) and
32 l + 16 + 4 u + b (high). Scales are not permuted.

This is what lets another device compute with the pool's weights without converting them
again: the raw shard goes to the GPU as it is, and `dequantize` (or its CUDA kernel,
ext/cuda/expert_dequant.py) turns it into `[E, rows, K]` matrices in the blocked row order.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

K_ALIGN = 64  # ext/cpu/kernels.h: kKAlign
FORMAT_CODES = {"bf16": 0, "int8": 1, "int4": 2}


def row_bytes(fmt: str, k: int) -> int:
    return k * 2 if fmt == "bf16" else k if fmt == "int8" else k // 2


def scales_per_row(fmt: str, k: int, group: int) -> int:
    return 0 if fmt == "bf16" else 1 if fmt == "int8" else k // group


@dataclass(frozen=True)
class ShardLayout:
    """One node shard of a layer: where its region is and how it is laid out (bytes)."""

    E: int
    H: int
    Hp: int  # H padded to K_ALIGN
    i0: int  # first intermediate column of the shard
    Is: int  # its columns, padded to K_ALIGN
    Iv: int  # of those, real (< I)
    fmt: str
    group: int  # int4 group size (0 otherwise)
    ptr: int  # host address of the region
    nbytes: int
    w13_expert: int  # bytes per expert of each array (padded)
    w2_expert: int
    s13_expert: int
    s2_expert: int
    packed: bool = False  # int8/int4 rows in the packed order

    @property
    def offsets(self) -> tuple[int, int, int]:
        """Byte offsets of w2, s13 and s2 in the region (w13 starts it)."""
        w2 = self.E * self.w13_expert
        s13 = w2 + self.E * self.w2_expert
        return w2, s13, s13 + self.E * self.s13_expert


def split_shard(
    raw: torch.Tensor, s: ShardLayout
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
    """Views of a shard's region `raw` (uint8 [nbytes], any device): (w13 [E, 2Is, rb13]
    uint8, s13 [E, 2Is, spr13] f32 or None, w2 [E, Hp, rb2] uint8, s2 [E, Hp, spr2] or None)."""
    if raw.dtype != torch.uint8 or raw.dim() != 1 or raw.numel() < s.nbytes:
        raise ValueError(f"raw must be uint8 [{s.nbytes}], got {raw.dtype} {tuple(raw.shape)}")
    o_w2, o_s13, o_s2 = s.offsets
    rb13, rb2 = row_bytes(s.fmt, s.Hp), row_bytes(s.fmt, s.Is)
    spr13, spr2 = scales_per_row(s.fmt, s.Hp, s.group), scales_per_row(s.fmt, s.Is, s.group)

    def rows(off: int, per_expert: int, n: int, width: int) -> torch.Tensor:
        block = raw[off : off + s.E * per_expert].view(s.E, per_expert)
        return block[:, : n * width].view(s.E, n, width)

    w13 = rows(0, s.w13_expert, 2 * s.Is, rb13)
    w2 = rows(o_w2, s.w2_expert, s.Hp, rb2)
    if not spr13:
        return w13, None, w2, None
    s13 = rows(o_s13, s.s13_expert, 2 * s.Is, spr13 * 4).view(torch.float32)
    s2 = rows(o_s2, s.s2_expert, s.Hp, spr2 * 4).view(torch.float32)
    return w13, s13, w2, s2


@functools.lru_cache(maxsize=64)
def packed_index(fmt: str, k: int) -> torch.Tensor:
    """For each natural element of a packed row of `k` elements, where it is: int8 its byte,
    int4 2 * byte + (1 if in the high nibble) (kernels.h: packed_at). int64 [k], CPU."""
    e = torch.arange(k)
    sb, lane, i = e // 512, (e % 512) // 32, e % 32
    m = ((k - sb * 512) // 32).clamp(max=16)
    if fmt == "int8":
        return sb * 512 + (i // 4) * 4 * m + 4 * lane + i % 4
    if fmt == "int4":
        byte = sb * 256 + ((i % 16) // 4) * 4 * m + 4 * lane + i % 4
        return 2 * byte + (i >= 16).long()
    raise ValueError(f"only int8/int4 rows are packed, not {fmt!r}")


def dequantize(
    q: torch.Tensor,  # [E, R, row_bytes] uint8
    scales: torch.Tensor | None,  # [E, R, spr] f32
    fmt: str,
    group: int,
    dtype: torch.dtype,
    packed: bool = False,
) -> torch.Tensor:
    """Rows of the pool's encoding as `dtype` [E, R, K] (the reference of the CUDA kernel:
    the value in fp32, rounded once to `dtype`); `packed`: int rows in the packed order."""
    E, R, nb = q.shape
    if fmt == "bf16":
        return q.contiguous().view(torch.bfloat16).to(dtype)
    if fmt == "int8":
        if packed:
            q = q[..., packed_index(fmt, nb).to(q.device)]
        return (q.view(torch.int8).float() * scales).to(dtype)
    if fmt != "int4":
        raise ValueError(f"unknown format {fmt!r}")
    if packed:  # nibbles in byte order (low, high), then each element from where it is
        nib = torch.stack([q & 15, q >> 4], dim=-1).reshape(E, R, nb * 2)
        nib = nib[..., packed_index(fmt, nb * 2).to(q.device)]
    else:
        b = q.view(E, R, nb // 32, 32)
        nib = torch.cat([b & 15, b >> 4], dim=-1).reshape(E, R, nb * 2)  # [E, R, K]
    s = scales.repeat_interleave(group, dim=-1)
    return ((nib.float() - 8.0) * s).to(dtype)


def shard_weights(
    raw: torch.Tensor, s: ShardLayout, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """A shard's experts as `dtype` matrices in the blocked row order, with the torch
    reference: (w13 [E, 2Is, Hp], w2 [E, Hp, Is]). Padded rows and columns are zero."""
    w13q, s13, w2q, s2 = split_shard(raw, s)
    return (
        dequantize(w13q, s13, s.fmt, s.group, dtype, s.packed),
        dequantize(w2q, s2, s.fmt, s.group, dtype, s.packed),
    )


def blocked_to_hf(
    w13: torch.Tensor, w2: torch.Tensor, s: ShardLayout
) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocked shard matrices -> the HF layout of its real columns: (w13 [E, 2Iv, H] gate rows
    then up rows, w2 [E, H, Iv]). For tests and tools."""
    E = w13.shape[0]
    g = w13.view(E, s.Is // 32, 2, 32, s.Hp)
    gate = g[:, :, 0].reshape(E, s.Is, s.Hp)[:, : s.Iv, : s.H]
    up = g[:, :, 1].reshape(E, s.Is, s.Hp)[:, : s.Iv, : s.H]
    return torch.cat([gate, up], dim=1), w2[:, : s.H, : s.Iv]

"""FP8 e4m3 weights as checkpoints store them, read by one reader for every consumer (the
dequantize-at-load path of DeepSeek's and any other loader, and the packed `Fp8Tensor` the FP8
linears serve): `weight` in fp8 with either `weight_scale_inv` per (128 x 128) block (DeepSeek,
Qwen3-FP8) or `weight_scale` per tensor or per output channel (compressed-tensors, fbgemm).
The real weight is value * scale of its block in every case.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from tandem.models.config import UnsupportedModelError

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
BLOCK_SCALE = "_scale_inv"  # "<name>.weight" + "<name>.weight_scale_inv": per block
PLAIN_SCALE = "_scale"  # "<name>.weight" + "<name>.weight_scale": per tensor or channel
SCALE_SUFFIXES = (BLOCK_SCALE, PLAIN_SCALE)


@dataclass
class Fp8Tensor:
    """W [N, K] = data (e4m3) * scale[n // block[0], k // block[1]] (float32 scales; edge
    blocks may be partial). Per-tensor and per-channel scales are held per row, block (1, K)."""

    data: torch.Tensor
    scale: torch.Tensor
    block: tuple[int, int]
    qtype: str = "fp8"

    def __post_init__(self) -> None:
        _check_tiles(self.data, self.scale, self.block)

    @property
    def rows(self) -> int:
        return self.data.shape[0]

    @property
    def cols(self) -> int:
        return self.data.shape[1]

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.cols)

    @property
    def nbytes(self) -> int:
        return self.data.numel() + self.scale.numel() * 4

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequant_fp8_blockwise(self.data, self.scale, self.block).to(dtype)

    def to(self, device: torch.device | str) -> Fp8Tensor:
        return Fp8Tensor(self.data.to(device), self.scale.to(device), self.block)


def _check_tiles(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> None:
    if weight.dim() != 2 or scale.dim() != 2:
        raise ValueError(
            f"FP8 block dequantization needs 2-D weight and scales, got {tuple(weight.shape)} "
            f"and {tuple(scale.shape)}"
        )
    rows, cols = weight.shape
    expected = (-(-rows // block[0]), -(-cols // block[1]))
    if tuple(scale.shape) != expected:
        raise ValueError(
            f"FP8 scales of shape {tuple(scale.shape)} do not tile a {rows}x{cols} weight in "
            f"{block[0]}x{block[1]} blocks (expected {expected})"
        )


def dequant_fp8_blockwise(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = (128, 128)
) -> torch.Tensor:
    """weight `[out, in]` fp8, scale_inv `[ceil(out / block[0]), ceil(in / block[1])]` ->
    `[out, in]` float32 (the caller casts to the model dtype). Edge blocks may be partial."""
    _check_tiles(weight, scale_inv, block)
    rows, cols = weight.shape
    br, bc = block
    scales = scale_inv.float().repeat_interleave(br, 0)[:rows].repeat_interleave(bc, 1)[:, :cols]
    return weight.float() * scales


def read_fp8(
    name: str,
    weight: torch.Tensor,
    get: Callable[[str], torch.Tensor | None],
    block: tuple[int, int] = (128, 128),
) -> Fp8Tensor:
    """The fp8 `weight` called `name` with its scale, looked up by `get(scale name)` (None when
    the checkpoint has none): `weight_scale_inv` per `block`, or `weight_scale` with one value
    per tensor or per output channel (held per row)."""
    if weight.dtype not in FP8_DTYPES:
        raise UnsupportedModelError(f"tensor {name!r} is {weight.dtype}, not FP8")
    rows, cols = weight.shape
    scale = get(name + BLOCK_SCALE)
    try:
        if scale is not None:
            scale = scale.float()
            if scale.dim() == 0 or scale.numel() == 1:  # one block covers the tensor
                return Fp8Tensor(
                    weight, scale.reshape(1, 1).expand(rows, 1).contiguous(), (1, cols)
                )
            return Fp8Tensor(weight, scale.contiguous(), block)
        scale = get(name + PLAIN_SCALE)
        if scale is None:
            raise UnsupportedModelError(
                f"FP8 tensor {name!r} has neither {name + BLOCK_SCALE!r} nor "
                f"{name + PLAIN_SCALE!r} in the checkpoint"
            )
        scale = scale.float()
        if scale.numel() == 1:
            per_row = scale.reshape(1, 1).expand(rows, 1).contiguous()
        elif scale.numel() == rows and (scale.dim() == 1 or scale.shape[-1] == 1):
            per_row = scale.reshape(rows, 1).contiguous()
        elif scale.dim() == 2 and scale.shape[0] == -(-rows // block[0]):
            return Fp8Tensor(weight, scale.contiguous(), block)
        else:
            raise UnsupportedModelError(
                f"FP8 tensor {name!r}: weight_scale of shape {tuple(scale.shape)} is neither per "
                f"tensor, per channel ({rows}) nor per {block[0]}x{block[1]} block"
            )
        return Fp8Tensor(weight, per_row, (1, cols))
    except ValueError as exc:
        raise UnsupportedModelError(f"FP8 tensor {name!r}: {exc}") from exc


def merge_fp8(parts: list[Fp8Tensor]) -> Fp8Tensor | None:
    """Stack row parts into one tensor when their scale grids line up (same block; every part
    but the last a whole number of row blocks)."""
    first = parts[0]
    if len(parts) == 1:
        return first
    for p in parts:
        if p.cols != first.cols:
            return None
    if all(p.block[0] == 1 and p.block[1] == p.cols for p in parts):
        block = (1, first.cols)
    elif all(p.block == first.block for p in parts) and all(
        p.rows % first.block[0] == 0 for p in parts[:-1]
    ):
        block = first.block
    else:
        return None
    return Fp8Tensor(torch.cat([p.data for p in parts]), torch.cat([p.scale for p in parts]), block)

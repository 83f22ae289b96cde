"""FP8 block-scaled weights as DeepSeek's checkpoints store them: e4m3 values with a float32
`weight_scale_inv` per (128 x 128) block; the real weight is value * scale_inv of its block.
Decoding only; nothing here computes in FP8.
"""

from __future__ import annotations

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def dequant_fp8_blockwise(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = (128, 128)
) -> torch.Tensor:
    """weight `[out, in]` fp8, scale_inv `[ceil(out / block[0]), ceil(in / block[1])]` ->
    `[out, in]` float32 (the caller casts to the model dtype). Edge blocks may be partial."""
    if weight.dim() != 2 or scale_inv.dim() != 2:
        raise ValueError(
            f"FP8 block dequantization needs 2-D weight and scales, got {tuple(weight.shape)} "
            f"and {tuple(scale_inv.shape)}"
        )
    rows, cols = weight.shape
    br, bc = block
    expected = (-(-rows // br), -(-cols // bc))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(
            f"FP8 scales of shape {tuple(scale_inv.shape)} do not tile a {rows}x{cols} weight in "
            f"{br}x{bc} blocks (expected {expected})"
        )
    scales = scale_inv.float().repeat_interleave(br, 0)[:rows].repeat_interleave(bc, 1)[:, :cols]
    return weight.float() * scales

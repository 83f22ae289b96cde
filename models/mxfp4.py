"""MXFP4, the OCP microscaling 4-bit format GPT-OSS checkpoints store their experts in: per 32
consecutive values of a row, 16 bytes of e2m1 nibbles (low nibble first) and one e8m0 scale
byte (2 ** (byte - 127)). Owns decoding them, and the reference encoder tests use to write
checkpoints of their own."""

from __future__ import annotations

import torch

BLOCK = 32  # values per scale
# e2m1: sign bit, 2 exponent bits, 1 mantissa bit
E2M1_VALUES = (
    0.0,
    0.5,
    1.0,
    1.5,
    2.0,
    3.0,
    4.0,
    6.0,
    -0.0,
    -0.5,
    -1.0,
    -1.5,
    -2.0,
    -3.0,
    -4.0,
    -6.0,
)


def dequantize_mxfp4(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """blocks `[..., G, 16]` uint8 and scales `[..., G]` uint8 -> `[..., G * 32]` in `dtype`
    (exact in float32 and bfloat16 for every scale the format's range of a model needs)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(
            f"MXFP4 blocks and scales must be uint8, got {blocks.dtype}, {scales.dtype}"
        )
    if blocks.shape[-1] != BLOCK // 2 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)} "
            f"(blocks must be [..., G, {BLOCK // 2}] for scales [..., G])"
        )
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    values = torch.stack((lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]), dim=-1)
    values = values.flatten(-2)  # [..., G, 32]: element 2i from the low nibble of byte i
    exponent = scales.to(torch.int32) - 127
    out = torch.ldexp(values, exponent[..., None].float())
    return out.flatten(-2).to(dtype)


def quantize_mxfp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x `[..., N]` (N a multiple of 32) -> (blocks `[..., N / 32, 16]`, scales `[..., N / 32]`)
    uint8: per block the power of two that brings its largest magnitude to at most 6, each value
    rounded to the nearest e2m1 value (ties to the smaller magnitude)."""
    if x.shape[-1] % BLOCK:
        raise ValueError(f"the last dimension must be a multiple of {BLOCK}, got {x.shape[-1]}")
    xf = x.float().reshape(*x.shape[:-1], -1, BLOCK)  # [..., G, 32]
    amax = xf.abs().amax(dim=-1)  # [..., G]
    exponent = torch.where(
        amax > 0, torch.ceil(torch.log2(amax.clamp(min=1e-38) / 6.0)), torch.zeros_like(amax)
    ).clamp(-127, 127)
    scaled = xf / torch.exp2(exponent)[..., None]
    lut = torch.tensor(E2M1_VALUES[:8], dtype=torch.float32)
    codes = (scaled.abs()[..., None] - lut).abs().argmin(dim=-1)  # [..., G, 32] magnitude 0..7
    codes = codes + 8 * (scaled < 0).long()
    codes = codes.to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    scales = (exponent + 127).to(torch.uint8)
    return blocks.contiguous(), scales.contiguous()


def to_ggml_blocks(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """blocks `[..., G, 16]` and scales `[..., G]` uint8 (this format's order: value 2i in the
    low nibble of byte i) -> ggml's MXFP4 rows `[..., G * 17]` uint8 (per block the scale byte,
    then value i < 16 in the low nibble of byte i and value i + 16 in its high nibble), the
    same values (models/gguf_dequant.py decodes them; so do the CUDA expert kernels)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(
            f"MXFP4 blocks and scales must be uint8, got {blocks.dtype}, {scales.dtype}"
        )
    if blocks.shape[-1] != BLOCK // 2 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)}"
        )
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).flatten(-2)  # [..., G, 32]
    qs = codes[..., :16] | (codes[..., 16:] << 4)
    out = torch.cat((scales.unsqueeze(-1), qs), dim=-1)  # [..., G, 17]
    return out.flatten(-2).contiguous()

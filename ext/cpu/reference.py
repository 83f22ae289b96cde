"""Pure-torch reference for the CPU expert pool: the weight quantizers and the MoE step.

The C++ converter (ext/cpu/moe.cpp: quantize_row) follows these formulas exactly, so tests can
compare the pool with a float32 computation on the same dequantized weights.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

FORMATS = ("bf16", "int8", "int4")
QBLOCK = 32  # activation elements per scale on the integer path (ext/cpu/kernels.h: kQBlock)
# Levels of the AMX tiles' 16-bit activations for int8 weights (ext/cpu/kernels.h: kRow16Levels).
ROW16_LEVELS = 32639
# The int4 group size whose AMX tiles quantize activations per block of it (kTileQBlock4).
TILE_QBLOCK4 = 64


Quantizer = Callable[[torch.Tensor], torch.Tensor]


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


def quantize(w: torch.Tensor, fmt: str, group_size: int = 64) -> torch.Tensor:
    """Weights as the pool stores them, dequantized to float32 (same shape as w).

    Rows are the last dimension. bf16: round to nearest even. int8: one scale per row,
    scale = absmax / 127, q = round(w / scale) in [-127, 127]. int4: one scale per group of
    group_size along the row (rows zero-padded to a whole group), 16 levels as GGUF's Q4_0: the
    element of largest magnitude (the first on ties) maps to -8 exactly, scale = that element
    / -8 (may be negative), q = round(w / scale) clamped to [-8, 7]. A Q4_0 block round-trips.
    """
    w = w.float()
    if fmt == "bf16":
        return w.to(torch.bfloat16).float()
    if fmt == "int8":
        scale = w.abs().amax(dim=-1, keepdim=True) / 127.0
        q = torch.where(scale > 0, torch.round(w / scale), torch.zeros_like(w)).clamp(-127, 127)
        return q * scale
    if fmt == "int4":
        k = w.shape[-1]
        pad = (-k) % group_size
        wp = F.pad(w, (0, pad)).reshape(*w.shape[:-1], -1, group_size)
        peak = wp.gather(-1, wp.abs().argmax(dim=-1, keepdim=True))  # first max on ties
        scale = peak / -8.0
        q = torch.where(scale != 0, torch.round(wp / scale), torch.zeros_like(wp)).clamp(-8, 7)
        return (q * scale).reshape(*w.shape[:-1], -1)[..., :k]
    raise ValueError(f"unknown format {fmt!r}; expected one of {FORMATS}")


def quantize_activations(x: torch.Tensor, block: int = QBLOCK, levels: int = 127) -> torch.Tensor:
    """Activations as the pool's integer path sees them, dequantized to float32 (same shape).

    Per row (last dimension, zero-padded to a whole block) and block of `block` elements:
    scale = absmax / levels in float32, q = round-half-even(x / scale) in [-levels, levels]; an
    all-zero block is zero. The error per element is at most scale / 2 = absmax / (2 levels).
    """
    x = x.float()
    k = x.shape[-1]
    xb = F.pad(x, (0, (-k) % block)).reshape(*x.shape[:-1], -1, block)
    scale = xb.abs().amax(dim=-1, keepdim=True) / float(levels)
    q = torch.where(scale > 0, torch.round(xb / scale), torch.zeros_like(xb))
    return (q.clamp(-levels, levels) * scale).reshape(*x.shape[:-1], -1)[..., :k]


def quantize_activations_row16(x: torch.Tensor) -> torch.Tensor:
    """The AMX tiles' activations for int8 weights: one scale per row, ROW16_LEVELS levels."""
    return quantize_activations(x, block=x.shape[-1], levels=ROW16_LEVELS)


def quantize_activations_b64(x: torch.Tensor) -> torch.Tensor:
    """The AMX tiles' activations for int4 weights in groups of 64: blocks of 64, 127 levels."""
    return quantize_activations(x, block=TILE_QBLOCK4)


def int_path_activations(
    fmt: str, tiles_from: int, packed: bool = True, group: int = 0
) -> Callable[[int], Quantizer]:
    """The activation quantizer of a pool's integer path for an expert of n tokens, as a function
    of n (moe_reference's quantize_acts): per 32-element block (VNNI, and the AMX tiles on int4
    in groups of 32 or natural int8 rows); from tiles_from tokens (the pool's int_tiles_from; 0:
    none) per row (quantize_activations_row16) on packed int8 rows (the default: the pool's
    pack_rows) and per 64-element block on int4 in groups of TILE_QBLOCK4. group: int4's group
    size (required for int4)."""
    if fmt == "int4" and group not in (32, 64):
        raise ValueError(f"int4 needs its group size (32 or 64), got {group}")

    def pick(n: int) -> Quantizer:
        if not tiles_from or n < tiles_from:
            return quantize_activations
        if fmt == "int8" and packed:
            return quantize_activations_row16
        if fmt == "int4" and group == TILE_QBLOCK4:
            return quantize_activations_b64
        return quantize_activations

    return pick


def moe_reference(
    hidden: torch.Tensor,  # [T, H] float32
    w13: torch.Tensor,  # [E, 2I, H] gate rows then up rows
    w2: torch.Tensor,  # [E, H, I]
    topk_ids: torch.Tensor,  # [T, k] int; -1 skips the slot
    topk_weights: torch.Tensor,  # [T, k] float32
    quantize_acts: bool | Callable[[int], Quantizer] = False,
    b13: torch.Tensor | None = None,  # [E, 2I] gate then up biases
    b2: torch.Tensor | None = None,  # [E, H]
    activation: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """out[t] = sum_j weight[t, j] * down(SiLU(gate(x_t)) * up(x_t)) of expert ids[t, j], fp32.
    quantize_acts: both projections' inputs go through quantize_activations first (what the
    integer path computes, up to the order of float sums); or a function of an expert's token
    count giving its quantizer (int_path_activations). b13 / b2: biases added to the gate/up
    and down outputs; activation(gate, up): instead of SiLU(gate) * up."""

    hidden = hidden.float()
    out = torch.zeros_like(hidden)
    inter = w13.shape[1] // 2
    ids = topk_ids.long()
    for e in ids.unique().tolist():
        if e < 0:
            continue
        tok, slot = (ids == e).nonzero(as_tuple=True)
        if callable(quantize_acts):
            q = quantize_acts(tok.numel())
        elif quantize_acts:
            q = quantize_activations
        else:
            q = _identity
        gu = q(hidden[tok]) @ w13[e].float().t()
        if b13 is not None:
            gu = gu + b13[e].float()
        if activation is None:
            act = F.silu(gu[:, :inter]) * gu[:, inter:]
        else:
            act = activation(gu[:, :inter], gu[:, inter:])
        y = q(act) @ w2[e].float().t()
        if b2 is not None:
            y = y + b2[e].float()
        out.index_add_(0, tok, y * topk_weights[tok, slot].float()[:, None])
    return out

"""Rotary position embedding (neox-style `rotate_half`, as HF Llama/Qwen/Mixtral apply it).

Owns the inverse frequencies for the supported `rope_scaling` types (default, "linear",
"llama3", "yarn") and cos/sin computed from absolute positions; YaRN also scales cos/sin by its
attention factor, as HF does. The frequencies are a plain CPU tensor, not a buffer, so a model
built on the meta device keeps them. ("dynamic" NTK changes the frequencies with the sequence
length at run time; it is refused.)
"""

from __future__ import annotations

import math
from typing import Any

import torch

from tandem.ext.attention_ref import rotate_neox
from tandem.ext.cpu import rope as _cpu_rope
from tandem.ext.cpu.build import extension_available
from tandem.models.config import UnsupportedModelError


def _rope_type(scaling: dict[str, Any] | None) -> str:
    return (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_factor(scaling: dict[str, Any], max_positions: int | None) -> tuple[float, float]:
    """YaRN's (factor, original context): `factor` where given, else the ratio of the config's
    max_position_embeddings to the original context."""
    original = scaling.get("original_max_position_embeddings") or max_positions
    if not original:
        raise UnsupportedModelError("yarn rope scaling needs original_max_position_embeddings")
    factor = scaling.get("factor")
    if factor is None:
        if not max_positions:
            raise UnsupportedModelError("yarn rope scaling needs a factor")
        factor = max_positions / original
    return float(factor), float(original)


def _yarn_inv_freq(
    pos_freqs: torch.Tensor, head_dim: int, theta: float, scaling: dict[str, Any],
    max_positions: int | None,
) -> torch.Tensor:  # fmt: skip
    """YaRN (arXiv 2309.00071) as HF transformers computes it: per frequency a blend of the
    original (extrapolated) and the `factor`-interpolated one, by a linear ramp between the
    dimensions that turn beta_fast and beta_slow times over the original context.
    `pos_freqs`: theta ** (2i / head_dim)."""
    factor, original = _yarn_factor(scaling, max_positions)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = torch.arange(head_dim // 2, dtype=torch.float32, device="cpu")
    ramp = ((ramp - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp  # 1: keep the original frequency, 0: interpolate it
    return (1.0 / (factor * pos_freqs)) * ramp + (1.0 / pos_freqs) * extrapolation


def rope_attention_factor(
    scaling: dict[str, Any] | None, max_positions: int | None = None
) -> float:
    """The factor cos/sin are scaled by: YaRN's (from its factor, or `attention_factor`, or
    `mscale` / `mscale_all_dim`, as HF), 1 for the other types."""
    if _rope_type(scaling) != "yarn":
        return 1.0
    assert scaling is not None
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor, _ = _yarn_factor(scaling, max_positions)
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
    return _yarn_mscale(factor)


def rope_inv_freq(
    head_dim: int, theta: float, scaling: dict[str, Any] | None, max_positions: int | None = None
) -> torch.Tensor:
    """Inverse frequencies `[head_dim // 2]` float32 on the CPU. `max_positions` (the config's
    max_position_embeddings) is YaRN's default original context."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    pos_freqs = theta**exponent
    inv_freq = 1.0 / pos_freqs
    rope_type = _rope_type(scaling)
    if rope_type == "default":
        return inv_freq
    assert scaling is not None
    if rope_type == "yarn":
        return _yarn_inv_freq(pos_freqs, head_dim, theta, scaling, max_positions)
    factor = float(scaling["factor"])
    if rope_type == "linear":
        return inv_freq / factor
    if rope_type == "llama3":
        low_ff = float(scaling["low_freq_factor"])
        high_ff = float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low_ff, old_len / high_ff
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are slowed by `factor`, short ones kept, the band between blended.
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low_ff) / (high_ff - low_ff)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, blended, scaled)
    raise UnsupportedModelError(f"unsupported rope scaling type {rope_type!r}")


class RotaryEmbedding:
    """Computes cos/sin once per forward; `apply` rotates q or k per head."""

    def __init__(
        self,
        head_dim: int,
        theta: float,
        scaling: dict[str, Any] | None,
        max_positions: int | None = None,
    ) -> None:
        if head_dim % 2:  # rotate_half pairs element i with i + head_dim / 2 (HF refuses too)
            raise UnsupportedModelError(
                f"rotary embeddings need an even head_dim, got {head_dim} (head_dim, else "
                "hidden_size / num_attention_heads)"
            )
        self.head_dim = head_dim
        inv_freq = rope_inv_freq(head_dim, theta, scaling, max_positions)
        self._inv_freq = {torch.device("cpu"): inv_freq}
        self.attention_factor = rope_attention_factor(scaling, max_positions)

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions `[T]` int64 -> cos, sin `[T, 1, head_dim]` in `dtype` (broadcast over heads)."""
        inv_freq = self._inv_freq.get(positions.device)
        if inv_freq is None:
            inv_freq = self._inv_freq[torch.device("cpu")].to(positions.device)
            self._inv_freq[positions.device] = inv_freq
        freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, head_dim // 2] float32
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [T, 1, head_dim]
        if self.attention_factor != 1.0:  # YaRN: scaled in float32, before the cast (as HF)
            return (
                (emb.cos() * self.attention_factor).to(dtype),
                (emb.sin() * self.attention_factor).to(dtype),
            )
        return emb.cos().to(dtype), emb.sin().to(dtype)

    @staticmethod
    def apply_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """`apply`, rotating x in place where ext/cpu's op takes it (bf16 heads on the CPU, the
        full head rotated: the same bits in one call); the caller must not reuse x."""
        if (
            cos.shape[-1] == x.shape[-1]
            and _cpu_rope.supported(x, cos, sin)
            and not torch.compiler.is_compiling()
            and extension_available()
        ):
            return _cpu_rope.rope_neox_cpu_(x, cos, sin)
        return RotaryEmbedding.apply(x, cos, sin)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x `[T, heads, head_dim]` -> rotated, same shape and dtype. cos/sin narrower than
        head_dim (partial rotary, GLM-4.5) rotate the first dims and pass the rest through."""
        rotary_dim = cos.shape[-1]
        if rotary_dim == x.shape[-1]:
            return rotate_neox(x, cos, sin)
        rotated = rotate_neox(x[..., :rotary_dim], cos, sin)
        return torch.cat((rotated, x[..., rotary_dim:]), dim=-1)

"""Rotary position embedding (neox-style `rotate_half`, as HF Llama/Qwen/Mixtral apply it).

Owns the inverse frequencies for the supported `rope_scaling` types (default, "linear",
"llama3") and cos/sin computed from absolute positions. The frequencies are a plain CPU
tensor, not a buffer, so a model built on the meta device keeps them.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ext.attention_ref import rotate_neox
from models.config import UnsupportedModelError


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies `[head_dim // 2]` float32 on the CPU."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (theta**exponent)
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "default":
        return inv_freq
    assert scaling is not None
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

    def __init__(self, head_dim: int, theta: float, scaling: dict[str, Any] | None) -> None:
        self.head_dim = head_dim
        self._inv_freq = {torch.device("cpu"): rope_inv_freq(head_dim, theta, scaling)}

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
        return emb.cos().to(dtype), emb.sin().to(dtype)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x `[T, heads, head_dim]` -> rotated, same shape and dtype."""
        return rotate_neox(x, cos, sin)

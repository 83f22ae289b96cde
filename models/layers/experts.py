"""The expert backend interface MoE layers call, its torch reference, and a name registry.

A backend computes `sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(hidden[t])` over
stacked weights w13 `[E, 2 * I, H]` (gate rows, then up rows) and w2 `[E, H, I]`. Routing is
the MoE layer's job; placement (GPU, CPU pool) is the backend's. The other backends ("gpu":
models/layers/gpu_experts.py, "cpu_pool": models/layers/cpu_experts.py) are found by name in
models/layers/expert_registry.py.

GPT-OSS's experts add per-expert biases (b13 `[E, 2 * I]`, b2 `[E, H]`) and the clamped SwiGLU
(`ClampedSwiGLU`); only backends with `supports_expert_bias = True` take them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class ClampedSwiGLU:
    """GPT-OSS's expert activation, as transformers' GptOssExperts computes it: gate clamped
    above at `limit`, up to +-`limit`, then `(up + 1) * gate * sigmoid(alpha * gate)`."""

    alpha: float
    limit: float

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate = gate.clamp(max=self.limit)
        up = up.clamp(-self.limit, self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


@dataclass(frozen=True)
class ExpertBias:
    """Per-expert biases and activation of a layer whose experts carry them (GPT-OSS)."""

    b13: torch.Tensor  # [E, 2 * I] gate then up
    b2: torch.Tensor  # [E, H]
    activation: ClampedSwiGLU


@runtime_checkable
class ExpertBackend(Protocol):
    name: str

    def forward(
        self,
        layer_idx: int,
        hidden: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
    ) -> torch.Tensor:
        """hidden `[T, H]`, topk_ids `[T, k]` int64, topk_weights `[T, k]` float32 -> `[T, H]`
        in hidden's dtype. A backend with `supports_expert_bias` also takes `bias=ExpertBias`."""
        ...


class TorchExpertBackend:
    """Loops over the experts that received tokens; one host sync per layer (the counts)."""

    name = "torch"
    supports_expert_bias = True

    def forward(
        self,
        layer_idx: int,
        hidden: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        bias: ExpertBias | None = None,
    ) -> torch.Tensor:
        num_experts = w13.shape[0]
        top_k = topk_ids.shape[1]
        out = torch.zeros_like(hidden)  # [T, H]
        flat_ids = topk_ids.reshape(-1)  # [T * k]
        order = torch.argsort(flat_ids, stable=True)  # assignments grouped by expert
        # ids >= num_experts (another rank's experts) sort last and are skipped
        counts = torch.bincount(flat_ids, minlength=num_experts).tolist()[:num_experts]
        flat_weights = topk_weights.reshape(-1)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            assignment = order[start : start + count]  # [count] into the flat [T * k]
            start += count
            tokens = assignment // top_k  # [count] token rows
            x = hidden.index_select(0, tokens)  # [count, H]
            if bias is None:
                gate, up = F.linear(x, w13[expert]).chunk(2, dim=-1)  # [count, I] each
                y = F.linear(F.silu(gate) * up, w2[expert])  # [count, H]
            else:
                gate, up = F.linear(x, w13[expert], bias.b13[expert]).chunk(2, dim=-1)
                y = F.linear(bias.activation(gate, up), w2[expert], bias.b2[expert])
            y = y * flat_weights.index_select(0, assignment)[:, None]
            out.index_add_(0, tokens, y.to(out.dtype))
        return out

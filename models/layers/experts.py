"""The expert backend interface MoE layers call, its torch reference, and a name registry.

A backend computes `sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(hidden[t])` over
stacked weights w13 `[E, 2 * I, H]` (gate rows, then up rows) and w2 `[E, H, I]`. Routing is
the MoE layer's job; placement (GPU, CPU pool) is the backend's. The other backends ("gpu":
models/layers/gpu_experts.py, "cpu_pool": models/layers/cpu_experts.py) register a factory with
`register_expert_backend` when first asked for.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import torch
import torch.nn.functional as F


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
        in hidden's dtype."""
        ...


class TorchExpertBackend:
    """Loops over the experts that received tokens; one host sync per layer (the counts)."""

    name = "torch"

    def forward(
        self,
        layer_idx: int,
        hidden: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
    ) -> torch.Tensor:
        num_experts = w13.shape[0]
        top_k = topk_ids.shape[1]
        out = torch.zeros_like(hidden)  # [T, H]
        flat_ids = topk_ids.reshape(-1)  # [T * k]
        order = torch.argsort(flat_ids, stable=True)  # assignments grouped by expert
        counts = torch.bincount(flat_ids, minlength=num_experts).tolist()
        flat_weights = topk_weights.reshape(-1)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            assignment = order[start : start + count]  # [count] into the flat [T * k]
            start += count
            tokens = assignment // top_k  # [count] token rows
            x = hidden.index_select(0, tokens)  # [count, H]
            gate, up = F.linear(x, w13[expert]).chunk(2, dim=-1)  # [count, I] each
            y = F.linear(F.silu(gate) * up, w2[expert])  # [count, H]
            y = y * flat_weights.index_select(0, assignment)[:, None]
            out.index_add_(0, tokens, y.to(out.dtype))
        return out


_EXPERT_BACKENDS: dict[str, Callable[..., ExpertBackend]] = {"torch": TorchExpertBackend}


def register_expert_backend(name: str, factory: Callable[..., ExpertBackend]) -> None:
    """Make `get_expert_backend(name, **kwargs)` return `factory(**kwargs)`."""
    _EXPERT_BACKENDS[name] = factory


def get_expert_backend(name: str, **kwargs: Any) -> ExpertBackend:
    if name == "cpu_pool" and name not in _EXPERT_BACKENDS:
        import models.layers.cpu_experts  # noqa: F401  (registers itself; imports ext.cpu lazily)
    if name == "gpu" and name not in _EXPERT_BACKENDS:
        import models.layers.gpu_experts  # noqa: F401  (registers itself)
    if name not in _EXPERT_BACKENDS:
        raise ValueError(
            f"unknown expert backend {name!r}; available: {', '.join(sorted(_EXPERT_BACKENDS))}"
        )
    return _EXPERT_BACKENDS[name](**kwargs)

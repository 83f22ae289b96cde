"""The hybrid path's counters: `HybridMoeStats` (what a cpu_pool backend's `stats()` returns)
and the flat Prometheus-style samples /metrics renders from them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn


@dataclass
class HybridMoeStats:
    """Cumulative counters of the hybrid path (monotonic since `attach`)."""

    layer_calls: int = 0  # MoE layer forwards through the backend
    pool_wait_seconds: float = 0.0  # caller blocked on the pool (copy wait + sync)
    pool_seconds: float = 0.0  # submit -> sync returned, summed over calls
    d2h_bytes: int = 0  # device -> pinned host (hidden, ids, weights)
    h2d_bytes: int = 0  # pinned host -> device (pool output, GPU expert weights)
    pool_threads: int = 0
    pool_busy_seconds: float = 0.0  # summed over worker threads
    wall_seconds: float = 0.0  # since attach
    stream_errors: int = 0  # stream-ordered calls that failed (output zeroed; see the pool)
    gpu_prefill_calls: int = 0  # layer calls computed on the GPU from the pool's weights
    routing_counts: dict[int, list[int]] = field(default_factory=dict)  # layer -> per expert
    gpu_experts: dict[int, list[int]] = field(default_factory=dict)  # layer -> ids on the GPU

    @property
    def pool_utilisation(self) -> float:
        """Fraction of the pool threads' time spent computing, since attach."""
        denom = self.wall_seconds * max(self.pool_threads, 1)
        return self.pool_busy_seconds / denom if denom > 0 else 0.0


def hybrid_moe_stats(model: nn.Module) -> HybridMoeStats | None:
    """The hybrid counters of a loaded model, or None when its experts are not on the pool."""
    backend = getattr(model, "expert_backend", None)
    return backend.stats() if getattr(backend, "name", None) == "cpu_pool" else None


def hybrid_moe_metrics(model: nn.Module) -> dict[str, Any]:
    """Flat Prometheus-style samples: name -> value, or name -> {label value: value}."""
    s = hybrid_moe_stats(model)
    if s is None:
        return {}
    return {
        "tandem_moe_pool_wait_seconds_total": s.pool_wait_seconds,
        "tandem_moe_pool_seconds_total": s.pool_seconds,
        "tandem_moe_layer_calls_total": s.layer_calls,
        "tandem_moe_d2h_bytes_total": s.d2h_bytes,
        "tandem_moe_h2d_bytes_total": s.h2d_bytes,
        "tandem_moe_pool_threads": s.pool_threads,
        "tandem_moe_pool_busy_seconds_total": s.pool_busy_seconds,
        "tandem_moe_pool_utilisation": s.pool_utilisation,
        "tandem_moe_stream_errors_total": s.stream_errors,
        "tandem_moe_gpu_prefill_calls_total": s.gpu_prefill_calls,
        "tandem_moe_expert_routed_total": {
            (layer, e): n for layer, c in s.routing_counts.items() for e, n in enumerate(c)
        },
    }

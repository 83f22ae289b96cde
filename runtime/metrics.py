"""Small Prometheus-text metric helpers (counter, gauge, histogram) and the serving metrics set.

No prometheus_client dependency: the exposition format is a few lines of text. This module
knows nothing about HTTP; `app/metrics.py` serves what `render_metrics` returns.
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from tandem.runtime.types import EngineStats

if TYPE_CHECKING:
    from tandem.models.layers.cpu_pool_stats import HybridMoeStats

PREFIX = "tandem:"

# Latency buckets in seconds, from sub-millisecond decode steps to multi-minute requests.
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
ITL_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
)
E2E_BUCKETS = (
    0.01,
    0.05,
    0.1,
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
)


def _fmt(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if float(value).is_integer() and abs(value) < 1e15:
        return str(int(value))
    return repr(float(value))


def _labels(labels: dict[str, str] | None) -> str:
    if not labels:
        return ""

    def esc(v: str) -> str:
        return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")

    return "{" + ",".join(f'{k}="{esc(v)}"' for k, v in sorted(labels.items())) + "}"


def render_gauge(name: str, help_text: str, value: float) -> str:
    return f"# HELP {name} {help_text}\n# TYPE {name} gauge\n{name} {_fmt(value)}\n"


def render_counter(name: str, help_text: str, value: float) -> str:
    return f"# HELP {name} {help_text}\n# TYPE {name} counter\n{name} {_fmt(value)}\n"


class LabeledCounter:
    """A monotonically increasing counter with one label dimension."""

    def __init__(self, name: str, help_text: str, label: str) -> None:
        self.name = name
        self.help_text = help_text
        self.label = label
        self.values: dict[str, float] = {}

    def inc(self, label_value: str, amount: float = 1.0) -> None:
        self.values[label_value] = self.values.get(label_value, 0.0) + amount

    def render(self) -> str:
        lines = [f"# HELP {self.name} {self.help_text}", f"# TYPE {self.name} counter"]
        for value, count in sorted(self.values.items()):
            lines.append(f"{self.name}{_labels({self.label: value})} {_fmt(count)}")
        return "\n".join(lines) + "\n"


class Histogram:
    """A cumulative histogram with fixed upper bounds, rendered in Prometheus text format."""

    def __init__(self, name: str, help_text: str, buckets: Sequence[float]) -> None:
        if list(buckets) != sorted(buckets):
            raise ValueError("histogram buckets must be sorted")
        self.name = name
        self.help_text = help_text
        self.bounds: tuple[float, ...] = tuple(buckets)
        self.counts = [0] * (len(self.bounds) + 1)  # last slot: above every bound (+Inf)
        self.count = 0
        self.sum = 0.0

    def observe(self, value: float, count: int = 1) -> None:
        """Record `value` `count` times (e.g. the equal gaps of several tokens at once)."""
        self.counts[bisect.bisect_left(self.bounds, value)] += count
        self.count += count
        self.sum += value * count

    def observe_many(self, values: Iterable[float]) -> None:
        for v in values:
            self.observe(v)

    def render(self) -> str:
        lines = [f"# HELP {self.name} {self.help_text}", f"# TYPE {self.name} histogram"]
        cumulative = 0
        for bound, n in zip(self.bounds, self.counts, strict=False):
            cumulative += n
            lines.append(f'{self.name}_bucket{{le="{_fmt(bound)}"}} {cumulative}')
        lines.append(f'{self.name}_bucket{{le="+Inf"}} {self.count}')
        lines.append(f"{self.name}_sum {_fmt(self.sum)}")
        lines.append(f"{self.name}_count {self.count}")
        return "\n".join(lines) + "\n"


class ServingMetrics:
    """Latency histograms and request counters the engine loop records as deltas arrive."""

    def __init__(self) -> None:
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "Time from request arrival to its first output token.",
            TTFT_BUCKETS,
        )
        self.itl = Histogram(
            PREFIX + "inter_token_latency_seconds",
            "Time between consecutive output tokens of one sequence.",
            ITL_BUCKETS,
        )
        self.e2e = Histogram(
            PREFIX + "e2e_request_latency_seconds",
            "Time from request arrival to its last output.",
            E2E_BUCKETS,
        )
        self.finished = LabeledCounter(
            PREFIX + "request_success_total",
            "Finished sequences by finish reason.",
            "finished_reason",
        )
        self.num_rejected = 0  # admission refusals (queue full)
        self.host = HostTime()


class HostTime:
    """Where the serving host's time goes, as running totals in seconds: the engine thread
    inside `step()` (wall and its own CPU time: wall minus CPU is time spent waiting for the
    GIL, a core or the device), blocked because the event loop is `max_steps_ahead` steps
    behind, and the event loop thread's CPU time (every stream's detokenized text, SSE framing
    and socket writes) with the part spent handing step deltas to streams."""

    def __init__(self) -> None:
        self.step_seconds = 0.0  # written by the engine thread only
        self.step_cpu_seconds = 0.0
        self.ahead_wait_seconds = 0.0
        self.dispatch_seconds = 0.0  # the event loop thread
        self.loop_cpu_start: float | None = None  # time.thread_time() of the event loop thread

    def render(self, loop_cpu_now: float | None) -> str:
        p = PREFIX
        loop_cpu = 0.0 if self.loop_cpu_start is None or loop_cpu_now is None else (
            loop_cpu_now - self.loop_cpu_start
        )  # fmt: skip
        return "".join(
            [
                render_counter(p + "engine_step_seconds_total",
                               "Wall time of the engine thread inside step().",
                               self.step_seconds),
                render_counter(p + "engine_step_cpu_seconds_total",
                               "CPU time of the engine thread inside step().",
                               self.step_cpu_seconds),
                render_counter(p + "engine_ahead_wait_seconds_total",
                               "Engine thread blocked: the event loop was steps behind.",
                               self.ahead_wait_seconds),
                render_counter(p + "loop_cpu_seconds_total",
                               "CPU time of the event loop thread since the loop started.",
                               loop_cpu),
                render_counter(p + "loop_dispatch_seconds_total",
                               "Event loop time handing step deltas to request streams.",
                               self.dispatch_seconds),
            ]
        )  # fmt: skip


def render_metrics(
    stats: EngineStats,
    metrics: ServingMetrics,
    *,
    num_admitted: int,
    healthy: bool,
) -> str:
    """Prometheus text for one snapshot of engine counters plus the loop's histograms.
    Called on the event loop thread (its CPU time is read here)."""
    p = PREFIX
    parts = [
        render_gauge(
            p + "num_requests_running", "Sequences running in the engine.", stats.num_running
        ),
        render_gauge(
            p + "num_requests_waiting", "Sequences waiting in the engine.", stats.num_waiting
        ),
        render_gauge(
            p + "num_requests_admitted", "Sequences admitted and not finished.", num_admitted
        ),
        render_gauge(
            p + "kv_cache_usage_perc",
            "Fraction of KV blocks held by live requests (0-1).",
            stats.kv_cache_usage,
        ),
        render_gauge(
            p + "engine_healthy", "1 while the engine is alive and admitting.", int(healthy)
        ),
        render_counter(
            p + "prefix_cache_hits_total",
            "Prompt tokens served from the prefix cache.",
            stats.prefix_cache_hits,
        ),
        render_counter(
            p + "prefix_cache_queries_total",
            "Prompt tokens looked up in the prefix cache.",
            stats.prefix_cache_queries,
        ),
        render_counter(
            p + "num_preemptions_total", "Preemptions of running requests.", stats.num_preemptions
        ),
        render_counter(
            p + "prompt_tokens_total", "Prompt tokens processed.", stats.prompt_tokens_total
        ),
        render_counter(
            p + "generation_tokens_total", "Output tokens generated.", stats.generation_tokens_total
        ),
        render_counter(
            p + "request_rejected_total",
            "Requests refused because the queue was full.",
            metrics.num_rejected,
        ),
        render_counter(p + "num_steps_total", "Engine steps run.", stats.num_steps),
        metrics.finished.render(),
        metrics.ttft.render(),
        metrics.itl.render(),
        metrics.e2e.render(),
        metrics.host.render(time.thread_time()),
    ]
    if stats.runner_fallbacks is not None:
        parts.append(render_cuda_runner(stats))
    if stats.hybrid is not None:
        parts.append(render_hybrid_moe(stats.hybrid))
    return "".join(parts)


def render_cuda_runner(stats: EngineStats) -> str:
    """The CUDA runner's step kinds and fall-backs (never silent: each reason is counted)."""
    p = PREFIX
    fallbacks = LabeledCounter(
        p + "cuda_runner_fallbacks_total",
        "Times the CUDA runner fell back from a fast path (graph capture, compile, "
        "recompile limit, ...), by reason.",
        "reason",
    )
    for reason, count in (stats.runner_fallbacks or {}).items():
        fallbacks.inc(reason, count)
    return "".join(
        (
            render_counter(
                p + "cuda_graph_steps_total", "Steps replayed from a CUDA graph.", stats.graph_steps
            ),
            render_counter(
                p + "cuda_eager_steps_total", "Steps run without a CUDA graph.", stats.eager_steps
            ),
            fallbacks.render(),
        )
    )


def render_hybrid_moe(h: HybridMoeStats) -> str:
    """The CPU expert pool's counters. Waiting time per step is the rate of
    `moe_pool_wait_seconds_total` over the rate of `num_steps_total`."""
    p = PREFIX
    routed = p + "moe_expert_routed_total"
    lines = [f"# HELP {routed} Tokens routed to each expert.", f"# TYPE {routed} counter"]
    for layer, counts in sorted(h.routing_counts.items()):
        for expert, n in enumerate(counts):
            lines.append(
                f"{routed}{_labels({'layer': str(layer), 'expert': str(expert)})} {_fmt(n)}"
            )
    return "".join(
        [
            render_counter(
                p + "moe_pool_wait_seconds_total",
                "Seconds the forward waited for the CPU expert pool.",
                h.pool_wait_seconds,
            ),
            render_counter(
                p + "moe_pool_seconds_total",
                "Seconds from pool submit to its result.",
                h.pool_seconds,
            ),
            render_counter(
                p + "moe_layer_calls_total",
                "MoE layer forwards through the CPU pool.",
                h.layer_calls,
            ),
            render_counter(
                p + "moe_gpu_prefill_calls_total",
                "MoE layer forwards computed on the GPU from the pool's weights (prefill-sized).",
                h.gpu_prefill_calls,
            ),
            render_counter(
                p + "moe_device_to_host_bytes_total",
                "Bytes copied GPU -> pinned host.",
                h.d2h_bytes,
            ),
            render_counter(
                p + "moe_host_to_device_bytes_total",
                "Bytes copied pinned host -> GPU.",
                h.h2d_bytes,
            ),
            render_counter(
                p + "moe_stream_errors_total",
                "Stream-ordered (CUDA) pool calls that failed; their output was zeroed.",
                h.stream_errors,
            ),
            render_gauge(p + "moe_pool_threads", "Threads of the CPU expert pool.", h.pool_threads),
            render_counter(
                p + "moe_pool_busy_seconds_total",
                "Pool thread-seconds spent computing.",
                h.pool_busy_seconds,
            ),
            render_gauge(
                p + "moe_pool_utilisation",
                "Fraction of pool thread time spent computing.",
                h.pool_utilisation,
            ),
            "\n".join(lines) + "\n",
        ]
    )

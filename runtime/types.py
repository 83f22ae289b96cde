"""Typed messages that cross runtime boundaries (scheduler → runner → engine → loop → app).

All frozen: a message is built once and read by the next phase.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tandem.models.layers.cpu_pool_stats import HybridMoeStats
    from tandem.runtime.request import Request


@dataclass(frozen=True)
class ScheduledSeq:
    """One sequence's share of a step: tokens `start_pos .. start_pos + num_tokens - 1`."""

    request: Request
    start_pos: int  # == request.num_computed_tokens when scheduled
    num_tokens: int
    sample: bool  # the chunk reaches the end of request.token_ids, so a token is sampled


@dataclass(frozen=True)
class SchedulerOutput:
    seqs: tuple[ScheduledSeq, ...]
    num_batched_tokens: int
    preempted_ids: tuple[str, ...] = ()

    @property
    def is_empty(self) -> bool:
        return not self.seqs


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token_id, logprob), best first


@dataclass(frozen=True)
class SamplerOutput:
    """Per sampled sequence, in the order of the scheduled seqs that sample."""

    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None


@dataclass(frozen=True)
class RequestDelta:
    """What one step added to one request: new tokens and text, and whether it finished."""

    request_id: str
    new_token_ids: tuple[int, ...]
    new_text: str
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: tuple[TokenLogprob, ...] = ()
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None  # finish_reason "error": why this request alone failed

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class CompletionOutput:
    """One finished completion, as the offline API returns it."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprob] | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)

    # Conveniences for n == 1, the common case.
    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def stop_reason(self) -> int | str | None:
        return self.outputs[0].stop_reason


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of engine counters, read by the loop for /metrics and admission."""

    num_running: int = 0
    num_waiting: int = 0
    num_blocks: int = 0
    num_free_blocks: int = 0
    kv_cache_usage: float = 0.0  # fraction of blocks held by live requests, 0..1
    prefix_cache_hits: int = 0  # tokens served from the prefix cache
    prefix_cache_queries: int = 0  # prompt tokens looked up
    num_preemptions: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    num_steps: int = 0
    hybrid: HybridMoeStats | None = None  # experts on the CPU pool: its cumulative counters
    # CUDA runner: steps replayed from a decode graph / run eagerly, and what it fell back from
    # (reason -> count: graph capture failed, compile failures, prefill recompiles, ...)
    graph_steps: int = 0
    eager_steps: int = 0
    runner_fallbacks: dict[str, int] | None = None

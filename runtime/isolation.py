"""Failure isolation inside one step: run a batch, and where the runner raises, find the
sequences that fail alone by running the batch again in halves.

The runner's forward is independent per sequence (each reads only its own KV blocks and
rewrites the same KV slots when run again), so a part of a batch gives the same tokens as the
whole; a failure that every part hits is no request's fault, and the caller decides what that
means for the engine.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from tandem.runtime.sampler import FAILED_ROW
from tandem.runtime.types import SamplerOutput, ScheduledSeq, SchedulerOutput, TokenLogprob

log = logging.getLogger(__name__)


def sub_step(seqs: tuple[ScheduledSeq, ...]) -> SchedulerOutput:
    return SchedulerOutput(seqs=seqs, num_batched_tokens=sum(s.num_tokens for s in seqs))


def execute_isolated(
    execute: Callable[[SchedulerOutput], SamplerOutput],
    sched: SchedulerOutput,
    errors: dict[str, str],
) -> tuple[SamplerOutput, int]:
    """`execute(sched)`; if it raises, `sched` again in halves, recursively. -> the step's
    output (`FAILED_ROW` for the sampling rows of sequences that failed alone) and how many
    sequences succeeded. Each sequence that failed alone gets a message in `errors` (request id
    -> what to tell its client); the exception itself goes to the log."""
    try:
        return execute(sched), len(sched.seqs)
    except Exception as exc:
        return _bisect(execute, sched, exc, errors)


def _bisect(
    execute: Callable[[SchedulerOutput], SamplerOutput],
    sched: SchedulerOutput,
    exc: Exception,
    errors: dict[str, str],
) -> tuple[SamplerOutput, int]:
    seqs = sched.seqs
    if len(seqs) == 1:
        rid = seqs[0].request.request_id
        log.error("request %s failed in the forward pass", rid, exc_info=exc)
        errors[rid] = f"this request failed inside the model's forward pass ({type(exc).__name__})"
        return SamplerOutput([FAILED_ROW] if seqs[0].sample else []), 0
    mid = len(seqs) // 2
    outs = [execute_isolated(execute, sub_step(part), errors) for part in (seqs[:mid], seqs[mid:])]
    token_ids = [t for out, _ in outs for t in out.token_ids]
    logprobs: list[TokenLogprob] | None = None
    if any(out.logprobs is not None for out, _ in outs):
        logprobs = [
            lp
            for out, _ in outs
            for lp in (out.logprobs or [TokenLogprob(t, float("nan")) for t in out.token_ids])
        ]
    return SamplerOutput(token_ids, logprobs), sum(ok for _, ok in outs)

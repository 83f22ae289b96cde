"""The reader's side of one request: a stream of token deltas that coalesce per choice.

`RequestStream` is written by `EngineLoop` (`push`, `fail`) and read by the app (async
iteration). Pending deltas of one choice merge into one when the reader takes them, so a slow reader
gets one delta per choice however far behind it is and never stalls the writer; a push costs
O(1) and wakes the reader only if it is waiting. No engine, no
HTTP here.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from tandem.runtime.types import RequestDelta, TokenLogprob


@dataclass(frozen=True)
class ChoiceDelta:
    """A delta of one choice of a request (choice index = prompt_index * n + sample_index)."""

    index: int
    delta: RequestDelta


def merge_deltas(old: RequestDelta, new: RequestDelta) -> RequestDelta:
    """Coalesce two consecutive deltas of one sequence into one (tokens and text concatenate)."""
    return merge_all([old, new])


def merge_all(deltas: list[RequestDelta]) -> RequestDelta:
    """Coalesce consecutive deltas of one sequence into one, in time linear in their sizes."""
    if len(deltas) == 1:
        return deltas[0]
    ids: list[int] = []
    logprobs: list[TokenLogprob] = []
    finish: RequestDelta | None = None
    num_prompt = num_output = num_cached = 0
    for d in deltas:  # one pass: this runs once per reader wake-up
        ids += d.new_token_ids
        if d.logprobs:
            logprobs += d.logprobs
        if d.finish_reason:
            finish = d
        if d.num_prompt_tokens:
            num_prompt = d.num_prompt_tokens
        num_output = max(num_output, d.num_output_tokens)
        num_cached = max(num_cached, d.num_cached_tokens)
    return RequestDelta(
        request_id=deltas[-1].request_id,
        new_token_ids=tuple(ids),
        new_text="".join([d.new_text for d in deltas]),
        finish_reason=finish.finish_reason if finish else None,
        stop_reason=finish.stop_reason if finish else None,
        logprobs=tuple(logprobs),
        num_prompt_tokens=num_prompt,
        num_output_tokens=num_output,
        num_cached_tokens=num_cached,
        error=finish.error if finish else None,
    )


class RequestStream:
    """The reader's side of one request: async-iterate to get lists of `ChoiceDelta`.

    Each iteration returns everything pending, at most one (coalesced) delta per choice.
    Iteration ends once every choice has delivered its finishing delta; it raises the error
    given to `fail()` (the loop's `EngineDeadError`) once what was pending has been read.
    `close()` from a reader that stops early calls `abort(request_id)` unless finished.
    """

    def __init__(
        self, request_id: str, prompt_lens: list[int], n: int, abort: Callable[[str], object]
    ) -> None:
        self._abort = abort
        self.request_id = request_id
        self.prompt_lens = prompt_lens
        self.n = n
        self.num_choices = len(prompt_lens) * n
        self._pending: dict[int, list[RequestDelta]] = {}  # per choice, merged when taken
        self._finished: set[int] = set()  # choices whose finishing delta reached _pending
        self._delivered_all = False
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None  # the reader, while it waits
        self._loop: asyncio.AbstractEventLoop | None = None  # the reader's
        self.woken_at = 0.0  # when the loop last woke the reader (time.monotonic())

    @property
    def finished(self) -> bool:
        return len(self._finished) == self.num_choices

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def push(self, index: int, delta: RequestDelta, wake: bool = True) -> None:
        """Writer side (the loop): add a delta of choice `index`, merging with a pending one.
        `wake=False` leaves a waiting reader asleep until `wake()` (the loop's write pacing)."""
        pending = self._pending.get(index)
        if pending is None:
            self._pending[index] = [delta]
        else:
            pending.append(delta)
        if delta.finish_reason is not None:
            self._finished.add(index)
        if wake:
            self.wake()

    def fail(self, error: BaseException) -> None:
        """Writer side: end the stream with `error` (raised to the reader once drained)."""
        self._error = error
        self.wake()

    def wake(self) -> None:
        """Writer side: let a waiting reader take what is pending."""
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> list[ChoiceDelta]:
        while not self._pending:
            if self._error is not None:
                raise self._error
            if self._delivered_all:
                raise StopAsyncIteration
            if self._loop is None:  # get_running_loop() costs a getpid() each call
                self._loop = asyncio.get_running_loop()
            self._waiter = self._loop.create_future()
            await self._waiter
        pending = self._pending
        if len(pending) == 1:
            ((i, ds),) = pending.items()
            out = [ChoiceDelta(i, merge_all(ds))]
        else:
            out = [ChoiceDelta(i, merge_all(ds)) for i, ds in sorted(pending.items())]
        self._pending.clear()
        if self.finished:
            self._delivered_all = True
        return out

    def close(self) -> None:
        """The reader is gone: abort whatever has not finished (freed at the next step)."""
        if not self.finished and self._error is None:
            self._abort(self.request_id)


class WakePacer:
    """How often the loop wakes one stream's reader for deltas that are neither its first nor
    its last: every step while at most `free_streams` streams are open, else at most once per
    `num_streams / max_wakes_per_s` seconds, so that the event loop's wake-ups and socket
    writes (each a GIL hand-off with the engine thread) stay near `max_wakes_per_s` whatever
    the concurrency. A reader then gets the tokens of several steps in one chunk; the text
    is the same."""

    def __init__(self, max_wakes_per_s: float | None = 8000.0, free_streams: int = 16) -> None:
        if max_wakes_per_s is not None and max_wakes_per_s <= 0:
            raise ValueError(f"max_wakes_per_s must be > 0 or None, got {max_wakes_per_s}")
        self.max_wakes_per_s = max_wakes_per_s  # None: no pacing
        self.free_streams = free_streams

    def interval(self, num_streams: int) -> float:
        """Seconds between two wakes of one stream (0: every delta wakes its reader)."""
        if self.max_wakes_per_s is None or num_streams <= self.free_streams:
            return 0.0
        return num_streams / self.max_wakes_per_s

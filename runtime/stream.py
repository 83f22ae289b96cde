"""The reader's side of one request: a stream of token deltas that coalesce per choice.

`RequestStream` is written by `EngineLoop` (`push`, `fail`) and read by the app (async
iteration). Pending deltas of one choice merge into one, so a slow reader holds at most one
pending delta per choice however far behind it is and never stalls the writer. No engine, no
HTTP here.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from runtime.types import RequestDelta


@dataclass(frozen=True)
class ChoiceDelta:
    """A delta of one choice of a request (choice index = prompt_index * n + sample_index)."""

    index: int
    delta: RequestDelta


def merge_deltas(old: RequestDelta, new: RequestDelta) -> RequestDelta:
    """Coalesce two consecutive deltas of one sequence into one (tokens and text concatenate)."""
    return RequestDelta(
        request_id=new.request_id,
        new_token_ids=old.new_token_ids + new.new_token_ids,
        new_text=old.new_text + new.new_text,
        finish_reason=new.finish_reason or old.finish_reason,
        stop_reason=new.stop_reason if new.finish_reason else old.stop_reason,
        logprobs=old.logprobs + new.logprobs,
        num_prompt_tokens=new.num_prompt_tokens or old.num_prompt_tokens,
        num_output_tokens=max(new.num_output_tokens, old.num_output_tokens),
        num_cached_tokens=max(new.num_cached_tokens, old.num_cached_tokens),
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
        self._pending: dict[int, RequestDelta] = {}
        self._finished: set[int] = set()  # choices whose finishing delta reached _pending
        self._delivered_all = False
        self._error: BaseException | None = None
        self._ready = asyncio.Event()

    @property
    def finished(self) -> bool:
        return len(self._finished) == self.num_choices

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def push(self, index: int, delta: RequestDelta) -> None:
        """Writer side (the loop): add a delta of choice `index`, merging with a pending one."""
        old = self._pending.get(index)
        self._pending[index] = delta if old is None else merge_deltas(old, delta)
        if delta.finished:
            self._finished.add(index)
        self._ready.set()

    def fail(self, error: BaseException) -> None:
        """Writer side: end the stream with `error` (raised to the reader once drained)."""
        self._error = error
        self._ready.set()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> list[ChoiceDelta]:
        while not self._pending:
            if self._error is not None:
                raise self._error
            if self._delivered_all:
                raise StopAsyncIteration
            self._ready.clear()
            await self._ready.wait()
        out = [ChoiceDelta(i, d) for i, d in sorted(self._pending.items())]
        self._pending.clear()
        if self.finished:
            self._delivered_all = True
        return out

    def close(self) -> None:
        """The reader is gone: abort whatever has not finished (freed at the next step)."""
        if not self.finished and self._error is None:
            self._abort(self.request_id)

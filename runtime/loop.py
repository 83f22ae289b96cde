"""The async engine loop: one asyncio task owns the engine and feeds per-request streams.

`EngineLoop` is the only caller of the engine. `step()` runs in one worker thread so the event
loop stays responsive; `add_request`/`abort_request` are queued and applied between steps,
never while a step is in flight. Each request reads its output through a `RequestStream`
(runtime/stream.py) whose pending deltas coalesce per choice, so a slow reader never stalls
the engine. This module owns admission, the step task, delta dispatch, drain and shutdown.
No HTTP here.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

from runtime.metrics import ServingMetrics, render_metrics
from runtime.sampling_params import SamplingParams, expand_n
from runtime.stream import RequestStream
from runtime.types import EngineStats, RequestDelta

logger = logging.getLogger(__name__)


class EngineProtocol(Protocol):
    """The part of `runtime.engine.Engine` the loop drives."""

    tokenizer: Any
    model_name: str
    max_model_len: int

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
    ) -> None: ...
    def abort_request(self, request_id: str) -> None: ...
    def step(self) -> list[RequestDelta]: ...
    def has_unfinished_requests(self) -> bool: ...
    def stats(self) -> EngineStats: ...


class QueueFullError(RuntimeError):
    """Admission refused: the admitted sequences would exceed the loop's capacity."""


class LoopClosedError(RuntimeError):
    """Admission refused: the loop is draining or stopped."""


class EngineDeadError(RuntimeError):
    """The engine raised inside `step()`; every stream fails and nothing more is admitted."""


@dataclass
class _Child:
    stream: RequestStream
    index: int
    arrival: float
    last_token_time: float | None = None


@dataclass
class _PendingAdd:
    stream: RequestStream
    prompts: list[list[int]]
    params: SamplingParams
    priority: int
    done: asyncio.Future[None]
    children: list[str] = field(default_factory=list)


class EngineLoop:
    """Owns the engine: admission, a step task, per-request streams, drain and shutdown.

    Capacity counts sequences (prompts x n) admitted and not finished: `max_running` (what the
    engine runs at once) plus `max_queue` (what may wait). A slot is reserved synchronously
    when admission is checked, so a burst cannot overshoot.
    """

    def __init__(
        self,
        engine: EngineProtocol,
        max_queue: int = 256,
        *,
        max_running: int = 0,
        metrics: ServingMetrics | None = None,
    ) -> None:
        self.engine = engine
        self.capacity = max_queue + max_running
        self.metrics = metrics or ServingMetrics()
        self._streams: dict[str, RequestStream] = {}
        self._children: dict[str, _Child] = {}
        self._pending_adds: list[_PendingAdd] = []
        self._pending_aborts: list[str] = []
        self._num_admitted = 0
        self._stats = EngineStats()
        self._dead: BaseException | None = None
        self._draining = False
        self._stopping = False
        self._wakeup = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._task: asyncio.Task[None] | None = None
        self._executor: ThreadPoolExecutor | None = None

    # ---- state read by the app ----------------------------------------------------------
    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def stats(self) -> EngineStats:
        """The engine counters as of the last step boundary."""
        return self._stats

    @property
    def num_admitted(self) -> int:
        return self._num_admitted

    @property
    def dead(self) -> bool:
        return self._dead is not None

    @property
    def draining(self) -> bool:
        return self._draining or self._stopping

    @property
    def healthy(self) -> bool:
        return self._dead is None and not self.draining and self._task is not None

    def request_ids(self) -> list[str]:
        """Ids of the requests admitted and not finished."""
        return list(self._streams)

    def render_metrics(self) -> str:
        return render_metrics(
            self._stats, self.metrics, num_admitted=self._num_admitted, healthy=self.healthy
        )

    # ---- lifecycle ----------------------------------------------------------------------
    async def start(self) -> None:
        if self._task is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-step")
            self._task = asyncio.create_task(self._run(), name="engine-loop")

    async def wait_idle(self) -> None:
        """Return once no admitted request remains (aborts applied, streams finished)."""
        await self._idle.wait()

    def begin_drain(self) -> None:
        """Stop admitting; requests in flight carry on."""
        self._draining = True

    async def drain(self, timeout: float) -> int:
        """Stop admitting, wait up to `timeout` s for requests to finish, abort the rest.

        Returns the number of requests aborted.
        """
        self._draining = True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return 0
        except asyncio.TimeoutError:  # noqa: UP041 (py3.10: not the builtin)
            pass
        remaining = list(self._streams)
        for request_id in remaining:
            self.abort(request_id)
        await self._idle.wait()
        return len(remaining)

    async def stop(self) -> None:
        """Abort everything, end the step task and the worker thread."""
        self._stopping = True
        for request_id in list(self._streams):
            self.abort(request_id)
        self._wakeup.set()
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    # ---- requests -----------------------------------------------------------------------
    async def submit(
        self, request_id: str, prompts: list[list[int]], params: SamplingParams, priority: int = 0
    ) -> RequestStream:
        """Admit a request of one or more prompts, each sampled `params.n` times.

        Raises QueueFullError, LoopClosedError, EngineDeadError, or what `add_request` raised
        (SamplingParamsError, ValueError) for any of its sequences (then none is added).
        """
        if self._dead is not None:
            raise EngineDeadError(f"engine is dead: {self._dead}")
        if self.draining:
            raise LoopClosedError("server is shutting down")
        if request_id in self._streams:
            raise ValueError(f"duplicate request id {request_id!r}")
        num_seqs = len(prompts) * params.n
        if self._num_admitted + num_seqs > self.capacity:
            self.metrics.num_rejected += 1
            raise QueueFullError(
                f"queue is full ({self._num_admitted} of {self.capacity} "
                f"sequences admitted); retry later"
            )
        self._num_admitted += num_seqs  # reserved now, before any await
        stream = RequestStream(request_id, [len(p) for p in prompts], params.n, self.abort)
        self._streams[request_id] = stream
        self._idle.clear()
        add = _PendingAdd(
            stream, prompts, params, priority, asyncio.get_running_loop().create_future()
        )
        self._pending_adds.append(add)
        self._wakeup.set()
        try:
            await add.done
        except asyncio.CancelledError:
            stream.close()
            raise
        return stream

    def abort(self, request_id: str) -> bool:
        """Abort a request by id; applied at the next step boundary. False if unknown."""
        if request_id not in self._streams:
            return False
        self._pending_aborts.append(request_id)
        self._wakeup.set()
        return True

    # ---- the loop -----------------------------------------------------------------------
    async def _run(self) -> None:
        aloop = asyncio.get_running_loop()
        while True:
            self._wakeup.clear()
            self._apply_pending()
            if self._stopping and not self._streams:
                return
            if not self.engine.has_unfinished_requests():
                await self._wakeup.wait()
                continue
            try:
                deltas, stats = await aloop.run_in_executor(self._executor, self._step_blocking)
            except Exception as exc:  # the engine is broken: fail everyone, stay up for /health
                logger.exception("engine step failed")
                self._die(exc)
                return
            self._stats = stats
            self._dispatch(deltas, time.monotonic())

    def _step_blocking(self) -> tuple[list[RequestDelta], EngineStats]:
        deltas = self.engine.step()
        return deltas, self.engine.stats()

    def _apply_pending(self) -> None:
        """Apply queued adds then aborts; runs only while no step is in flight."""
        adds, self._pending_adds = self._pending_adds, []
        aborts, self._pending_aborts = self._pending_aborts, []
        for add in adds:
            try:
                self._add(add)
            except Exception as exc:
                if not add.done.done():
                    add.done.set_exception(exc)
            else:
                if not add.done.done():
                    add.done.set_result(None)
        for request_id in aborts:
            self._abort_now(request_id)
        if adds or aborts:
            self._stats = self.engine.stats()

    def _add(self, add: _PendingAdd) -> None:
        stream, now = add.stream, time.monotonic()
        try:
            for j, prompt in enumerate(add.prompts):
                for i, child_params in enumerate(expand_n(add.params)):
                    index = j * add.params.n + i
                    child_id = f"{stream.request_id}-{index}"
                    self.engine.add_request(child_id, prompt, child_params, add.priority)
                    add.children.append(child_id)
                    self._children[child_id] = _Child(stream, index, now)
        except Exception:
            for child_id in add.children:
                self.engine.abort_request(child_id)
                del self._children[child_id]
            self._num_admitted -= stream.num_choices
            self._forget_stream(stream.request_id)
            raise

    def _abort_now(self, request_id: str) -> None:
        stream = self._streams.get(request_id)
        if stream is None:
            return
        for child_id, child in list(self._children.items()):
            if child.stream is stream:
                self.engine.abort_request(child_id)
                self._finish_child(
                    child_id,
                    RequestDelta(child_id, (), "", finish_reason="abort"),
                    time.monotonic(),
                )

    def _dispatch(self, deltas: list[RequestDelta], now: float) -> None:
        for delta in deltas:
            child = self._children.get(delta.request_id)
            if child is None:  # aborted by the loop already
                continue
            num_new = len(delta.new_token_ids)
            if num_new:
                if child.last_token_time is None:
                    self.metrics.ttft.observe(now - child.arrival)
                    gaps = num_new - 1
                    gap = 0.0
                else:
                    gaps = num_new
                    gap = (now - child.last_token_time) / num_new
                for _ in range(gaps):
                    self.metrics.itl.observe(gap)
                child.last_token_time = now
            if delta.finished:
                self._finish_child(delta.request_id, delta, now)
            else:
                child.stream.push(child.index, delta)

    def _finish_child(self, child_id: str, delta: RequestDelta, now: float) -> None:
        child = self._children.pop(child_id)
        self._num_admitted -= 1
        self.metrics.e2e.observe(now - child.arrival)
        self.metrics.finished.inc(delta.finish_reason or "abort")
        child.stream.push(child.index, delta)
        if child.stream.finished:
            self._forget_stream(child.stream.request_id)

    def _forget_stream(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        if not self._streams:
            self._idle.set()

    def _die(self, exc: BaseException) -> None:
        self._dead = exc
        error = EngineDeadError(f"engine failed: {type(exc).__name__}: {exc}")
        for add in self._pending_adds:
            if not add.done.done():
                add.done.set_exception(error)
        for stream in self._streams.values():
            stream.fail(error)
        self._pending_adds.clear()
        self._pending_aborts.clear()
        self._streams.clear()
        self._children.clear()
        self._num_admitted = 0
        self._idle.set()

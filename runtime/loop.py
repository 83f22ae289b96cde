"""The async engine loop: one engine thread owns the engine and feeds per-request streams.

`EngineLoop` is the only caller of the engine. The engine runs in one worker thread that steps
back to back while there is work, so the event loop stays responsive and the engine never
waits for the readers: `add_request`/`abort_request` are queued by the event loop and applied
by that thread between steps, never while a step is in flight. Each step's deltas reach the
event loop in one callback. The thread may run at most `max_steps_ahead` steps ahead of the
event loop's dispatch; when the event loop is the bottleneck (many streams), the steps it has
not caught up with coalesce in each `RequestStream` (runtime/stream.py), so one wakeup and
one write carry several tokens instead of one each. With many streams open, a stream's reader
is also woken at a paced rate (`WakePacer`), not every step, so the event loop's wake-ups and
writes per second stay bounded. This module owns admission, the engine thread, delta
dispatch, drain and shutdown. No HTTP here.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, replace
from typing import Any, Protocol

from tandem.runtime.metrics import ServingMetrics, render_metrics
from tandem.runtime.sampling_params import GrammarSpec, SamplingParams, expand_n
from tandem.runtime.stream import RequestStream, WakePacer
from tandem.runtime.types import EngineStats, RequestDelta

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
        *,
        group: str | None = None,
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
    """The engine raised inside `step()`; every stream fails and nothing more is admitted.
    Its message is generic: the engine's own exception goes to the log only."""


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
    error: BaseException | None = None  # set by the engine thread when add_request raised


def _child_ids(stream: RequestStream) -> list[str]:
    return [f"{stream.request_id}-{i}" for i in range(stream.num_choices)]


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
        max_steps_ahead: int = 4,
        pacer: WakePacer | None = None,
    ) -> None:
        if max_steps_ahead < 1:
            raise ValueError(f"max_steps_ahead must be >= 1, got {max_steps_ahead}")
        self.engine = engine
        self.capacity = max_queue + max_running
        self.metrics = metrics or ServingMetrics()
        # Event-loop side (touched only by the event loop's thread).
        self._streams: dict[str, RequestStream] = {}
        self._children: dict[str, _Child] = {}
        self._num_admitted = 0
        self._stats = EngineStats()
        self._dead: BaseException | None = None
        self._dead_event = asyncio.Event()  # set once the engine has failed
        self._draining = False
        self._stopping = False
        self._idle = asyncio.Event()
        self._idle.set()
        self._task: asyncio.Task[None] | None = None
        self._aloop: asyncio.AbstractEventLoop | None = None
        self._pacer = pacer or WakePacer()
        self._held: dict[RequestStream, None] = {}  # deltas pushed, reader not woken yet
        self._pace_timer: asyncio.TimerHandle | None = None
        # Handed to the engine thread under `_work`'s lock.
        self._work = threading.Condition()
        self._pending_adds: list[_PendingAdd] = []
        self._pending_aborts: list[tuple[str, list[str]]] = []  # (request id, its child ids)
        self._stop_thread = False
        # Steps the engine thread has run whose deltas the event loop has not dispatched yet.
        self._steps_ahead = threading.Semaphore(max_steps_ahead)

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
            self._aloop = asyncio.get_running_loop()
            self.metrics.host.loop_cpu_start = time.thread_time()
            if hasattr(self.engine, "on_fatal"):  # e.g. a tensor-parallel worker died
                self.engine.on_fatal = lambda reason: self._post(self._die, RuntimeError(reason))
            # /metrics before the first step: the engine's own counters (the KV pool, the CPU
            # expert pool's families), not an empty EngineStats(). No engine thread runs yet.
            self._stats = self.engine.stats()
            done: asyncio.Future[None] = self._aloop.create_future()
            # A daemon thread, not an executor: one left waiting for work never blocks exit.
            thread = threading.Thread(
                target=self._engine_thread, args=(done,), name="engine-step", daemon=True
            )
            thread.start()
            self._task = asyncio.create_task(self._watch(done), name="engine-loop")

    async def wait_dead(self) -> None:
        """Return once the engine has failed (the server should then exit non-zero)."""
        await self._dead_event.wait()

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
        """Abort everything, then end the engine thread once the engine has nothing left."""
        self._stopping = True
        for request_id in list(self._streams):
            self.abort(request_id)
        with self._work:
            self._stop_thread = True
            self._work.notify()
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)

    # ---- requests -----------------------------------------------------------------------
    async def compile_grammar(self, spec: GrammarSpec) -> None:
        """Compile a structured-output grammar in a worker thread (never on the event loop),
        so `add_request` finds it cached. Raises GrammarError (unsupported or invalid)."""
        from tandem.runtime.grammar import GrammarError

        def compile_() -> None:
            compiler = getattr(self.engine, "grammar_compiler", None)  # built on first use
            if compiler is None:
                raise GrammarError("this engine does not support structured outputs")
            compiler.compile(spec)

        await asyncio.get_running_loop().run_in_executor(None, compile_)

    async def submit(
        self, request_id: str, prompts: list[list[int]], params: SamplingParams, priority: int = 0
    ) -> RequestStream:
        """Admit a request of one or more prompts, each sampled `params.n` times.

        Raises QueueFullError, LoopClosedError, EngineDeadError, or what `add_request` raised
        (SamplingParamsError, ValueError) for any of its sequences (then none is added).
        """
        if self._dead is not None:
            raise EngineDeadError("the engine has failed")
        if self.draining:
            raise LoopClosedError("server is shutting down")
        if request_id in self._streams:
            raise ValueError(f"duplicate request id {request_id!r}")
        num_seqs = len(prompts) * params.n
        if num_seqs > self.capacity:  # never fits, however long the client retries
            raise ValueError(
                f"this request needs {num_seqs} sequences (prompts x n) but the server admits "
                f"at most {self.capacity} at once"
            )
        if self._num_admitted + num_seqs > self.capacity:
            self.metrics.num_rejected += 1
            raise QueueFullError(
                f"queue is full ({self._num_admitted} of {self.capacity} "
                f"sequences admitted); retry later"
            )
        self._num_admitted += num_seqs  # reserved now, before any await
        stream = RequestStream(request_id, [len(p) for p in prompts], params.n, self.abort)
        self._streams[request_id] = stream
        now = time.monotonic()
        for index, child_id in enumerate(_child_ids(stream)):
            self._children[child_id] = _Child(stream, index, now)
        self._idle.clear()
        assert self._aloop is not None, "submit() before start()"
        add = _PendingAdd(stream, prompts, params, priority, self._aloop.create_future())
        with self._work:
            self._pending_adds.append(add)
            self._work.notify()
        try:
            await add.done
        except asyncio.CancelledError:
            stream.close()
            raise
        return stream

    def abort(self, request_id: str) -> bool:
        """Abort a request by id; applied at the next step boundary. False if unknown."""
        stream = self._streams.get(request_id)
        if stream is None:
            return False
        with self._work:
            self._pending_aborts.append((request_id, _child_ids(stream)))
            self._work.notify()
        return True

    # ---- the engine thread --------------------------------------------------------------
    def _engine_thread(self, done: asyncio.Future[None]) -> None:
        """Apply queued adds and aborts, step while there is work, post results to the loop."""
        engine = self.engine
        host = self.metrics.host
        try:
            while True:
                busy = engine.has_unfinished_requests()
                with self._work:
                    while not (
                        busy or self._pending_adds or self._pending_aborts or self._stop_thread
                    ):
                        self._work.wait()
                    adds, self._pending_adds = self._pending_adds, []
                    aborts, self._pending_aborts = self._pending_aborts, []
                    stopping = self._stop_thread
                if adds or aborts:
                    self._apply_pending(adds, aborts)
                    self._post(self._on_applied, adds, aborts, engine.stats())
                if not engine.has_unfinished_requests():
                    if stopping:
                        return
                    continue
                t0 = time.perf_counter()
                self._steps_ahead.acquire()  # released once the loop has dispatched a step
                t1, cpu1 = time.perf_counter(), time.thread_time()
                deltas = engine.step()
                host.step_cpu_seconds += time.thread_time() - cpu1
                host.step_seconds += time.perf_counter() - t1
                host.ahead_wait_seconds += t1 - t0
                self._post(self._on_step, deltas, engine.stats())
        except Exception as exc:  # the engine is broken: fail everyone; the server exits
            logger.exception("engine step failed; the engine is dead")
            self._post(self._die, exc)
        finally:
            self._post(lambda: done.done() or done.set_result(None))

    def _post(self, callback: Any, *args: Any) -> None:
        assert self._aloop is not None
        try:
            self._aloop.call_soon_threadsafe(callback, *args)
        except RuntimeError:  # the event loop is closed: nobody is left to tell
            pass

    def _apply_pending(self, adds: list[_PendingAdd], aborts: list[tuple[str, list[str]]]) -> None:
        """Engine thread, between steps: add every child of each request (all or none), then
        abort."""
        if adds and hasattr(self.engine, "add_requests"):
            self._add_batched(adds)
            adds = []
        for add in adds:
            added: list[str] = []
            try:
                child_ids = iter(_child_ids(add.stream))
                for prompt in add.prompts:
                    for child_params in expand_n(add.params):
                        child_id = next(child_ids)
                        self.engine.add_request(
                            child_id,
                            prompt,
                            child_params,
                            add.priority,
                            group=add.stream.request_id,
                        )
                        added.append(child_id)
            except Exception as exc:
                for child_id in added:
                    self.engine.abort_request(child_id)
                add.error = exc
        for _, child_ids in aborts:
            for child_id in child_ids:
                self.engine.abort_request(child_id)

    def _add_batched(self, adds: list[_PendingAdd]) -> None:
        """`_apply_pending`'s adds through an engine's `add_requests` (one round trip to an
        engine process): a request any of whose sequences failed gets that error, and its
        other sequences are aborted."""
        items, owners = [], []
        for add in adds:
            child_ids = iter(_child_ids(add.stream))
            for prompt in add.prompts:
                for child_params in expand_n(add.params):
                    child_id = next(child_ids)
                    items.append(
                        (child_id, prompt, child_params, add.priority, add.stream.request_id)
                    )
                    owners.append(add)
        errors = self.engine.add_requests(items)
        for add, error in zip(owners, errors, strict=True):
            if error is not None and add.error is None:
                add.error = error
        for item, add in zip(items, owners, strict=True):
            if add.error is not None:
                self.engine.abort_request(item[0])

    async def _watch(self, done: asyncio.Future[None]) -> None:
        await done

    # ---- event-loop side of the engine thread's results ---------------------------------
    def _on_applied(
        self, adds: list[_PendingAdd], aborts: list[tuple[str, list[str]]], stats: EngineStats
    ) -> None:
        self._stats = stats
        for add in adds:
            if add.error is None:
                if not add.done.done():
                    add.done.set_result(None)
                continue
            stream = add.stream
            for child_id in _child_ids(stream):
                self._children.pop(child_id, None)
            self._num_admitted -= stream.num_choices
            self._forget_stream(stream.request_id)
            if not add.done.done():
                add.done.set_exception(add.error)
        now = time.monotonic()
        for _, child_ids in aborts:
            for child_id in child_ids:
                if child_id in self._children:
                    self._finish_child(
                        child_id, RequestDelta(child_id, (), "", finish_reason="abort"), now
                    )

    def _on_step(self, deltas: list[RequestDelta], stats: EngineStats) -> None:
        self._steps_ahead.release()
        if self._dead is not None:
            return
        self._stats = stats
        t0 = time.perf_counter()
        self._dispatch(deltas, time.monotonic())
        self.metrics.host.dispatch_seconds += time.perf_counter() - t0

    def _dispatch(self, deltas: list[RequestDelta], now: float) -> None:
        interval = self._pacer.interval(len(self._streams))
        for delta in deltas:
            child = self._children.get(delta.request_id)
            if child is None:  # aborted by the loop already
                continue
            first = child.last_token_time is None
            num_new = len(delta.new_token_ids)
            if num_new:
                if first:
                    self.metrics.ttft.observe(now - child.arrival)
                    if num_new > 1:
                        self.metrics.itl.observe(0.0, num_new - 1)
                else:
                    self.metrics.itl.observe((now - child.last_token_time) / num_new, num_new)
                child.last_token_time = now
            if delta.finished:
                self._finish_child(delta.request_id, delta, now)
                continue
            stream = child.stream
            if first or now - stream.woken_at >= interval:
                stream.push(child.index, delta)
                stream.woken_at = now
                self._held.pop(stream, None)
            else:
                stream.push(child.index, delta, wake=False)
                self._held[stream] = None
        if self._held:
            self._wake_due(now, interval)

    def _wake_due(self, now: float, interval: float) -> None:
        """Wake the held streams whose interval has passed; a timer catches the rest even if
        no step comes (a long prefill, a stalled engine)."""
        due = [s for s in self._held if now - s.woken_at >= interval]
        for stream in due:
            del self._held[stream]
            stream.woken_at = now
            stream.wake()
        if self._held and self._pace_timer is None and self._aloop is not None:
            self._pace_timer = self._aloop.call_later(max(interval, 1e-3), self._on_pace_timer)

    def _on_pace_timer(self) -> None:
        self._pace_timer = None
        if self._held:
            self._wake_due(time.monotonic(), self._pacer.interval(len(self._streams)))

    def _finish_child(self, child_id: str, delta: RequestDelta, now: float) -> None:
        child = self._children.pop(child_id)
        self._num_admitted -= 1
        self.metrics.e2e.observe(now - child.arrival)
        self.metrics.finished.inc(delta.finish_reason or "abort")
        child.stream.push(child.index, delta)
        if child.stream.finished:
            self._forget_stream(child.stream.request_id)

    def _forget_stream(self, request_id: str) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            self._held.pop(stream, None)
        if not self._streams:
            self._idle.set()

    def _die(self, exc: BaseException) -> None:
        self._dead = exc
        self._dead_event.set()
        error = EngineDeadError("the engine has failed; the server is restarting")
        with self._work:
            adds, self._pending_adds = self._pending_adds, []
            self._pending_aborts.clear()
            self._stop_thread = True
            self._work.notify()
        for add in adds:
            if not add.done.done():
                add.done.set_exception(error)
        for stream in self._streams.values():
            stream.fail(error)
        self._streams.clear()
        self._held.clear()
        self._children.clear()
        self._num_admitted = 0
        # nothing runs or waits any more: the gauges say so (the counters keep their totals)
        self._stats = replace(
            self._stats,
            num_running=0,
            num_waiting=0,
            kv_cache_usage=0.0,
            num_free_blocks=self._stats.num_blocks,
        )
        self._idle.set()

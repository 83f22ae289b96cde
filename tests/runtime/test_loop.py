"""EngineLoop: admission, coalescing, aborts, n>1 expansion, engine death, drain, metrics."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator

import pytest

from tandem.runtime.loop import (
    EngineDeadError,
    EngineLoop,
    LoopClosedError,
    QueueFullError,
)
from tandem.runtime.sampling_params import SamplingParams
from tandem.runtime.stream import RequestStream, WakePacer
from tandem.runtime.types import RequestDelta
from tests.app.fake_engine import REPLY, FakeEngine


@pytest.fixture
async def engine_and_loop() -> AsyncIterator[tuple[FakeEngine, EngineLoop]]:
    engine = FakeEngine(max_model_len=512)
    loop = EngineLoop(engine, max_queue=16)
    await loop.start()
    yield engine, loop
    await loop.stop()


async def collect(stream: RequestStream) -> dict[int, tuple[str, list[int], str | None]]:
    out: dict[int, tuple[str, list[int], str | None]] = {}
    async for batch in stream:
        for cd in batch:
            text, ids, _ = out.get(cd.index, ("", [], None))
            out[cd.index] = (
                text + cd.delta.new_text,
                ids + list(cd.delta.new_token_ids),
                cd.delta.finish_reason,
            )
    return out


async def test_single_request_streams_to_length(engine_and_loop) -> None:
    engine, loop = engine_and_loop
    stream = await loop.submit("r1", [[72, 105]], SamplingParams(max_tokens=5))
    out = await collect(stream)
    assert out == {0: (REPLY[:5], [ord(c) for c in REPLY[:5]], "length")}
    assert engine.added == ["r1-0"]
    assert loop.num_admitted == 0
    assert loop.stats.num_running == 0


async def test_n_and_prompt_list_expand_into_children(engine_and_loop) -> None:
    engine, loop = engine_and_loop
    stream = await loop.submit("r2", [[65], [66, 67]], SamplingParams(max_tokens=3, n=2, seed=4))
    out = await collect(stream)
    assert sorted(engine.added) == ["r2-0", "r2-1", "r2-2", "r2-3"]
    assert set(out) == {0, 1, 2, 3}
    assert out[0][0] == REPLY[4:7] and out[1][0] == REPLY[5:8]  # seed + i per choice
    assert all(f == "length" for _, _, f in out.values())


async def test_add_error_propagates_and_releases_slot(engine_and_loop) -> None:
    engine, loop = engine_and_loop
    with pytest.raises(ValueError, match="max_model_len"):
        await loop.submit("big", [[65] * 10, [65] * 500], SamplingParams(max_tokens=100))
    assert loop.num_admitted == 0
    assert engine.aborted == ["big-0"]  # the first child was added, then rolled back
    stream = await loop.submit("big", [[65]], SamplingParams(max_tokens=1))  # id free again
    assert (await collect(stream))[0][2] == "length"


async def test_burst_cannot_overshoot_queue() -> None:
    engine = FakeEngine()
    engine.gate = threading.Event()  # hold the first step so nothing finishes
    loop = EngineLoop(engine, max_queue=3)
    await loop.start()
    try:
        results = await asyncio.gather(
            *(loop.submit(f"b{i}", [[65]], SamplingParams(max_tokens=2)) for i in range(10)),
            return_exceptions=True,
        )
        ok = [r for r in results if isinstance(r, RequestStream)]
        full = [r for r in results if isinstance(r, QueueFullError)]
        assert len(ok) == 3 and len(full) == 7
        assert loop.metrics.num_rejected == 7
        with pytest.raises(QueueFullError):  # n counts: 2 more sequences do not fit either
            await loop.submit("x", [[65]], SamplingParams(max_tokens=2, n=2))
        engine.gate.set()
        for s in ok:
            await collect(s)
        assert loop.num_admitted == 0
    finally:
        engine.gate.set()
        await loop.stop()


async def test_slow_reader_coalesces_and_does_not_stall_others() -> None:
    # One step ahead at most: the engine thread waits for each dispatch, as a real engine
    # whose step outlasts the event loop's work would; a free-running fake would coalesce.
    engine = FakeEngine(max_model_len=512)
    loop = EngineLoop(engine, max_queue=16, max_steps_ahead=1)
    await loop.start()
    try:
        slow = await loop.submit("slow", [[65]], SamplingParams(max_tokens=200))
        fast = await loop.submit("fast", [[65]], SamplingParams(max_tokens=100))
        fast_batches = 0
        async for _ in fast:
            fast_batches += 1
            assert slow.num_pending <= 1  # one coalesced delta per choice, however far behind
        assert fast_batches >= 50  # the fast reader saw (nearly) every step separately
        out = await collect(slow)
        assert out[0][0] == (REPLY * 10)[:200] and out[0][2] == "length"
    finally:
        await loop.stop()


async def test_busy_event_loop_bounds_the_engine_and_gets_steps_coalesced() -> None:
    engine = FakeEngine()
    loop = EngineLoop(engine, max_queue=4, max_steps_ahead=3)
    await loop.start()
    try:
        stream = await loop.submit("busy", [[65]], SamplingParams(max_tokens=50))
        # The event loop is busy (as when writing to many clients) and dispatches nothing:
        # the engine thread runs exactly max_steps_ahead steps past the last dispatched one.
        time.sleep(0.2)
        assert engine.num_steps - loop.stats.num_steps == 3
        sizes = [sum(len(cd.delta.new_token_ids) for cd in batch) async for batch in stream]
        assert sum(sizes) == 50
        assert max(sizes) > 1  # the steps it was behind reached the reader as one delta
    finally:
        await loop.stop()


async def test_reader_close_aborts_and_frees(engine_and_loop) -> None:
    engine, loop = engine_and_loop
    stream = await loop.submit("gone", [[65]], SamplingParams(max_tokens=400))
    await stream.__anext__()
    stream.close()
    await asyncio.wait_for(loop._idle.wait(), 5)
    assert engine.aborted == ["gone-0"]
    assert loop.num_admitted == 0 and not engine.has_unfinished_requests()
    assert loop.stats.num_running == 0
    rest = await collect(stream)
    assert rest[0][2] == "abort"


async def test_abort_by_id_finishes_with_abort(engine_and_loop) -> None:
    engine, loop = engine_and_loop
    stream = await loop.submit("ab", [[65]], SamplingParams(max_tokens=400, n=2))
    assert loop.abort("ab") and not loop.abort("nope")
    out = await collect(stream)
    assert {f for _, _, f in out.values()} == {"abort"}
    assert sorted(engine.aborted) == ["ab-0", "ab-1"]


async def test_engine_death_fails_streams_and_admission(engine_and_loop) -> None:
    engine, loop = engine_and_loop
    engine.step_delay = 0.001
    stream = await loop.submit("d", [[65]], SamplingParams(max_tokens=400))
    engine.fail_next_step = RuntimeError("CUDA exploded")
    with pytest.raises(EngineDeadError, match="engine has failed") as failed:
        await collect(stream)
    assert "CUDA exploded" not in str(failed.value)  # the details go to the log only
    assert loop.dead and not loop.healthy
    await asyncio.wait_for(loop.wait_dead(), 1)
    # the gauges no longer count what was running or waiting
    assert loop.stats.num_running == 0 and loop.stats.num_waiting == 0
    assert loop.num_admitted == 0 and loop.stats.kv_cache_usage == 0.0
    with pytest.raises(EngineDeadError):
        await loop.submit("d2", [[65]], SamplingParams())


async def test_drain_waits_then_aborts_the_rest(engine_and_loop) -> None:
    engine, loop = engine_and_loop
    short = await loop.submit("short", [[65]], SamplingParams(max_tokens=2))
    long = await loop.submit("long", [[65]], SamplingParams(max_tokens=400))
    engine.step_delay = 0.01
    aborted = await loop.drain(timeout=0.2)
    assert aborted == 1
    assert (await collect(short))[0][2] == "length"
    assert (await collect(long))[0][2] == "abort"
    with pytest.raises(LoopClosedError):
        await loop.submit("late", [[65]], SamplingParams())
    assert not loop.healthy


async def test_metrics_record_latencies(engine_and_loop) -> None:
    engine, loop = engine_and_loop
    await collect(await loop.submit("m", [[65]], SamplingParams(max_tokens=4)))
    assert loop.metrics.ttft.count == 1
    assert loop.metrics.itl.count == 3
    assert loop.metrics.e2e.count == 1
    text = loop.render_metrics()
    assert "tandem:e2e_request_latency_seconds_count 1" in text
    assert 'tandem:request_success_total{finished_reason="length"} 1' in text
    assert "tandem:generation_tokens_total 4" in text
    host = loop.metrics.host
    assert host.step_seconds > 0 and host.step_cpu_seconds > 0 and host.dispatch_seconds > 0
    counters = dict(
        line.rsplit(" ", 1) for line in text.splitlines() if line.startswith("tandem:loop_cpu")
    )
    assert float(counters["tandem:loop_cpu_seconds_total"]) > 0
    assert "tandem:engine_ahead_wait_seconds_total" in text


async def test_request_stream_coalesces_per_choice_and_fails_after_pending() -> None:
    aborted: list[str] = []
    stream = RequestStream("s", [3], 2, aborted.append)
    stream.push(0, RequestDelta("s-0", (1,), "a", num_output_tokens=1))
    stream.push(0, RequestDelta("s-0", (2,), "b", num_output_tokens=2))
    stream.push(
        1, RequestDelta("s-1", (3,), "c", finish_reason="stop", stop_reason=3, num_output_tokens=1)
    )
    assert stream.num_pending == 2 and not stream.finished
    batch = await stream.__anext__()
    assert [(cd.index, cd.delta.new_token_ids, cd.delta.new_text) for cd in batch] == [
        (0, (1, 2), "ab"),
        (1, (3,), "c"),
    ]
    assert batch[0].delta.num_output_tokens == 2 and batch[1].delta.finish_reason == "stop"
    stream.close()  # choice 0 is unfinished: the reader leaving aborts the request
    assert aborted == ["s"]
    stream.push(0, RequestDelta("s-0", (4,), "d"))
    stream.fail(EngineDeadError("boom"))
    assert [cd.delta.new_text for cd in await stream.__anext__()] == ["d"]  # pending first
    with pytest.raises(EngineDeadError, match="boom"):
        await stream.__anext__()


async def test_request_stream_ends_after_every_choice_finished() -> None:
    aborted: list[str] = []
    stream = RequestStream("t", [1], 1, aborted.append)
    stream.push(0, RequestDelta("t-0", (5,), "x", finish_reason="length"))
    assert stream.finished
    assert [cd.delta.finish_reason for cd in await stream.__anext__()] == ["length"]
    with pytest.raises(StopAsyncIteration):
        await stream.__anext__()
    stream.close()
    assert aborted == []  # nothing left to abort


async def test_metrics_before_the_first_step_are_the_engines() -> None:
    """A scrape before any request sees the engine's families (the CPU expert pool's), not an
    empty EngineStats(): before, the hybrid families were missing until the first step."""
    from tandem.models.layers.cpu_pool_stats import HybridMoeStats
    from tandem.runtime.types import EngineStats

    class HybridFake(FakeEngine):
        def stats(self) -> EngineStats:
            hybrid = HybridMoeStats(pool_threads=3, routing_counts={0: [0, 0]})
            return EngineStats(num_blocks=self.num_blocks, hybrid=hybrid)

    loop = EngineLoop(HybridFake(), max_queue=4)
    await loop.start()
    try:
        text = loop.render_metrics()
        assert "tandem:moe_pool_threads 3" in text
        assert 'tandem:moe_expert_routed_total{expert="1",layer="0"} 0' in text
    finally:
        await loop.stop()


class _SteppedEngine(FakeEngine):
    """A fake engine that runs one step per permit the test releases."""

    def __init__(self) -> None:
        super().__init__(max_model_len=512)
        self.permits = threading.Semaphore(0)

    def step(self) -> list[RequestDelta]:
        self.permits.acquire()
        return super().step()


def test_wake_pacer_interval() -> None:
    pacer = WakePacer(max_wakes_per_s=1000.0, free_streams=4)
    assert pacer.interval(1) == pacer.interval(4) == 0.0
    assert pacer.interval(5) == pytest.approx(0.005)
    assert pacer.interval(256) == pytest.approx(0.256)
    with pytest.raises(ValueError):
        WakePacer(max_wakes_per_s=0)


async def test_paced_readers_get_the_first_token_at_once_then_coalesced_text() -> None:
    engine = FakeEngine(max_model_len=512)
    # interval 300 s: between the first token and the finish no reader is woken
    loop = EngineLoop(engine, max_queue=8, pacer=WakePacer(max_wakes_per_s=0.01, free_streams=0))
    await loop.start()
    try:
        streams = [
            await loop.submit(f"p{i}", [[65]], SamplingParams(max_tokens=30)) for i in range(3)
        ]
        for stream in streams:
            sizes, text = [], ""
            async for batch in stream:
                sizes.append(sum(len(cd.delta.new_token_ids) for cd in batch))
                text += "".join(cd.delta.new_text for cd in batch)
            assert text == REPLY[:30]
            assert sum(sizes) == 30 and len(sizes) <= 2  # first token(s), then the rest at the end
    finally:
        await loop.stop()


async def test_a_held_delta_reaches_its_reader_without_another_step() -> None:
    engine = _SteppedEngine()
    interval = 0.2
    loop = EngineLoop(
        engine, max_queue=4, pacer=WakePacer(max_wakes_per_s=1 / interval, free_streams=0)
    )
    await loop.start()
    try:
        stream = await loop.submit("h", [[65]], SamplingParams(max_tokens=3))
        reader = stream.__aiter__()
        engine.permits.release()
        first = await asyncio.wait_for(reader.__anext__(), 5)  # the first token: at once
        assert [cd.delta.new_text for cd in first] == [REPLY[0]]
        t0 = time.monotonic()
        engine.permits.release()  # the second token is held: its stream was just woken
        second = await asyncio.wait_for(reader.__anext__(), 5)  # no step comes: the timer
        assert [cd.delta.new_text for cd in second] == [REPLY[1]]
        assert time.monotonic() - t0 >= interval * 0.5
        engine.permits.release()
        last = await asyncio.wait_for(reader.__anext__(), 5)  # the finish: at once
        assert last[0].delta.finish_reason == "length" and last[0].delta.new_text == REPLY[2]
    finally:
        engine.permits.release(8)
        await loop.stop()


def test_pacing_off_wakes_every_step() -> None:
    """`--stream-wakeups 0` (max_wakes_per_s None): no interval at any concurrency."""
    pacer = WakePacer(max_wakes_per_s=None, free_streams=0)
    assert pacer.interval(1) == pacer.interval(10_000) == 0.0

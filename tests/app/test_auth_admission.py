"""Auth (bearer keys, public ops endpoints), queue-full 429 under a burst, draining 503, cancel."""

from __future__ import annotations

import asyncio
import threading

import aiohttp
import pytest

from tandem.app.auth import key_matches
from tests.app.conftest import MakeHarness
from tests.app.fake_engine import FakeEngine

BODY = {"prompt": "a", "max_tokens": 2}


async def test_auth_required_except_health_and_metrics(make_harness: MakeHarness) -> None:
    h = await make_harness(api_keys=("key-one", "key-two"))
    c = h.client
    for headers in (
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": "key-one"},
        {"Authorization": "Basic key-one"},
    ):
        resp = await c.post("/v1/completions", json=BODY, headers=headers)
        assert resp.status == 401
        err = (await resp.json())["error"]
        assert err["code"] == "invalid_api_key" and set(err) == {"message", "type", "param", "code"}
    for key in ("key-one", "key-two"):
        resp = await c.post(
            "/v1/completions", json=BODY, headers={"Authorization": f"Bearer {key}"}
        )
        assert resp.status == 200
    assert (await c.get("/v1/models")).status == 401
    assert (await c.get("/openapi.json")).status == 401
    assert (await c.get("/health")).status == 200
    assert (await c.get("/metrics")).status == 200
    with pytest.raises(aiohttp.WSServerHandshakeError) as info:
        await c.ws_connect("/v1/ws")
    assert info.value.status == 401
    ws = await c.ws_connect("/v1/ws", headers={"Authorization": "Bearer key-two"})
    await ws.close()


def test_key_matches_checks_every_key() -> None:
    keys = [b"alpha", b"beta"]
    assert key_matches("beta", keys) and key_matches("alpha", keys)
    assert not key_matches("gamma", keys) and not key_matches("", keys)
    assert not key_matches("bet", keys) and not key_matches("\udcff", keys)


async def test_a_request_larger_than_the_capacity_is_a_400_not_a_429(
    make_harness: MakeHarness,
) -> None:
    h = await make_harness(FakeEngine(max_num_seqs=2), max_queue=1)  # capacity 3 sequences
    resp = await h.client.post("/v1/completions", json={**BODY, "n": 4})
    assert resp.status == 400  # before: 429 "retry later" on an idle server, forever
    assert "at most 3" in (await resp.json())["error"]["message"]
    assert (await h.client.post("/v1/completions", json={**BODY, "n": 3})).status == 200
    assert h.loop.metrics.num_rejected == 0


async def test_queue_full_429_under_burst(make_harness: MakeHarness) -> None:
    engine = FakeEngine(max_num_seqs=2)
    engine.gate = threading.Event()  # nothing finishes until the burst is judged
    h = await make_harness(engine, max_queue=2)  # capacity: 2 running + 2 waiting
    try:
        tasks = [
            asyncio.create_task(h.client.post("/v1/completions", json=BODY)) for _ in range(10)
        ]
        done: set[asyncio.Task] = set()
        while len(done) < 6:
            finished, _ = await asyncio.wait(
                set(tasks) - done, timeout=5, return_when=asyncio.FIRST_COMPLETED
            )
            assert finished, "expected six quick rejections"
            done |= finished
        rejected = [t.result() for t in done]
        assert [r.status for r in rejected] == [429] * 6
        err = (await rejected[0].json())["error"]
        assert err["type"] == "rate_limit_error" and err["code"] == "queue_full"
        assert all(r.headers["Retry-After"] == "1" for r in rejected)  # before: none
        assert h.loop.num_admitted == 4
        engine.gate.set()
        accepted = await asyncio.gather(*(set(tasks) - done))
        assert [r.status for r in accepted] == [200] * 4
        assert (
            'tandem:request_rejected_total{model_name="fake-model"} 6'
            in await (await h.client.get("/metrics")).text()
        )
    finally:
        engine.gate.set()


async def test_draining_answers_503_and_lets_running_finish(make_harness: MakeHarness) -> None:
    h = await make_harness(FakeEngine(step_delay=0.002))
    running = await h.client.post(
        "/v1/completions", json={"prompt": "a", "max_tokens": 50, "stream": True}
    )
    await running.content.readuntil(b"\n\n")
    h.loop.begin_drain()
    health = await h.client.get("/health")
    assert health.status == 503 and (await health.json()) == {"status": "draining"}
    refused = await h.client.post("/v1/completions", json=BODY)
    assert refused.status == 503
    assert (await refused.json())["error"]["code"] == "server_draining"
    rest = await running.read()
    assert b'"finish_reason":"length"' in rest and rest.endswith(b"data: [DONE]\n\n")
    assert await h.loop.drain(timeout=1.0) == 0


async def test_cancel_endpoint_aborts_by_completion_id(make_harness: MakeHarness) -> None:
    h = await make_harness(FakeEngine(step_delay=0.002))
    resp = await h.client.post(
        "/v1/completions", json={"prompt": "a", "max_tokens": 200, "stream": True, "n": 2}
    )
    first = await resp.content.readuntil(b"\n\n")
    completion_id = first.split(b'"id":"')[1].split(b'"')[0].decode()
    cancel = await h.client.post(f"/v1/requests/{completion_id}/cancel")
    assert cancel.status == 200 and (await cancel.json())["cancelled"] is True
    rest = await resp.read()
    assert rest.count(b'"finish_reason":"abort"') == 2
    assert sorted(h.engine.aborted) == [f"{completion_id}-0", f"{completion_id}-1"]

"""WebSocket /v1/ws: concurrent requests on one socket, cancel, errors, close aborts."""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import ClientWebSocketResponse

from tests.app.conftest import MakeHarness
from tests.app.fake_engine import REPLY, FakeEngine


async def receive_until_done(
    ws: ClientWebSocketResponse, ids: set[str]
) -> dict[str, list[dict[str, Any]]]:
    """Collect messages per id until each id got a 'done' or an 'error'."""
    got: dict[str, list[dict[str, Any]]] = {i: [] for i in ids}
    open_ids = set(ids)
    while open_ids:
        msg = await asyncio.wait_for(ws.receive_json(), 5)
        got[msg["id"]].append(msg)
        if msg["type"] in ("done", "error"):
            open_ids.discard(msg["id"])
    return got


async def test_two_requests_one_cancelled(make_harness: MakeHarness) -> None:
    h = await make_harness(FakeEngine(step_delay=0.002))
    async with h.client.ws_connect("/v1/ws") as ws:
        await ws.send_json(
            {"type": "completions", "id": "long", "body": {"prompt": "a", "max_tokens": 200}}
        )
        await ws.send_json(
            {
                "type": "chat.completions",
                "id": "short",
                "body": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 30},
            }
        )
        got: dict[str, list[dict[str, Any]]] = {"long": [], "short": []}
        while not got["long"]:  # wait for the long request's first delta, then cancel it
            msg = await asyncio.wait_for(ws.receive_json(), 5)
            got[msg["id"]].append(msg)
        await ws.send_json({"type": "cancel", "id": "long"})
        rest = await receive_until_done(
            ws,
            {"long", "short"}
            - {i for i, msgs in got.items() if msgs and msgs[-1]["type"] == "done"},
        )
        for i, msgs in rest.items():
            got[i] += msgs

    long, short = got["long"], got["short"]
    assert long[-1]["type"] == "done" and short[-1]["type"] == "done"
    assert long[-2]["chunk"]["choices"][0]["finish_reason"] == "abort"
    assert long[-1]["usage"]["completion_tokens"] < 200
    chunks = [m["chunk"] for m in short if m["type"] == "delta"]
    assert chunks[0]["object"] == "chat.completion.chunk"
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == REPLY[:30]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert short[-1]["usage"]["completion_tokens"] == 30
    assert len(h.engine.aborted) == 1


async def test_cancel_sent_right_after_the_request_aborts_it(make_harness: MakeHarness) -> None:
    # The cancel arrives while the request is still being admitted: it must not be lost.
    h = await make_harness(FakeEngine(step_delay=0.002))
    async with h.client.ws_connect("/v1/ws") as ws:
        await ws.send_json(
            {"type": "completions", "id": "x", "body": {"prompt": "a", "max_tokens": 200}}
        )
        await ws.send_json({"type": "cancel", "id": "x"})
        got = (await receive_until_done(ws, {"x"}))["x"]
    assert got[-1]["type"] == "done", got[-1]
    assert got[-2]["chunk"]["choices"][0]["finish_reason"] == "abort"
    assert got[-1]["usage"]["completion_tokens"] < 200
    assert len(h.engine.aborted) == 1


async def test_protocol_errors(make_harness: MakeHarness) -> None:
    h = await make_harness()
    async with h.client.ws_connect("/v1/ws") as ws:
        await ws.send_str("{not json")
        msg = await ws.receive_json()
        assert msg["type"] == "error" and msg["id"] is None
        assert set(msg["error"]) == {"message", "type", "param", "code"}
        await ws.send_json({"type": "frobnicate", "id": "x"})
        msg = await ws.receive_json()
        assert msg["type"] == "error" and msg["error"]["param"] == "type"
        await ws.send_json({"type": "cancel", "id": "nope"})
        assert (await ws.receive_json())["error"]["code"] == "not_found"
        await ws.send_json(
            {"type": "completions", "id": "bad", "body": {"prompt": "a", "temperature": -3}}
        )
        msg = await ws.receive_json()
        assert msg == {
            "type": "error",
            "id": "bad",
            "error": {
                "message": msg["error"]["message"],
                "type": "invalid_request_error",
                "param": "temperature",
                "code": "invalid_value",
            },
        }
        # The socket still works after errors.
        await ws.send_json(
            {"type": "completions", "id": "ok", "body": {"prompt": "a", "max_tokens": 2}}
        )
        got = await receive_until_done(ws, {"ok"})
        assert got["ok"][-1] == {
            "type": "done",
            "id": "ok",
            "usage": {
                "prompt_tokens": 1,
                "completion_tokens": 2,
                "total_tokens": 3,
                "prompt_tokens_details": {"cached_tokens": 0},
            },
        }


async def test_closing_socket_aborts_its_requests(make_harness: MakeHarness) -> None:
    h = await make_harness(FakeEngine(step_delay=0.002))
    ws = await h.client.ws_connect("/v1/ws")
    for i in range(2):
        await ws.send_json(
            {"type": "completions", "id": f"r{i}", "body": {"prompt": "a", "max_tokens": 250}}
        )
    seen: set[str] = set()
    while len(seen) < 2:
        msg = await ws.receive_json()
        assert msg["type"] == "delta"
        seen.add(msg["id"])
    await ws.close()
    await asyncio.wait_for(h.loop._idle.wait(), 1.0)
    assert len(h.engine.aborted) == 2
    assert h.loop.num_admitted == 0 and not h.engine.has_unfinished_requests()

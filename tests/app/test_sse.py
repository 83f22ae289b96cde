"""SSE framing, usage chunk, in-band errors, disconnect aborts, slow readers coalesce."""

from __future__ import annotations

import asyncio
import logging
import re
import socket
from collections.abc import Callable
from typing import Any

import orjson
from aiohttp import web

from tests.app.conftest import Harness, MakeHarness
from tests.app.fake_engine import REPLY, FakeEngine

MSG = [{"role": "user", "content": "hi"}]


async def wait_until(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    """Poll a condition the server reaches asynchronously (bounded, not a fixed sleep)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.001)


def parse_sse(raw: bytes) -> list[Any]:
    assert raw.endswith(b"data: [DONE]\n\n"), raw[-200:]
    frames = raw.split(b"\n\n")
    assert frames[-1] == b""
    out: list[Any] = []
    for frame in frames[:-1]:
        assert frame.startswith(b"data: "), frame
        payload = frame[len(b"data: ") :]
        out.append("[DONE]" if payload == b"[DONE]" else orjson.loads(payload))
    assert out.count("[DONE]") == 1
    return out[:-1]


async def test_chat_stream_framing_matches_non_stream(harness: Harness) -> None:
    body = {"messages": MSG, "max_tokens": 6, "stream": True}
    resp = await harness.client.post("/v1/chat/completions", json=body)
    assert resp.status == 200
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    assert resp.headers["X-Accel-Buffering"] == "no"
    chunks = parse_sse(await resp.read())
    assert all(c["object"] == "chat.completion.chunk" and "usage" not in c for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"][0] == {
        "index": 0,
        "delta": {},
        "logprobs": None,
        "finish_reason": "length",
    }
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    body["stream"] = False
    full = await (await harness.client.post("/v1/chat/completions", json=body)).json()
    assert text == full["choices"][0]["message"]["content"] == REPLY[:6]


async def test_completion_stream_with_usage_chunk(harness: Harness) -> None:
    body = {
        "prompt": ["ab", "c"],
        "max_tokens": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
        "logprobs": 0,
    }
    chunks = parse_sse(await (await harness.client.post("/v1/completions", json=body)).read())
    *deltas, usage = chunks
    assert usage["choices"] == [] and usage["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 6,
        "total_tokens": 9,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert all(c["usage"] is None and c["object"] == "text_completion" for c in deltas)
    for index in (0, 1):
        mine = [c["choices"][0] for c in deltas if c["choices"][0]["index"] == index]
        assert "".join(c["text"] for c in mine) == REPLY[:3]
        assert mine[-1]["finish_reason"] == "length"
        offsets = [o for c in mine for o in c["logprobs"]["text_offset"]]
        assert offsets == [0, 1, 2]


async def test_error_after_headers_is_an_sse_frame(make_harness: MakeHarness) -> None:
    h = await make_harness(FakeEngine(step_delay=0.002))
    resp = await h.client.post(
        "/v1/completions", json={"prompt": "a", "max_tokens": 200, "stream": True}
    )
    first = await resp.content.readuntil(b"\n\n")
    assert first.startswith(b"data: {")
    h.engine.fail_next_step = RuntimeError("device lost")
    rest = parse_sse(first + await resp.read())
    err = rest[-1]
    assert set(err) == {"error"} and "engine has failed" in err["error"]["message"]
    assert "device lost" not in err["error"]["message"]  # the details go to the log only
    assert err["error"]["type"] == "service_unavailable_error"
    health = await h.client.get("/health")
    assert health.status == 503 and (await health.json())["status"] == "dead"
    resp = await h.client.post("/v1/completions", json={"prompt": "a"})
    assert resp.status == 503


async def test_disconnect_mid_stream_aborts_and_frees(make_harness: MakeHarness) -> None:
    h = await make_harness(FakeEngine(step_delay=0.002))
    resp = await h.client.post(
        "/v1/chat/completions", json={"messages": MSG, "max_tokens": 200, "stream": True}
    )
    await resp.content.readuntil(b"\n\n")
    [request_id] = h.loop.request_ids()
    resp.close()  # drop the connection
    await asyncio.wait_for(h.loop._idle.wait(), 1.0)
    assert h.engine.aborted == [f"{request_id}-0"]
    metrics = await (await h.client.get("/metrics")).text()
    assert 'tandem:num_requests_running{model_name="fake-model"} 0\n' in metrics
    assert 'tandem:kv_cache_usage_perc{model_name="fake-model"} 0\n' in metrics
    assert (
        'tandem:request_success_total{model_name="fake-model",finished_reason="abort"} 1' in metrics
    )


async def _raw_stream_request(
    host: str, port: int, body: dict[str, Any]
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """An HTTP client with tiny receive buffers that reads nothing until told to."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (host, port))
    reader, writer = await asyncio.open_connection(sock=sock, limit=1024)
    payload = orjson.dumps(body)
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
        b"X-Slow: 1\r\nConnection: close\r\nContent-Length: %d\r\n\r\n" % len(payload) + payload
    )
    await writer.drain()
    return reader, writer


async def test_slow_reader_coalesces_without_slowing_others(make_harness: MakeHarness) -> None:
    async def shrink_send_buffer(request: web.Request, _: web.StreamResponse) -> None:
        # A slow network: with a small kernel send buffer the server's writes block early.
        if request.headers.get("X-Slow") and request.transport is not None:
            sock = request.transport.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)

    h = await make_harness(
        FakeEngine(max_model_len=4096, step_delay=0.0005),
        setup=lambda app: app.on_response_prepare.append(shrink_send_buffer),
    )
    server = h.client.server
    num_tokens = 1000
    # Top-20 logprobs make each frame ~2 KB, so the slow socket's buffers fill quickly.
    slow_body = {"prompt": "a", "max_tokens": num_tokens, "stream": True, "logprobs": 20}
    reader, writer = await _raw_stream_request(server.host, server.port, slow_body)
    await wait_until(lambda: bool(h.loop.request_ids()))
    fast = await h.client.post(
        "/v1/completions", json={"prompt": "b", "max_tokens": num_tokens, "stream": True}
    )
    fast_chunks = parse_sse(await fast.read())
    # The fast reader got its whole stream while the slow reader had read nothing.
    assert "".join(c["choices"][0]["text"] for c in fast_chunks) == (REPLY * 40)[:num_tokens]
    assert fast_chunks[-1]["choices"][0]["finish_reason"] == "length"
    # The engine finished the slow request too, although its reader has read nothing yet.
    assert not h.engine.has_unfinished_requests()
    raw = await reader.read()
    writer.close()
    frames = re.findall(rb"data: (.*?)\n\n", raw)
    assert frames[-1] == b"[DONE]"
    chunks = [orjson.loads(f) for f in frames[:-1]]
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert text == (REPLY * 40)[:num_tokens]
    tokens = sum(len(c["choices"][0]["logprobs"]["tokens"]) for c in chunks)
    assert tokens == num_tokens
    assert len(chunks) < num_tokens // 2  # deltas were coalesced while the reader slept


async def test_a_disconnect_abort_is_logged_at_info(make_harness: MakeHarness, caplog) -> None:
    caplog.set_level(logging.INFO, logger="tandem.app")
    h = await make_harness(FakeEngine(step_delay=0.002))
    resp = await h.client.post(
        "/v1/completions", json={"prompt": "a", "max_tokens": 200, "stream": True}
    )
    await resp.content.readuntil(b"\n\n")
    [request_id] = h.loop.request_ids()
    resp.close()
    await asyncio.wait_for(h.loop._idle.wait(), 1.0)
    # before: nothing was logged, even with -v
    assert any(request_id in r.getMessage() and "abort" in r.getMessage() for r in caplog.records)

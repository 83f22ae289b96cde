"""Connection-level guards of a real listening server (app/http_guard.py): idle, half-open and
slow connections time out, malformed HTTP is an OpenAI-shaped 400 without a traceback, and a
compression bomb or a huge stop_token_ids list does not stall another client's stream."""

from __future__ import annotations

import asyncio
import logging
import time
import zlib
from collections.abc import AsyncIterator

import aiohttp
import orjson
import pytest

from tandem.app.config import ServerConfig
from tandem.app.serve import RunningServer, start_server
from tests.app.fake_engine import FakeEngine
from tests.app.stall import largest_gap_during
from tests.app.tiny_engine import TinyTokenizer, make_tiny_engine

TIMEOUT_S = 0.5


@pytest.fixture
async def fake_server() -> AsyncIterator[RunningServer]:
    config = ServerConfig(port=0, idle_timeout_s=TIMEOUT_S, body_timeout_s=TIMEOUT_S)
    running = await start_server(config, FakeEngine())
    yield running
    await running.shutdown(timeout=2)


async def exchange(port: int, data: bytes, wait_s: float = 5.0) -> tuple[bytes, float]:
    """Send `data` on a fresh connection, read until the server closes it -> (all it sent,
    seconds until the close)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    t0 = time.perf_counter()
    got = await asyncio.wait_for(reader.read(), wait_s)  # until EOF: fails if never closed
    writer.close()
    return got, time.perf_counter() - t0


@pytest.mark.parametrize(
    "data",
    [
        b"",  # connected, nothing sent
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n",  # half the headers
        b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n",  # a request, then idle keep-alive
    ],
)
async def test_idle_and_half_open_connections_are_closed(fake_server, data) -> None:
    # before: all stayed open (150 of 150 after 150 s)
    _, seconds = await exchange(fake_server.port, data)
    assert seconds < 4 * TIMEOUT_S + 1


async def test_a_body_that_never_arrives_is_a_408(fake_server) -> None:
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"
    got, _ = await exchange(fake_server.port, head)
    assert got.startswith(b"HTTP/1.1 408")
    assert orjson.loads(got.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"


async def test_malformed_http_is_an_openai_error_without_a_traceback(fake_server, caplog) -> None:
    caplog.set_level(logging.INFO)
    for garbage in (b"GARBAGE\r\n\r\n", b"GET / HTTP/1.1\r\nBad Header\r\n\r\n"):
        got, _ = await exchange(fake_server.port, garbage)
        head, body = got.split(b"\r\n\r\n", 1)
        assert head.startswith(b"HTTP/1.") and b" 400 " in head.split(b"\r\n")[0]
        assert b"application/json" in head  # before: aiohttp's text/plain
        err = orjson.loads(body)["error"]
        assert err["type"] == "invalid_request_error" and err["message"]
    # before: an ERROR traceback per malformed request
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    async with aiohttp.ClientSession() as http:
        async with http.get(f"http://127.0.0.1:{fake_server.port}/health") as resp:
            assert resp.status == 200


@pytest.fixture(scope="module")
def tokenizer() -> TinyTokenizer:
    return TinyTokenizer()


@pytest.fixture
async def tiny_server(tokenizer: TinyTokenizer) -> AsyncIterator[RunningServer]:
    engine = make_tiny_engine(tokenizer, max_num_seqs=16)
    running = await start_server(ServerConfig(port=0), engine)
    yield running
    await running.shutdown(timeout=2)


def gzip_bomb(megabytes: int) -> bytes:
    """A gzip body inflating to `megabytes` MiB of zeros, built in milliseconds: after a full
    flush every MiB compresses to the same bytes (its trailer's checksum is wrong, which only
    the last byte of a full inflate would notice)."""
    z = zlib.compressobj(9, zlib.DEFLATED, 31)
    zeros = b"\0" * (1 << 20)
    first = z.compress(zeros) + z.flush(zlib.Z_FULL_FLUSH)
    block = z.compress(zeros) + z.flush(zlib.Z_FULL_FLUSH)
    return first + block * (megabytes - 2) + z.flush()


async def test_a_compression_bomb_does_not_stall_other_streams(tiny_server) -> None:
    base = f"http://127.0.0.1:{tiny_server.port}"
    bomb = gzip_bomb(1024)  # 1 MB inflating to 1 GiB

    async def attack() -> None:
        async def one() -> None:
            async with aiohttp.ClientSession() as http:
                headers = {"Content-Encoding": "gzip", "Content-Type": "application/json"}
                async with http.post(f"{base}/v1/completions", data=bomb, headers=headers) as r:
                    assert r.status == 415
                    err = (await r.json())["error"]
                    assert err["code"] == "unsupported_content_encoding"

        await asyncio.gather(*(one() for _ in range(4)))

    async with aiohttp.ClientSession() as http:
        # before: a 413 once 8 MB were inflated, then the rest of the body was still read and
        # inflated, on the event loop (1.5 s without an event for one bomb)
        assert await largest_gap_during((http, base), attack) < 0.5


async def test_a_huge_stop_token_ids_list_is_refused_without_stalling(tiny_server) -> None:
    base = f"http://127.0.0.1:{tiny_server.port}"
    body = orjson.dumps({"prompt": "hi", "max_tokens": 200, "stop_token_ids": [5] * 983_040})

    async def attack() -> None:
        async with aiohttp.ClientSession() as http:
            headers = {"Content-Type": "application/json"}
            async with http.post(f"{base}/v1/completions", data=body, headers=headers) as r:
                # before: accepted; every token scanned the whole list (23x slower steps)
                assert r.status == 400
                assert (await r.json())["error"]["param"] == "stop_token_ids"

    async with aiohttp.ClientSession() as http:
        assert await largest_gap_during((http, base), attack) < 0.75  # its 6 MB body is parsed


async def test_a_refusal_before_the_body_is_read_closes_the_connection_cleanly() -> None:
    running = await start_server(ServerConfig(port=0, api_keys=("k",)), FakeEngine())
    try:
        url = f"http://127.0.0.1:{running.port}/v1/completions"
        async with aiohttp.ClientSession() as http:
            for _ in range(3):  # a reused connection would be reset by the server's close
                async with http.post(url, json={"prompt": "a" * 2_000_000}) as resp:
                    assert resp.status == 401
                    assert resp.headers.get("Connection", "").lower() == "close"
    finally:
        await running.shutdown(timeout=2)

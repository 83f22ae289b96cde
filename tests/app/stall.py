"""Event-loop stall measurement for server tests: stream completions back to back from a real
tiny engine while an attack runs, and report the largest gap between two SSE events."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
from aiohttp.test_utils import TestClient, TestServer

from tandem.app.config import ServerConfig
from tandem.app.server import create_app
from tandem.runtime.loop import EngineLoop
from tests.app.tiny_engine import TinyTokenizer, make_tiny_engine

STREAM = {
    "prompt": "Hello world! The quick",
    "max_tokens": 200,
    "temperature": 0,
    "ignore_eos": True,
    "stream": True,
}


async def tiny_client(
    tokenizer: TinyTokenizer, config: ServerConfig | None = None, **server_kwargs: Any
) -> TestClient:
    engine = make_tiny_engine(tokenizer, max_num_seqs=16)
    loop = EngineLoop(engine, max_queue=64, max_running=16)
    client = TestClient(TestServer(create_app(config or ServerConfig(), loop), **server_kwargs))
    await client.start_server()
    return client


async def _watch(
    http: aiohttp.ClientSession, base: str, stop: asyncio.Event, gaps: list[float]
) -> None:
    while not stop.is_set():
        async with http.post(f"{base}/v1/completions", json=STREAM) as resp:
            assert resp.status == 200, await resp.text()
            last = time.perf_counter()
            async for line in resp.content:
                now = time.perf_counter()
                if line.startswith(b"data: "):
                    gaps.append(now - last)
                    last = now
                if stop.is_set():
                    break


async def largest_gap_during(
    client: TestClient | tuple[aiohttp.ClientSession, str], attack: Callable[[], Awaitable[None]]
) -> float:
    """Seconds of the largest gap between SSE events of an unrelated stream while `attack`
    runs (the stream is running before the attack starts). `client`: a test client, or a
    session and the base URL of a listening server."""
    if isinstance(client, TestClient):
        http, base = client.session, str(client.make_url("")).rstrip("/")
    else:
        http, base = client
    stop = asyncio.Event()
    gaps: list[float] = []
    watcher = asyncio.create_task(_watch(http, base, stop, gaps))
    while not gaps:  # the stream runs
        await asyncio.sleep(0.01)
    try:
        await attack()
    finally:
        stop.set()
        await watcher
    return max(gaps)


async def aclosing_client(client: TestClient) -> AsyncIterator[TestClient]:
    try:
        yield client
    finally:
        await client.close()

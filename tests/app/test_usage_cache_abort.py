"""What the Web UI relies on from the API, against a real listening server on a real (tiny)
engine: `usage.prompt_tokens_details.cached_tokens` reports prefix-cache reuse (streamed and
not), and a client that hangs up mid-stream aborts its request at once (its KV blocks freed).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest

from tandem.app.config import ServerConfig
from tandem.app.serve import RunningServer, start_server
from tests.app.tiny_engine import TinyTokenizer, make_tiny_engine

SYSTEM = "A slow reader never stalls the engine; its deltas coalesce until it reads. " * 3


@pytest.fixture
async def server() -> AsyncIterator[RunningServer]:
    engine = make_tiny_engine(TinyTokenizer(), num_blocks=256, block_size=4, max_model_len=512)
    running = await start_server(ServerConfig(port=0), engine)
    yield running
    await running.shutdown(timeout=5)


def _chat(question: str, **extra: object) -> dict[str, object]:
    return {
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": question},
        ],
        "max_tokens": 4,
        "temperature": 0,
        **extra,
    }


async def _metric(http: aiohttp.ClientSession, base: str, name: str) -> float:
    async with http.get(f"{base}/metrics") as resp:
        text = await resp.text()
    m = re.search(rf"^tandem:{name}(?:{{model_name=\"[^\"]*\"}})? (\S+)$", text, re.M)
    assert m, f"{name} missing from /metrics"
    return float(m.group(1))


async def test_cached_tokens_in_usage(server: RunningServer) -> None:
    base = f"http://127.0.0.1:{server.port}"
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{base}/v1/chat/completions", json=_chat("Hello world!")) as r:
            assert r.status == 200, await r.text()
            first = (await r.json())["usage"]
        assert first["prompt_tokens_details"] == {"cached_tokens": 0}
        assert first["prompt_tokens"] > 40

        async with http.post(f"{base}/v1/chat/completions", json=_chat("The quick fox")) as r:
            second = (await r.json())["usage"]
        cached = second["prompt_tokens_details"]["cached_tokens"]
        # the system prompt's full blocks are shared; the question is not
        assert 40 <= cached < second["prompt_tokens"], second

        body = _chat("The quick fox", stream=True, stream_options={"include_usage": True})
        async with http.post(f"{base}/v1/chat/completions", json=body) as r:
            frames = [
                json.loads(line[6:])
                for line in (await r.text()).splitlines()
                if line.startswith("data: {")
            ]
        usage = frames[-1]["usage"]
        assert frames[-1]["choices"] == []
        # the same prompt again: everything but the last block is reused
        assert usage["prompt_tokens"] == second["prompt_tokens"]
        assert usage["prompt_tokens_details"]["cached_tokens"] >= usage["prompt_tokens"] - 4


async def test_cached_tokens_count_each_prompt_once(server: RunningServer) -> None:
    base = f"http://127.0.0.1:{server.port}"
    body = {"prompt": SYSTEM, "max_tokens": 2, "temperature": 0}
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{base}/v1/completions", json=body) as r:
            assert (await r.json())["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        body = {**body, "prompt": [SYSTEM + " Hello", SYSTEM + " world"], "n": 2}
        async with http.post(f"{base}/v1/completions", json=body) as r:
            usage = (await r.json())["usage"]
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    # two prompts sharing SYSTEM's cached blocks, each counted once however many samples
    assert usage["prompt_tokens"] - 2 * 8 <= cached < usage["prompt_tokens"], usage


async def test_client_hang_up_aborts_the_request(server: RunningServer) -> None:
    base = f"http://127.0.0.1:{server.port}"
    engine = server.engine_loop.engine
    step = engine.step

    def slow_step():  # about 3 s for the whole reply: it cannot finish on its own in time
        time.sleep(0.01)
        return step()

    engine.step = slow_step
    body = _chat("Hello", max_tokens=300, ignore_eos=True, stream=True)
    async with aiohttp.ClientSession() as http:
        resp = await http.post(f"{base}/v1/chat/completions", json=body)
        chunks = 0
        async for line in resp.content:
            if line.startswith(b"data: {"):
                chunks += 1
            if chunks == 3:
                break
        assert await _metric(http, base, "num_requests_admitted") == 1
        resp.close()  # what the browser's AbortController does to the fetch
        deadline = time.monotonic() + 5
        # the engine applies an abort at its next step boundary; /metrics shows it then
        while (
            await _metric(http, base, "num_requests_admitted") > 0
            or await _metric(http, base, "num_requests_running") > 0
        ):
            assert time.monotonic() < deadline, "the request kept running after the hang-up"
            await asyncio.sleep(0.05)
        assert re.search(
            r'tandem:request_success_total\{model_name="[^"]*",finished_reason="abort"\} 1',
            (await (await http.get(f"{base}/metrics")).text()),
        )
    await asyncio.wait_for(server.engine_loop.wait_idle(), 5)
    while engine.has_unfinished_requests():  # the abort's last delta goes out with one more step
        assert time.monotonic() < deadline + 1
        await asyncio.sleep(0.02)
    pool = engine.scheduler.block_pool
    pool.check_invariants()
    assert pool.usage == 0.0

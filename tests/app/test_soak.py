"""Soak: many concurrent streaming clients against a real listening server on a REAL engine
(tiny random Llama, paged KV cache small enough to force preemption), a tenth of them
disconnecting at random points.

Every other stream completes with its full token count (ignore_eos, usage chunk, finish
reason `length`, `[DONE]` last) and greedy texts agree between requests of the same prompt;
afterwards the engine is idle, its block pool passes its invariants with no referenced block,
and the server still answers.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp
import pytest

from tandem.app.config import ServerConfig
from tandem.app.serve import RunningServer, start_server
from tests.app.tiny_engine import TinyTokenizer, make_tiny_engine

PROMPTS = [
    "Hello world! The quick brown fox",
    "A slow reader never stalls the engine",
    "def f(x):\n    return",
    "Stop strings like </s> and ### can span tokens. Unicode: héllo",
    "jumps over the lazy dog. Hello",
]
MAX_TOKENS = [24, 16, 20, 12, 28]  # per prompt, so equal prompts mean equal greedy texts
CLIENT_TIMEOUT_S = 120.0


@dataclass
class Outcome:
    index: int
    prompt: int
    disconnect_after: int | None  # chunks read before hanging up; None: reads to the end
    text: str = ""
    finish_reason: str | None = None
    completion_tokens: int | None = None
    done: bool = False


@pytest.fixture
async def tiny_server() -> AsyncIterator[RunningServer]:
    engine = make_tiny_engine(
        TinyTokenizer(), num_blocks=100, block_size=4, max_num_seqs=48, max_num_batched_tokens=512
    )
    running = await start_server(ServerConfig(port=0, max_queue=256), engine)
    yield running
    await running.shutdown(timeout=5)


async def one_client(http: aiohttp.ClientSession, base: str, out: Outcome) -> Outcome:
    body = {
        "prompt": PROMPTS[out.prompt],
        "max_tokens": MAX_TOKENS[out.prompt],
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with http.post(f"{base}/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        num_chunks = 0
        async for raw in resp.content:  # one SSE line per iteration
            line = raw.decode().strip()
            if not line:
                continue
            assert line.startswith("data: "), line
            data = line[len("data: ") :]
            if data == "[DONE]":
                out.done = True
                break
            chunk = json.loads(data)
            assert "error" not in chunk, chunk
            if chunk.get("usage"):
                out.completion_tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk["choices"]:
                out.text += choice["text"]
                out.finish_reason = choice["finish_reason"] or out.finish_reason
            num_chunks += 1
            if out.disconnect_after is not None and num_chunks >= out.disconnect_after:
                resp.close()  # hang up mid-stream: the server must abort the request
                return out
    return out


async def soak(server: RunningServer, num_clients: int, seed: int) -> None:
    rng = random.Random(seed)
    base = f"http://127.0.0.1:{server.port}"
    leavers = set(rng.sample(range(num_clients), num_clients // 10))
    outcomes = [
        Outcome(i, rng.randrange(len(PROMPTS)), rng.randint(1, 6) if i in leavers else None)
        for i in range(num_clients)
    ]
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    timeout = aiohttp.ClientTimeout(total=CLIENT_TIMEOUT_S)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
        await asyncio.gather(*(one_client(http, base, o) for o in outcomes))

        engine_loop = server.engine_loop
        engine = engine_loop.engine
        await asyncio.wait_for(engine_loop.wait_idle(), 10)

        stayers = [o for o in outcomes if o.disconnect_after is None]
        assert len(stayers) == num_clients - num_clients // 10
        texts: dict[int, str] = {}
        for o in stayers:
            want = MAX_TOKENS[o.prompt]
            assert o.done and o.finish_reason == "length", o
            assert o.completion_tokens == want, o
            assert texts.setdefault(o.prompt, o.text) == o.text, (o, texts[o.prompt])
        assert len(texts) == len(PROMPTS)

        # idle, and no block leak: every block free or held only by the prefix cache
        assert not engine.has_unfinished_requests()
        assert engine_loop.num_admitted == 0 and engine_loop.request_ids() == []
        pool = engine.scheduler.block_pool
        pool.check_invariants()
        assert pool.usage == 0.0
        stats = engine.stats()
        assert stats.num_running == 0 and stats.num_waiting == 0
        assert stats.num_preemptions > 0, "the KV pool was meant to run dry at this load"
        assert stats.prefix_cache_hits > 0

        # the server still answers, with the same greedy text as under load
        async with http.get(f"{base}/health") as health:
            assert health.status == 200
        async with http.post(
            f"{base}/v1/completions",
            json={
                "prompt": PROMPTS[0],
                "max_tokens": MAX_TOKENS[0],
                "temperature": 0,
                "ignore_eos": True,
            },
        ) as resp:
            assert resp.status == 200
            full = await resp.json()
        assert full["usage"]["completion_tokens"] == MAX_TOKENS[0]
        assert full["choices"][0]["text"] == texts[0]
        async with http.get(f"{base}/metrics") as metrics:
            text = await metrics.text()
        # without the model_name label every sample carries
        text = re.sub(r'model_name="[^"]*",', "", re.sub(r'\{model_name="[^"]*"\}', "", text))
        gauges = dict(
            line.split(" ", 1) for line in text.splitlines() if line and not line.startswith("#")
        )
        assert float(gauges["tandem:num_requests_running"]) == 0
        assert float(gauges["tandem:kv_cache_usage_perc"]) == 0
        # every request accounted once: leavers mostly aborted, the rest (and the probe) length
        aborted = int(
            float(gauges.get('tandem:request_success_total{finished_reason="abort"}', "0"))
        )
        length = int(float(gauges['tandem:request_success_total{finished_reason="length"}']))
        num_leavers = num_clients // 10
        assert 1 <= aborted <= num_leavers
        assert aborted + length == num_clients + 1


async def test_soak_200_clients_a_tenth_hanging_up(tiny_server: RunningServer) -> None:
    await soak(tiny_server, 200, seed=2)

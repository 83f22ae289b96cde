"""One request of many prompts cannot keep another client waiting for a slot (real engine)."""

from __future__ import annotations

import asyncio
import time

from tests.app.stall import aclosing_client, tiny_client
from tests.app.tiny_engine import TinyTokenizer


async def test_a_newcomer_gets_a_slot_while_a_64_prompt_request_runs() -> None:
    async for client in aclosing_client(await tiny_client(TinyTokenizer())):  # 16 slots
        big = {"prompt": ["Hello world"] * 64, "max_tokens": 200, "ignore_eos": True,
               "stream": True}  # fmt: skip
        hog = await client.post("/v1/completions", json=big)
        await hog.content.readuntil(b"\n\n")  # its sequences hold every running slot
        t0 = time.perf_counter()
        small = {"prompt": "Hi", "max_tokens": 1, "ignore_eos": True}
        resp = await asyncio.wait_for(client.post("/v1/completions", json=small), 30)
        waited = time.perf_counter() - t0
        assert resp.status == 200
        # before: it waited for one of the 64 sequences to finish its 200 tokens (seconds)
        assert waited < 1.0, waited
        hog.close()

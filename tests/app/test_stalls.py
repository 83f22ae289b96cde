"""Event-loop stall tests: while one client attacks (huge prompts, huge stop_token_ids lists,
compression bombs, long stop strings), an unrelated stream's largest gap between events stays
under a bound, on the real tiny engine."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from aiohttp.test_utils import TestClient

from tests.app.stall import aclosing_client, largest_gap_during, tiny_client
from tests.app.tiny_engine import TinyTokenizer

BOUND_S = 0.75  # before the fix: ~2 s


@pytest.fixture(scope="module")
def tokenizer() -> TinyTokenizer:
    return TinyTokenizer()


@pytest.fixture
async def client(tokenizer: TinyTokenizer) -> AsyncIterator[TestClient]:
    async for c in aclosing_client(await tiny_client(tokenizer)):
        yield c


async def test_huge_prompts_are_tokenized_off_the_event_loop(client: TestClient) -> None:
    text = "Hello world! The quick brown fox jumps over the lazy dog. " * 6_000  # 350 KB

    async def attack() -> None:
        async def one(kind: str) -> None:
            body = (
                {"prompt": text}
                if kind == "completions"
                else {"messages": [{"role": "user", "content": text}]}
            )
            resp = await client.post(f"/v1/{kind}", json=body)
            assert resp.status == 400  # far past the context length
            assert (await resp.json())["error"]["code"] == "context_length_exceeded"

        await asyncio.gather(one("completions"), one("completions"), one("chat/completions"))

    # before: each 1 MB prompt was tokenized on the event loop, ~0.7 s per prompt without a single event
    assert await largest_gap_during(client, attack) < BOUND_S

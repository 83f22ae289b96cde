"""The official `openai` client against a real listening server (FakeEngine by default).

Set TANDEM_TEST_REAL_MODEL=1 to run the same tests on the real default model instead.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator

import openai
import pytest

from app.config import ServerConfig
from app.serve import RunningServer, start_server
from tests.app.fake_engine import REPLY, FakeEngine

REAL = os.environ.get("TANDEM_TEST_REAL_MODEL") == "1"
KEY = "sk-test-key"


def _engine():
    if not REAL:
        return FakeEngine()
    from runtime.config import EngineConfig
    from runtime.engine import Engine

    return Engine(EngineConfig())


@pytest.fixture
async def server() -> AsyncIterator[RunningServer]:
    running = await start_server(ServerConfig(port=0, api_keys=(KEY,)), _engine())
    yield running
    await running.shutdown(timeout=5)


@pytest.fixture
def client(server: RunningServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key=KEY,
                              max_retries=0, timeout=30)


async def test_models_and_auth(server: RunningServer, client: openai.AsyncOpenAI) -> None:
    models = await client.models.list()
    assert [m.id for m in models.data] == [server.engine_loop.model_name]
    bad = openai.AsyncOpenAI(base_url=str(client.base_url), api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        await bad.models.list()


async def test_chat_streamed_joins_to_non_streamed(client: openai.AsyncOpenAI) -> None:
    model = (await client.models.list()).data[0].id
    messages = [{"role": "user", "content": "Say hello."}]
    full = await client.chat.completions.create(model=model, messages=messages, max_tokens=12,
                                                temperature=0)
    assert full.choices[0].finish_reason in ("length", "stop")
    assert full.usage.completion_tokens <= 12
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens
    stream = await client.chat.completions.create(model=model, messages=messages, max_tokens=12,
                                                  temperature=0, stream=True,
                                                  stream_options={"include_usage": True})
    parts, usage = [], None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            parts.append(choice.delta.content or "")
    assert "".join(parts) == full.choices[0].message.content
    assert usage is not None and usage.completion_tokens == full.usage.completion_tokens
    if not REAL:
        assert full.choices[0].message.content == REPLY[:12]


async def test_completions_streamed_and_not(client: openai.AsyncOpenAI) -> None:
    model = (await client.models.list()).data[0].id
    full = await client.completions.create(model=model, prompt="Once upon a time", max_tokens=1,
                                           temperature=0, logprobs=2)
    assert full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 1
    assert len(full.choices[0].logprobs.tokens) == 1
    assert len(full.choices[0].logprobs.top_logprobs[0]) >= 1
    stream = await client.completions.create(model=model, prompt=["a b", "c d"], max_tokens=5,
                                             temperature=0, stream=True)
    texts = {0: "", 1: ""}
    async for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    if not REAL:
        assert texts == {0: REPLY[:5], 1: REPLY[:5]}


async def test_n_with_seed_and_stop(client: openai.AsyncOpenAI) -> None:
    model = (await client.models.list()).data[0].id
    out = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Count."}], n=2, seed=7,
        max_tokens=8, temperature=0.8)
    assert [c.index for c in out.choices] == [0, 1]
    stop = await client.completions.create(model=model, prompt="x", max_tokens=20, stop=[","])
    assert "," not in stop.choices[0].text
    if not REAL:
        assert stop.choices[0].text == "hello world" and stop.choices[0].finish_reason == "stop"


async def test_error_surfaces_as_openai_exception(client: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        await client.chat.completions.create(model=(await client.models.list()).data[0].id,
                                             messages=[{"role": "user", "content": "x"}],
                                             temperature=5000)
    assert info.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        await client.chat.completions.create(model="no-such-model",
                                             messages=[{"role": "user", "content": "x"}])

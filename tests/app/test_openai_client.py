"""The official `openai` client against a real listening server: on the FakeEngine (exact
texts known) and on the real default model (SmolLM2-135M-Instruct, loaded once per module).

Every test runs on both. On the real model the assertions are relations the server must keep
whatever the weights say: greedy streamed deltas join to the non-streamed text, a seed
reproduces, a stop string cuts the greedy text where it first occurs, usage matches the
tokenizer and the logprobs.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest

from tandem.app.config import ServerConfig
from tandem.app.serve import RunningServer, start_server
from tests.app.fake_engine import REPLY, FakeEngine

KEY = "sk-test-key"


@pytest.fixture(scope="module", params=["fake", "real"])
def engine(request: pytest.FixtureRequest) -> Any:
    if request.param == "fake":
        return FakeEngine(max_model_len=4096)
    from tandem.runtime.config import EngineConfig
    from tandem.runtime.engine import Engine

    return Engine(EngineConfig())  # no model named: the default model


def is_real(engine: Any) -> bool:
    return not isinstance(engine, FakeEngine)


@pytest.fixture
async def server(engine: Any) -> AsyncIterator[RunningServer]:
    running = await start_server(ServerConfig(port=0, api_keys=(KEY,)), engine)
    yield running
    await running.shutdown(timeout=5)
    assert not engine.has_unfinished_requests()


@pytest.fixture
def client(server: RunningServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{server.port}/v1", api_key=KEY, max_retries=0, timeout=60
    )


async def model_id(client: openai.AsyncOpenAI) -> str:
    return (await client.models.list()).data[0].id


async def test_models_and_auth(
    server: RunningServer, client: openai.AsyncOpenAI, engine: Any
) -> None:
    models = await client.models.list()
    assert [m.id for m in models.data] == [engine.model_name]
    if is_real(engine):
        assert engine.model_name == "smollm2-135m-instruct"
    bad = openai.AsyncOpenAI(base_url=str(client.base_url), api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        await bad.models.list()


async def test_chat_streamed_joins_to_non_streamed(client: openai.AsyncOpenAI, engine: Any) -> None:
    model = await model_id(client)
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name three colours."},
    ]
    full = await client.chat.completions.create(
        model=model, messages=messages, max_tokens=16, temperature=0
    )
    choice = full.choices[0]
    assert choice.finish_reason in ("length", "stop") and choice.message.role == "assistant"
    assert choice.message.content
    template = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    prompt_ids = engine.tokenizer.encode(template, add_special_tokens=False)
    assert full.usage.prompt_tokens == len(prompt_ids)
    assert 1 <= full.usage.completion_tokens <= 16
    if choice.finish_reason == "length":
        assert full.usage.completion_tokens == 16
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens
    stream = await client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    parts, finishes, usage, ids = [], [], None, set()
    async for chunk in stream:
        ids.add(chunk.id)
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            parts.append(c.delta.content or "")
            if c.finish_reason:
                finishes.append(c.finish_reason)
    assert "".join(parts) == choice.message.content
    assert finishes == [choice.finish_reason]
    assert len(ids) == 1
    assert usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (
        full.usage.prompt_tokens,
        full.usage.completion_tokens,
    )
    if not is_real(engine):
        assert choice.message.content == REPLY[:16]


async def test_completions_streamed_join_and_prompt_list(
    client: openai.AsyncOpenAI, engine: Any
) -> None:
    model = await model_id(client)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    full = await client.completions.create(
        model=model, prompt=prompts, max_tokens=10, temperature=0
    )
    assert sorted(c.index for c in full.choices) == [0, 1]
    want = {c.index: c.text for c in full.choices}
    assert full.usage.prompt_tokens == sum(
        len(engine.tokenizer.encode(p, add_special_tokens=False)) for p in prompts
    )
    stream = await client.completions.create(
        model=model, prompt=prompts, max_tokens=10, temperature=0, stream=True
    )
    texts = {0: "", 1: ""}
    async for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == want
    assert want[0] != want[1] or not is_real(engine)  # different prompts, different greedy texts
    if not is_real(engine):
        assert want == {0: REPLY[:10], 1: REPLY[:10]}


async def test_max_tokens_one_finishes_with_length(client: openai.AsyncOpenAI) -> None:
    model = await model_id(client)
    comp = await client.completions.create(
        model=model, prompt="Once upon a time", max_tokens=1, temperature=0
    )
    assert comp.choices[0].finish_reason == "length"
    assert comp.usage.completion_tokens == 1
    chat = await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Hi"}],
        max_completion_tokens=1,
        temperature=0,
    )
    assert chat.choices[0].finish_reason == "length"
    assert chat.usage.completion_tokens == 1


async def test_n_with_seed_reproduces(client: openai.AsyncOpenAI, engine: Any) -> None:
    model = await model_id(client)

    async def sample(seed: int) -> list[str]:
        out = await client.completions.create(
            model=model, prompt="Once upon a time", n=2, seed=seed, max_tokens=12, temperature=1.0
        )
        assert sorted(c.index for c in out.choices) == [0, 1]
        assert out.usage.completion_tokens <= 24
        return [c.text for c in sorted(out.choices, key=lambda c: c.index)]

    first = await sample(7)
    assert await sample(7) == first
    if not is_real(engine):
        assert first[0] != first[1]  # choice i samples with seed + i
    chat = await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Tell me a story."}],
        n=2,
        seed=3,
        max_tokens=8,
        temperature=0.8,
    )
    assert [c.index for c in chat.choices] == [0, 1]


async def test_stop_cuts_the_greedy_text(client: openai.AsyncOpenAI) -> None:
    model = await model_id(client)
    prompt = "The quick brown fox jumps over the lazy dog. Then the fox"
    free = await client.completions.create(
        model=model, prompt=prompt, max_tokens=24, temperature=0, extra_body={"ignore_eos": True}
    )
    text = free.choices[0].text
    assert len(text) >= 6, text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip(), text
    cut = await client.completions.create(
        model=model, prompt=prompt, max_tokens=24, temperature=0, stop=[stop, "@@never@@"]
    )
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[: text.find(stop)]
    assert stop not in cut.choices[0].text


async def test_logprobs_chat_and_completions(client: openai.AsyncOpenAI, engine: Any) -> None:
    model = await model_id(client)
    chat = await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "What is 2+2?"}],
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    for item in content:
        assert item.logprob <= 0 and len(item.top_logprobs) == 3
        tops = [t.logprob for t in item.top_logprobs]
        assert tops == sorted(tops, reverse=True)
        if is_real(engine):  # greedy picks the most likely token
            assert item.token == item.top_logprobs[0].token
            assert math.isclose(item.logprob, tops[0], rel_tol=1e-4, abs_tol=1e-4)
    comp = await client.completions.create(
        model=model, prompt="Once upon a time", max_tokens=4, temperature=0, logprobs=2
    )
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == comp.usage.completion_tokens == 4
    assert "".join(lp.tokens) == comp.choices[0].text
    assert all(len(top) >= 1 for top in lp.top_logprobs)


async def test_error_surfaces_as_openai_exception(client: openai.AsyncOpenAI) -> None:
    model = await model_id(client)
    with pytest.raises(openai.BadRequestError) as info:
        await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "x"}], temperature=5000
        )
    assert info.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        await client.chat.completions.create(
            model="no-such-model", messages=[{"role": "user", "content": "x"}]
        )

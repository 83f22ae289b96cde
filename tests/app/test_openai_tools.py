"""The official `openai` client against a real listening server: JSON mode, a strict
json_schema, tool_choice "required" and a named function, a streamed tool call the client
reassembles, a follow-up turn carrying the tool result, reasoning_content, logit_bias.

On the default model (SmolLM2-135M-Instruct) and on tiny random models of each family with a
tool-call format: grammar-forced outputs are checked with `jsonschema` whatever the weights.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import jsonschema
import openai
import pytest

from tandem.app.config import ServerConfig
from tandem.app.serve import RunningServer, start_server
from tests.app import fake_engine
from tests.app.fake_engine import FakeEngine, FakeTokenizer
from tests.app.family_models import FAMILIES, family_engine

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["c", "f"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string", "maxLength": 6}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]  # fmt: skip
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module", params=["default", *FAMILIES])
def engine(request: pytest.FixtureRequest) -> Any:
    if request.param == "default":
        from tandem.runtime.config import EngineConfig
        from tandem.runtime.engine import Engine

        return Engine(EngineConfig())
    return family_engine(FAMILIES[request.param])


@pytest.fixture
async def client(engine: Any) -> AsyncIterator[openai.AsyncOpenAI]:
    running: RunningServer = await start_server(ServerConfig(port=0), engine)
    yield openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{running.port}/v1", api_key="x", max_retries=0, timeout=120
    )
    await running.shutdown(timeout=5)
    assert not engine.has_unfinished_requests()


def check_calls(calls: Any, allowed: set[str], mistral: bool = False) -> None:
    assert calls
    for call in calls:
        assert call.type == "function"
        if mistral:  # its templates refuse other ids in the follow-up turn
            assert len(call.id) == 9 and call.id.isalnum(), call.id
        else:
            assert call.id.startswith("call_") and len(call.id) == 29, call.id
        assert call.function.name in allowed
        jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])


async def test_json_mode(client: openai.AsyncOpenAI) -> None:
    r = await client.chat.completions.create(
        model=(await client.models.list()).data[0].id,
        messages=[{"role": "user", "content": "Describe a cat as JSON."}],
        response_format={"type": "json_object"},
        max_tokens=48,
        temperature=0,
    )
    choice = r.choices[0]
    text = choice.message.content
    assert text.startswith("{")
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:  # cut mid-object: reported as such, never closed by the server
        assert choice.finish_reason == "length" and r.usage.completion_tokens == 48


async def test_strict_json_schema(client: openai.AsyncOpenAI) -> None:
    r = await client.chat.completions.create(
        model=(await client.models.list()).data[0].id,
        messages=[{"role": "user", "content": "Invent a person."}],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": PERSON, "strict": True},
        },
        max_tokens=120,
        temperature=0.8,
        seed=1,
        n=2,
    )
    for choice in r.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), PERSON)


async def test_tool_choice_required(client: openai.AsyncOpenAI, engine: Any) -> None:
    r = await client.chat.completions.create(
        model=(await client.models.list()).data[0].id,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=120,
        temperature=0.7,
        seed=3,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert len(choice.message.tool_calls) == 1
    check_calls(choice.message.tool_calls, set(PARAMS), engine.model_name == "tiny-mistral")


async def test_named_function(client: openai.AsyncOpenAI, engine: Any) -> None:
    r = await client.chat.completions.create(
        model=(await client.models.list()).data[0].id,
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        max_tokens=60,
        temperature=0.7,
        seed=4,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    check_calls(choice.message.tool_calls, {"get_time"}, engine.model_name == "tiny-mistral")


async def test_streamed_tool_call_reassembled_by_the_client(
    client: openai.AsyncOpenAI, engine: Any
) -> None:
    model = (await client.models.list()).data[0].id
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        async with client.chat.completions.stream(
            model=model, messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=300,
            temperature=0.7, seed=5,
        ) as stream:  # fmt: skip
            fragments = 0
            async for event in stream:
                fragments += event.type == "tool_calls.function.arguments.delta"
            final = await stream.get_final_completion()
        msg = final.choices[0].message
        assert final.choices[0].finish_reason == "tool_calls"
        check_calls(
            msg.tool_calls,
            set(PARAMS) if choice == "required" else {"get_weather"},
            engine.model_name == "tiny-mistral",
        )
        if choice != "required":  # the named call's arguments stream as they are generated
            assert fragments > 1


async def test_follow_up_turn_with_the_tool_result(client: openai.AsyncOpenAI, engine: Any) -> None:
    model = (await client.models.list()).data[0].id
    first = await client.chat.completions.create(
        model=model, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=300,
        temperature=0.7, seed=6,
    )  # fmt: skip
    msg = first.choices[0].message
    check_calls(msg.tool_calls, set(PARAMS), engine.model_name == "tiny-mistral")
    history = [
        *ASK,
        msg.model_dump(exclude_none=True),
        *(
            {"role": "tool", "tool_call_id": c.id, "content": json.dumps({"temp": 21})}
            for c in msg.tool_calls
        ),
    ]
    second = await client.chat.completions.create(
        model=model, messages=history, tools=TOOLS, max_tokens=8, temperature=0
    )
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert second.usage.prompt_tokens > first.usage.prompt_tokens


async def test_logit_bias_forces_a_token(client: openai.AsyncOpenAI, engine: Any) -> None:
    token = engine.tokenizer.encode(" Paris")[-1]
    r = await client.chat.completions.create(
        model=(await client.models.list()).data[0].id,
        messages=ASK,
        max_tokens=3,
        temperature=0,
        logit_bias={str(token): 100},
        logprobs=True,
    )
    assert [lp.token for lp in r.choices[0].logprobs.content] == [
        engine.tokenizer.decode([token], skip_special_tokens=False)
    ] * 3
    with pytest.raises(openai.BadRequestError) as err:
        await client.chat.completions.create(
            model=r.model, messages=ASK, max_tokens=3, logit_bias={"99999999": 5}
        )
    assert err.value.body["param"] == "logit_bias"


async def test_unsupported_schema_is_a_400_naming_it(client: openai.AsyncOpenAI) -> None:
    bad = {"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}
    with pytest.raises(openai.BadRequestError) as err:
        await client.chat.completions.create(
            model=(await client.models.list()).data[0].id,
            messages=ASK,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": bad}},
        )
    assert err.value.body["param"] == "response_format"
    assert '"if"' in err.value.body["message"]


@pytest.mark.parametrize("family", ["qwen3", "deepseek_v3"])
async def test_reasoning_content_is_separate(family: str) -> None:
    """DeepSeek-R1's template opens the thought in the prompt; Qwen3's model opens it. A
    logit_bias makes the random model write a known token inside the thought."""
    engine = family_engine(FAMILIES[family])
    running = await start_server(ServerConfig(port=0), engine)
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{running.port}/v1", api_key="x",
                                max_retries=0)  # fmt: skip
    try:
        word = engine.tokenizer.encode(" Paris")[-1]
        first = engine.tokenizer.encode("<think>")[0] if family == "qwen3" else word
        model = (await client.models.list()).data[0].id
        kwargs: dict[str, Any] = dict(model=model, messages=ASK, max_tokens=4, temperature=0,
                                      logit_bias={str(first): 100})  # fmt: skip
        r = await client.chat.completions.create(**kwargs)
        msg = r.choices[0].message.model_dump()
        expect = engine.tokenizer.decode([first] * 4, skip_special_tokens=True)
        if family == "qwen3":
            expect = expect.removeprefix("<think>")
        assert msg["reasoning_content"] == expect and msg["content"] == ""
        stream = await client.chat.completions.create(**kwargs, stream=True)
        parts: dict[str, str] = {"content": "", "reasoning_content": ""}
        async for chunk in stream:
            for c in chunk.choices:
                delta = c.delta.model_dump()
                for k in parts:
                    parts[k] += delta.get(k) or ""
        assert parts == {"content": "", "reasoning_content": expect}
        if family == "qwen3":  # thinking off: the template closes an empty thought
            off = await client.chat.completions.create(
                **{**kwargs, "logit_bias": {str(word): 100}},
                extra_body={"chat_template_kwargs": {"enable_thinking": False}},
            )
            assert off.usage.prompt_tokens > r.usage.prompt_tokens
            assert off.choices[0].message.content == engine.tokenizer.decode([word] * 4)
            with pytest.raises(openai.BadRequestError) as err:
                await client.chat.completions.create(
                    **kwargs, extra_body={"chat_template_kwargs": {"messages": []}}
                )
            assert err.value.body["param"] == "chat_template_kwargs.messages"
    finally:
        await running.shutdown(timeout=5)


async def test_vllm_extras_on_chat_and_completions(client: openai.AsyncOpenAI) -> None:
    import re

    model = (await client.models.list()).data[0].id
    cases = [
        ({"guided_choice": ["sunny", "rainy day"]}, r"(sunny|rainy day)"),
        ({"structured_outputs": {"regex": r"[0-9]{3}-[a-c]{2}"}}, r"[0-9]{3}-[a-c]{2}"),
        ({"guided_grammar": 'root ::= "(" [xy]+ ")"'}, r"\([xy]+\)"),
        ({"guided_json": PERSON}, None),
        ({"structured_outputs": {"json": PERSON}}, None),
    ]
    for extra, pattern in cases:
        chat = await client.chat.completions.create(
            model=model, messages=ASK, max_tokens=60, temperature=1.0, seed=2, extra_body=extra
        )
        comp = await client.completions.create(
            model=model, prompt="The weather:", max_tokens=60, temperature=1.0, seed=2,
            extra_body=extra,
        )  # fmt: skip
        for text, finish in (
            (chat.choices[0].message.content, chat.choices[0].finish_reason),
            (comp.choices[0].text, comp.choices[0].finish_reason),
        ):
            assert finish == "stop", (extra, text)
            if pattern is None:
                jsonschema.validate(json.loads(text), PERSON)
            else:
                assert re.fullmatch(pattern, text), (extra, text)
    with pytest.raises(openai.BadRequestError) as err:
        await client.chat.completions.create(
            model=model, messages=ASK, response_format={"type": "json_object"},
            extra_body={"guided_regex": "a+"},
        )  # fmt: skip
    assert err.value.body["param"] == "guided_regex"
    with pytest.raises(openai.BadRequestError) as err:
        await client.chat.completions.create(
            model=model, messages=ASK, extra_body={"structured_outputs": {"structural_tag": "x"}}
        )
    assert err.value.body["param"] == "structured_outputs.structural_tag"


# -- tool_choice "auto": a scripted reply (the fake engine) through the family's parser --------

SCRIPT = (
    "<think>The user wants weather.</think>\n\nChecking.<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'
)


class HermesFakeTokenizer(FakeTokenizer):
    chat_template = "{{ '<tool_call>' }} ... </think>"  # picks the Hermes parser and <think>

    def apply_chat_template(self, messages, add_generation_prompt=True, **kwargs):  # noqa: ANN001, ANN201
        tools = kwargs.get("tools") or []
        head = "".join(f"<tool>{t['function']['name']}\n" for t in tools)
        return head + super().apply_chat_template(messages, add_generation_prompt)


@pytest.fixture
async def scripted(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[openai.AsyncOpenAI]:
    monkeypatch.setattr(fake_engine, "REPLY", SCRIPT)
    engine = FakeEngine(max_model_len=4096, eos_after=len(SCRIPT))
    engine.tokenizer = HermesFakeTokenizer()
    running = await start_server(ServerConfig(port=0), engine)
    yield openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{running.port}/v1", api_key="x", max_retries=0
    )
    await running.shutdown(timeout=5)


async def test_auto_tool_call_parsed_whole_and_streamed(scripted: openai.AsyncOpenAI) -> None:
    kwargs: dict[str, Any] = dict(model="fake-model", messages=ASK, tools=TOOLS, max_tokens=400)
    r = await scripted.chat.completions.create(**kwargs)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Checking."
    assert choice.message.model_dump()["reasoning_content"] == "The user wants weather."
    check_calls(choice.message.tool_calls, {"get_weather"})
    assert json.loads(choice.message.tool_calls[0].function.arguments) == {
        "city": "Paris", "unit": "c"
    }  # fmt: skip
    async with scripted.chat.completions.stream(**kwargs) as stream:
        async for _ in stream:
            pass
        final = await stream.get_final_completion()
    msg = final.choices[0].message
    assert final.choices[0].finish_reason == "tool_calls"
    assert msg.content == "Checking."
    assert [c.function.arguments for c in msg.tool_calls] == [
        c.function.arguments for c in choice.message.tool_calls
    ]
    # tool_choice none: the same text is plain content (the thought still split off)
    none = await scripted.chat.completions.create(**kwargs, tool_choice="none")
    assert none.choices[0].finish_reason == "stop"
    assert none.choices[0].message.content.startswith("Checking.<tool_call>")
    assert not none.choices[0].message.tool_calls


async def test_auto_with_a_malformed_call_falls_back_to_content(
    scripted: openai.AsyncOpenAI,
) -> None:
    r = await scripted.chat.completions.create(
        model="fake-model", messages=ASK, tools=TOOLS, max_tokens=60
    )  # cut inside the call's JSON by max_tokens
    choice = r.choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.content.startswith("Checking.<tool_call>")
    assert not choice.message.tool_calls

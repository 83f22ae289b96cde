"""Caps on client-chosen sizes (runtime/limits.py): enforced over REST and WebSocket, published in
/openapi.json with the same values; type errors in messages and WebSocket frames are 400s that
leave the socket open."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tandem.runtime import limits
from tandem.runtime.sampling_params import SamplingParams, SamplingParamsError
from tests.app.conftest import Harness
from tests.app.test_errors import expect_error

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
MSG = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("url", "body", "param"),
    [
        (COMP, {"prompt": "a", "stop_token_ids": [1] * (limits.MAX_STOP_TOKEN_IDS + 1)},
         "stop_token_ids"),
        (COMP, {"prompt": "a", "stop": ["x" * (limits.MAX_STOP_CHARS // 2 + 1)] * 2}, "stop"),
        (COMP, {"prompt": "a", "stop": ["x"] * (limits.MAX_STOP_STRINGS + 1)}, "stop"),
        (COMP, {"prompt": ["a"] * (limits.MAX_PROMPTS + 1)}, "prompt"),
        (CHAT, {"messages": MSG * (limits.MAX_MESSAGES + 1)}, "messages"),
        (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]
                              * (limits.MAX_CONTENT_PARTS + 1)}]}, "messages[0].content"),
        (CHAT, {"messages": [{"role": ["user"], "content": "a"}]}, "messages[0].role"),
        (CHAT, {"messages": [{"role": {"a": 1}, "content": "a"}]}, "messages[0].role"),
        (CHAT, {"messages": [{"role": "user", "content": "a", "name": 5}]}, "messages[0].name"),
        (CHAT, {"messages": MSG, "metadata": {"a": {"b": {"c": 1}}}}, "metadata.a"),
        (CHAT, {"messages": MSG, "metadata": {str(i): "v" for i in range(17)}}, "metadata"),
    ],
)  # fmt: skip
async def test_over_a_cap_or_of_the_wrong_type_is_a_400(
    harness: Harness, url: str, body: dict[str, Any], param: str
) -> None:
    # before: role as a list or object was a 500 (unhashable type); the others were accepted
    await expect_error(await harness.client.post(url, json=body), 400, param)


async def test_within_the_caps_is_accepted(harness: Harness) -> None:
    body = {
        "messages": [{"role": "user", "content": "a", "name": "bob"}],
        "metadata": {"k": "v"},
        "stop": ["x" * (limits.MAX_STOP_CHARS // 2)] * 2,
        "stop_token_ids": [1] * limits.MAX_STOP_TOKEN_IDS,
        "max_tokens": 2,
    }
    resp = await harness.client.post(CHAT, json=body)
    assert resp.status == 200, await resp.text()


def test_sampling_params_enforce_the_stop_caps() -> None:
    with pytest.raises(SamplingParamsError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=[0] * (limits.MAX_STOP_TOKEN_IDS + 1))
    with pytest.raises(SamplingParamsError, match="characters"):
        SamplingParams(stop=["y" * (limits.MAX_STOP_CHARS + 1)])


@pytest.mark.parametrize("kind", [["completions"], {"a": 1}, 3])
async def test_a_websocket_type_that_is_not_a_string_keeps_the_socket(
    harness: Harness, kind: Any
) -> None:
    async with harness.client.ws_connect("/v1/ws") as ws:
        await ws.send_json({"type": kind, "id": "x", "body": {"prompt": "a"}})
        msg = await asyncio.wait_for(ws.receive_json(), 5)
        # before: a raw HTTP 500 written onto the upgraded socket, which then closed
        assert msg["type"] == "error" and msg["error"]["param"] == "type"
        role = {"messages": [{"role": ["user"], "content": "a"}]}
        await ws.send_json({"type": "chat.completions", "id": "r", "body": role})
        msg = await asyncio.wait_for(ws.receive_json(), 5)
        assert msg["type"] == "error" and msg["error"]["param"] == "messages[0].role"
        await ws.send_json({"type": "completions", "id": "ok", "body": {"prompt": "a"}})
        while (msg := await asyncio.wait_for(ws.receive_json(), 5))["type"] == "delta":
            pass
        assert msg == {**msg, "type": "done", "id": "ok"}


async def test_the_openapi_document_states_the_validators_caps(harness: Harness) -> None:
    doc = await (await harness.client.get("/openapi.json")).json()
    schemas = doc["components"]["schemas"]
    chat, comp = schemas["ChatCompletionRequest"], schemas["CompletionRequest"]
    props = chat["properties"]
    assert props["stop_token_ids"]["maxItems"] == limits.MAX_STOP_TOKEN_IDS
    assert props["stop"]["oneOf"][1]["maxItems"] == limits.MAX_STOP_STRINGS
    assert props["messages"]["maxItems"] == limits.MAX_MESSAGES
    message = props["messages"]["items"]
    assert message["properties"]["name"] == {"type": "string", "maxLength": limits.MAX_NAME_CHARS}
    assert message["properties"]["content"]["oneOf"][1]["maxItems"] == limits.MAX_CONTENT_PARTS
    assert props["metadata"]["maxProperties"] == limits.MAX_METADATA_PAIRS
    assert props["metadata"]["additionalProperties"]["type"] == "string"  # no nesting
    prompt_lists = [s for s in comp["properties"]["prompt"]["oneOf"] if "maxItems" in s]
    assert [s["maxItems"] for s in prompt_lists] == [limits.MAX_PROMPTS] * 2
    # the smallest repetition_penalty the document allows is one the validator accepts
    rep = props["repetition_penalty"]
    assert not rep.get("exclusiveMinimum")
    SamplingParams(repetition_penalty=rep["minimum"])
    with pytest.raises(SamplingParamsError):
        SamplingParams(repetition_penalty=rep["minimum"] / 2)

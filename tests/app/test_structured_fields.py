"""Validation of the structured-output, tool and logit_bias fields: each bad value is a 400
naming the field, before anything reaches the engine."""

from __future__ import annotations

import pytest

from tests.app.conftest import Harness
from tests.app.test_errors import CHAT, COMP, MSG, expect_error

FN = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{"}}


@pytest.mark.parametrize(
    ("path", "extra", "param"),
    [
        (CHAT, {"tools": {"f": 1}}, "tools"),
        (CHAT, {"tools": [{"type": "function", "function": {}}]}, "tools[0].function.name"),
        (CHAT, {"tools": [{"type": "retrieval"}]}, "tools[0]"),
        (CHAT, {"tools": [FN, FN]}, "tools[1].function.name"),
        (CHAT, {"tools": [{"type": "function", "function": {"name": "g", "parameters": 3}}]},
         "tools[0].function.parameters"),
        (CHAT, {"tools": [FN], "tool_choice": "sometimes"}, "tool_choice"),
        (CHAT, {"tools": [FN], "tool_choice": {"type": "function", "function": {"name": "g"}}},
         "tool_choice.function.name"),
        (CHAT, {"tools": [FN], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        (CHAT, {"tools": [FN], "tool_choice": "required",
                "response_format": {"type": "json_object"}}, "response_format"),
        (CHAT, {"response_format": {"type": "yaml"}}, "response_format.type"),
        (CHAT, {"response_format": {"": None}}, "response_format.type"),  # OpenAI requires type
        (CHAT, {"response_format": "json"}, "response_format"),
        (CHAT, {"response_format": {"type": "json_schema", "json_schema": {"schema": 3}}},
         "response_format.json_schema.schema"),
        (COMP, {"guided_choice": []}, "guided_choice"),
        (COMP, {"guided_regex": 5}, "guided_regex"),
        (COMP, {"guided_json": "{not json"}, "guided_json"),
        (COMP, {"structured_outputs": ["regex"]}, "structured_outputs"),
        (COMP, {"structured_outputs": {"json_object": "yes"}}, "structured_outputs.json_object"),
        (COMP, {"logit_bias": {"abc": 1}}, "logit_bias"),
        (COMP, {"logit_bias": {"5": 100.5}}, "logit_bias"),
        (COMP, {"logit_bias": [1, 2]}, "logit_bias"),
        (CHAT, {"chat_template_kwargs": {"enable_thinking": "no"}},
         "chat_template_kwargs.enable_thinking"),
        (CHAT, {"chat_template_kwargs": {"add_generation_prompt": False}},
         "chat_template_kwargs.add_generation_prompt"),
        (CHAT, {"messages": [{"role": "assistant", "content": None, "tool_calls": [CALL]}]},
         "messages[0].tool_calls[0].function.arguments"),
        (CHAT, {"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, None),
        (CHAT, {"messages": [{"role": "user", "content": "x", "tool_calls": [CALL]}]},
         "messages[0].tool_calls"),
        (CHAT, {"messages": [{"role": "assistant", "content": "", "tool_calls": [{"x": 1}]}]},
         "messages[0].tool_calls[0]"),
    ],
)  # fmt: skip
async def test_bad_values_name_the_field(
    harness: Harness, path: str, extra: dict, param: str | None
) -> None:
    body = {"messages": MSG} if path == CHAT else {"prompt": "a"}
    body.update(extra)
    resp = await harness.client.post(path, json=body)
    if param is None:  # an empty tool_calls list on a user message is no call at all
        assert resp.status == 200, await resp.text()
        return
    await expect_error(resp, 400, param)


async def test_an_engine_without_grammars_refuses_constraints_clearly(harness: Harness) -> None:
    err = await expect_error(
        await harness.client.post(COMP, json={"prompt": "a", "guided_regex": "a+"}),
        400,
        "guided_regex",
    )
    assert "does not support structured outputs" in err["message"]

"""Every error the API answers: status code and OpenAI shape {"error": {message,type,param,code}}."""

from __future__ import annotations

from typing import Any

import pytest

from tests.app.conftest import Harness, MakeHarness
from tests.app.fake_engine import FakeEngine

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
MSG = [{"role": "user", "content": "hi"}]


async def expect_error(resp: Any, status: int, param: str | None = None) -> dict[str, Any]:
    assert resp.status == status, await resp.text()
    assert resp.content_type == "application/json"
    body = await resp.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


async def test_invalid_json_and_non_object(harness: Harness) -> None:
    await expect_error(await harness.client.post(CHAT, data=b"{nope"), 400)
    await expect_error(await harness.client.post(CHAT, json=[1, 2]), 400)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (CHAT, {"messages": MSG, "temperature": -1}, "temperature"),
        (CHAT, {"messages": MSG, "temperature": "hot"}, "temperature"),
        (CHAT, {"messages": MSG, "top_p": 0}, "top_p"),
        (CHAT, {"messages": MSG, "max_tokens": 0}, "max_tokens"),
        (CHAT, {"messages": MSG, "max_completion_tokens": "x"}, "max_completion_tokens"),
        (CHAT, {"messages": MSG, "presence_penalty": 3}, "presence_penalty"),
        (CHAT, {"messages": MSG, "stream": "yes"}, "stream"),
        (CHAT, {"messages": MSG, "top_logprobs": 2}, "top_logprobs"),
        (CHAT, {"messages": MSG, "stop": 5}, "stop"),
        (CHAT, {"messages": []}, "messages"),
        (CHAT, {}, "messages"),
        (CHAT, {"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
        (CHAT, {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        (CHAT, {"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
        (
            CHAT,
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages[0].content[0]",
        ),
        (COMP, {"prompt": ""}, "prompt"),
        (COMP, {"prompt": 5}, "prompt"),
        (COMP, {"prompt": [1, "a"]}, "prompt"),
        (COMP, {"prompt": [100000]}, "prompt"),
        (COMP, {"prompt": "a", "logprobs": "x"}, "logprobs"),
        (COMP, {"prompt": "a", "min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        # found by schemathesis: a field was ignored instead of checked
        (CHAT, {"messages": MSG, "max_completion_tokens": 4, "max_tokens": [5]}, "max_tokens"),
        # found by schemathesis: an out-of-range max_tokens beside a valid max_completion_tokens
        (CHAT, {"messages": MSG, "max_completion_tokens": 4, "max_tokens": 0}, "max_tokens"),
        (COMP, {"prompt": "a", "max_tokens": "16"}, "max_tokens"),
        (COMP, {"prompt": "a", "user": 0}, "user"),
        (CHAT, {"messages": MSG, "metadata": "x"}, "metadata"),
        (COMP, {"prompt": "a", "stream": True, "stream_options": {"": ""}}, "stream_options."),
        (COMP, {"prompt": "a", "stop_token_ids": False}, "stop_token_ids"),
        (COMP, {"prompt": "a", "seed": 2**64}, "seed"),
    ],
)
async def test_invalid_parameter_names_it(
    harness: Harness, path: str, body: dict, param: str
) -> None:
    err = await expect_error(await harness.client.post(path, json=body), 400, param)
    assert err["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("tool_choice", "auto"),  # without tools
        ("functions", [{"name": "f"}]),
        ("frobnicate", 1),
    ],
)
async def test_unsupported_fields_name_the_field(harness: Harness, field: str, value: Any) -> None:
    body = {"messages": MSG, field: value}
    await expect_error(await harness.client.post(CHAT, json=body), 400, field)


async def test_harmless_defaults_of_unsupported_fields_are_accepted(harness: Harness) -> None:
    body = {
        "messages": MSG,
        "max_tokens": 1,
        "response_format": {"type": "text"},
        "logit_bias": {},
        "tools": None,
        "user": "u1",
    }
    assert (await harness.client.post(CHAT, json=body)).status == 200


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": MSG, "n": 17}, "n"),
        ({"messages": MSG, "stop": [str(i) for i in range(17)]}, "stop"),
        ({"messages": MSG, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ],
)
async def test_caps(harness: Harness, body: dict, param: str) -> None:
    await expect_error(await harness.client.post(CHAT, json=body), 400, param)


async def test_prompt_list_cap(harness: Harness) -> None:
    await expect_error(await harness.client.post(COMP, json={"prompt": ["a"] * 65}), 400, "prompt")


async def test_unknown_model_404(harness: Harness) -> None:
    err = await expect_error(
        await harness.client.post(CHAT, json={"model": "gpt-9", "messages": MSG}), 404, "model"
    )
    assert err["code"] == "model_not_found"


async def test_context_length_states_both_numbers(harness: Harness) -> None:
    err = await expect_error(
        await harness.client.post(COMP, json={"prompt": "a" * 200, "max_tokens": 100}),
        400,
        "prompt",
    )
    assert "256" in err["message"] and "300" in err["message"]
    assert "200" in err["message"] and "100" in err["message"]
    # A chat prompt that alone fills the context, with max_tokens left to its default.
    err = await expect_error(
        await harness.client.post(
            CHAT, json={"messages": [{"role": "user", "content": "a" * 300}]}
        ),
        400,
        "messages",
    )
    assert err["code"] == "context_length_exceeded"


async def test_body_too_large_413(make_harness: MakeHarness) -> None:
    h = await make_harness(max_body_bytes=1024)
    resp = await h.client.post(COMP, json={"prompt": "a" * 5000})
    await expect_error(resp, 413)


async def test_unknown_route_404_and_wrong_method_405(harness: Harness) -> None:
    await expect_error(await harness.client.get("/v1/nothing"), 404)
    err = await expect_error(await harness.client.get(CHAT), 405)
    assert err["code"] == "method_not_allowed"


async def test_cancel_unknown_404(harness: Harness) -> None:
    await expect_error(
        await harness.client.post("/v1/requests/cmpl-nope/cancel"), 404, "request_id"
    )


async def test_engine_rejection_maps_to_400(make_harness: MakeHarness) -> None:
    engine = FakeEngine()
    engine.add_request = lambda *a, **k: (_ for _ in ()).throw(ValueError("engine says no"))
    h = await make_harness(engine)
    err = await expect_error(await h.client.post(COMP, json={"prompt": "a"}), 400)
    assert err["message"] == "engine says no"


async def test_engine_death_during_non_streamed_request_is_503(make_harness: MakeHarness) -> None:
    engine = FakeEngine()
    engine.fail_next_step = RuntimeError("boom")
    h = await make_harness(engine)
    err = await expect_error(await h.client.post(COMP, json={"prompt": "a"}), 503)
    assert err["code"] == "engine_dead" and "boom" not in err["message"]  # details: log only
    assert (await h.client.get("/health")).status == 503


async def test_empty_model_name_is_unknown_and_null_max_completion_tokens_is_unset(
    harness: Harness,
) -> None:
    await expect_error(
        await harness.client.post(COMP, json={"prompt": "a", "model": ""}), 404, "model"
    )
    resp = await harness.client.post(
        CHAT, json={"messages": MSG, "max_completion_tokens": None, "max_tokens": 3}
    )
    assert resp.status == 200
    assert (await resp.json())["usage"]["completion_tokens"] == 3

"""REST endpoints, non-streamed: chat, completions (every prompt form), models, ops endpoints."""

from __future__ import annotations

import math

from tests.app.conftest import Harness
from tests.app.fake_engine import REPLY


async def test_chat_completion_shape_and_usage(harness: Harness) -> None:
    body = {
        "model": "fake-model",
        "max_tokens": 5,
        "messages": [
            {"role": "system", "content": "be nice"},
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        ],
    }
    resp = await harness.client.post("/v1/chat/completions", json=body)
    assert resp.status == 200, await resp.text()
    data = await resp.json()
    assert data["object"] == "chat.completion" and data["id"].startswith("chatcmpl-")
    assert data["model"] == "fake-model"
    [choice] = data["choices"]
    assert choice == {
        "index": 0,
        "message": {"role": "assistant", "content": REPLY[:5]},
        "logprobs": None,
        "finish_reason": "length",
    }
    prompt = "<system>be nice\n<user>hi\n<assistant>"
    assert data["usage"] == {
        "prompt_tokens": len(prompt),
        "completion_tokens": 5,
        "total_tokens": len(prompt) + 5,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert harness.engine.added == [f"{data['id']}-0"]


async def test_chat_stop_string_and_default_max_tokens(harness: Harness) -> None:
    body = {
        "messages": [{"role": "user", "content": "x"}],
        "stop": [", this"],
        "max_completion_tokens": 50,
    }
    data = await (await harness.client.post("/v1/chat/completions", json=body)).json()
    assert data["choices"][0]["message"]["content"] == "hello world"
    assert data["choices"][0]["finish_reason"] == "stop"


async def test_chat_n_with_seed_gives_distinct_choices(harness: Harness) -> None:
    body = {"messages": [{"role": "user", "content": "x"}], "n": 2, "seed": 3, "max_tokens": 4}
    data = await (await harness.client.post("/v1/chat/completions", json=body)).json()
    texts = [c["message"]["content"] for c in data["choices"]]
    assert [c["index"] for c in data["choices"]] == [0, 1]
    assert texts == [REPLY[3:7], REPLY[4:8]]
    assert data["usage"]["completion_tokens"] == 8


async def test_chat_logprobs_shape(harness: Harness) -> None:
    body = {
        "messages": [{"role": "user", "content": "x"}],
        "max_tokens": 2,
        "logprobs": True,
        "top_logprobs": 2,
    }
    data = await (await harness.client.post("/v1/chat/completions", json=body)).json()
    content = data["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == ["h", "e"]
    first = content[0]
    assert first["bytes"] == [ord("h")] and math.isclose(first["logprob"], math.log(0.5))
    assert [t["token"] for t in first["top_logprobs"]] == ["h", "a"]
    assert set(first["top_logprobs"][0]) == {"token", "logprob", "bytes"}


async def test_completion_prompt_forms(harness: Harness) -> None:
    for prompt, num_prompts, prompt_tokens in [
        ("abc", 1, 3),
        (["ab", "cde"], 2, 5),
        ([97, 98], 1, 2),
        ([[97], [98, 99]], 2, 3),
    ]:
        resp = await harness.client.post(
            "/v1/completions", json={"model": "fake-model", "prompt": prompt, "max_tokens": 3}
        )
        assert resp.status == 200, await resp.text()
        data = await resp.json()
        assert data["object"] == "text_completion" and data["id"].startswith("cmpl-")
        assert [c["index"] for c in data["choices"]] == list(range(num_prompts))
        assert all(
            c["text"] == REPLY[:3] and c["finish_reason"] == "length" for c in data["choices"]
        )
        assert data["usage"] == {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": 3 * num_prompts,
            "total_tokens": prompt_tokens + 3 * num_prompts,
            "prompt_tokens_details": {"cached_tokens": 0},
        }


async def test_completion_logprobs_shape(harness: Harness) -> None:
    data = await (
        await harness.client.post(
            "/v1/completions", json={"prompt": "a", "max_tokens": 3, "logprobs": 1}
        )
    ).json()
    lp = data["choices"][0]["logprobs"]
    assert lp["tokens"] == ["h", "e", "l"]
    assert lp["text_offset"] == [0, 1, 2]
    assert len(lp["token_logprobs"]) == 3
    assert lp["top_logprobs"][0] == {"h": math.log(0.5)}


async def test_completion_default_max_tokens_is_16(harness: Harness) -> None:
    data = await (await harness.client.post("/v1/completions", json={"prompt": "a"})).json()
    assert data["usage"]["completion_tokens"] == 16


async def test_ignore_eos_and_min_tokens(make_harness) -> None:
    from tests.app.fake_engine import FakeEngine

    h = await make_harness(FakeEngine(eos_after=2))
    stopped = await (
        await h.client.post("/v1/completions", json={"prompt": "a", "max_tokens": 6})
    ).json()
    assert stopped["choices"][0]["finish_reason"] == "stop"
    assert stopped["choices"][0]["text"] == REPLY[:2]
    ignored = await (
        await h.client.post(
            "/v1/completions", json={"prompt": "a", "max_tokens": 6, "ignore_eos": True}
        )
    ).json()
    assert ignored["choices"][0]["text"] == REPLY[:6]


async def test_non_boolean_skip_special_tokens_is_a_400(harness: Harness) -> None:
    # it reached the detokenizer in the engine thread, whose TypeError killed the engine
    resp = await harness.client.post(
        "/v1/completions", json={"prompt": "a", "max_tokens": 2, "skip_special_tokens": 3}
    )
    assert resp.status == 400
    assert (await resp.json())["error"]["param"] == "skip_special_tokens"
    assert (await harness.client.get("/health")).status == 200


async def test_models(harness: Harness) -> None:
    data = await (await harness.client.get("/v1/models")).json()
    assert data["object"] == "list"
    assert data["data"][0]["id"] == "fake-model" and data["data"][0]["object"] == "model"


async def test_served_model_name(make_harness) -> None:
    h = await make_harness(served_model_name="my-alias")
    data = await (await h.client.get("/v1/models")).json()
    assert data["data"][0]["id"] == "my-alias"
    out = await (
        await h.client.post("/v1/completions", json={"model": "my-alias", "prompt": "a"})
    ).json()
    assert out["model"] == "my-alias"


async def test_health_metrics_openapi(harness: Harness) -> None:
    resp = await harness.client.get("/health")
    assert resp.status == 200 and (await resp.json()) == {"status": "ok"}
    await harness.client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2})
    text = await (await harness.client.get("/metrics")).text()
    for name in [
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_usage_perc",
        "prefix_cache_hits_total",
        "prefix_cache_queries_total",
        "num_preemptions_total",
        "prompt_tokens_total",
        "generation_tokens_total",
        "time_to_first_token_seconds_bucket",
        "inter_token_latency_seconds_bucket",
        "e2e_request_latency_seconds_bucket",
    ]:
        assert f"tandem:{name}" in text, name
    assert 'tandem:generation_tokens_total{model_name="fake-model"} 2' in text
    assert 'tandem:e2e_request_latency_seconds_count{model_name="fake-model"} 1' in text
    doc = await (await harness.client.get("/openapi.json")).json()
    assert doc["openapi"].startswith("3.")
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models"} <= set(doc["paths"])
    assert "messages" in doc["components"]["schemas"]["ChatCompletionRequest"]["properties"]

"""Failure isolation on the REAL engine (tiny random Llama): bad per-request values are refused
at admission, and a fault one request causes inside a step (its forward raises, its logits are
NaN, its detokenizer throws) fails that request alone while another stream runs to the end.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
import torch
from aiohttp.test_utils import TestClient, TestServer

import tandem.runtime.engine as engine_module
from tandem.app.config import ServerConfig
from tandem.app.server import create_app
from tandem.runtime.detokenizer import IncrementalDetokenizer
from tandem.runtime.engine import Engine
from tandem.runtime.loop import EngineLoop
from tests.app.tiny_engine import TinyTokenizer, make_tiny_engine

GOOD = {"prompt": "Hello world! The quick", "max_tokens": 40, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def tokenizer() -> TinyTokenizer:
    return TinyTokenizer()


@pytest.fixture
async def served(tokenizer: TinyTokenizer) -> AsyncIterator[tuple[TestClient, Engine]]:
    engine = make_tiny_engine(tokenizer, max_num_seqs=16)
    loop = EngineLoop(engine, max_queue=64, max_running=16)
    client = TestClient(TestServer(create_app(ServerConfig(), loop)))
    await client.start_server()
    yield client, engine
    await client.close()


async def still_serves(client: TestClient) -> None:
    """/health is 200 and an unrelated request completes."""
    assert (await client.get("/health")).status == 200
    resp = await client.post("/v1/completions", json={**GOOD, "max_tokens": 3})
    assert resp.status == 200, await resp.text()
    body = await resp.json()
    assert body["usage"]["completion_tokens"] == 3


async def read_stream(resp: Any) -> tuple[str, str | None, list[dict]]:
    text, finish, errors = "", None, []
    async for raw in resp.content:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if "error" in chunk:
            errors.append(chunk["error"])
            continue
        for c in chunk["choices"]:
            text += c["text"]
            finish = c["finish_reason"] or finish
    return text, finish, errors


@pytest.mark.parametrize("bad_id", ["vocab", 50000, 2**63 - 1])
async def test_stop_token_ids_outside_the_vocabulary_are_refused(served, bad_id) -> None:
    client, engine = served
    bad = engine.model_config.vocab_size if bad_id == "vocab" else bad_id
    body = {"prompt": "hi", "max_tokens": 5, "min_tokens": 1, "stop_token_ids": [bad]}
    resp = await client.post("/v1/completions", json=body)
    # before: 503 "engine failed: IndexError" and every later request 503
    assert resp.status == 400, await resp.text()
    err = (await resp.json())["error"]
    assert err["param"] == "stop_token_ids" and "vocabulary" in err["message"]
    ws = await client.ws_connect("/v1/ws")
    await ws.send_json({"type": "completions", "id": "a", "body": body})
    msg = await ws.receive_json(timeout=10)
    assert msg["type"] == "error" and msg["error"]["param"] == "stop_token_ids"
    await ws.close()
    await still_serves(client)


async def test_largest_seed_with_n_is_accepted(served) -> None:
    client, _ = served
    body = {"prompt": "hi", "max_tokens": 2, "n": 2, "seed": 2**64 - 1}
    resp = await client.post("/v1/completions", json=body)
    assert resp.status == 200, await resp.text()  # before: 400 naming seed 2**64
    assert len((await resp.json())["choices"]) == 2


async def _one_fails_while_another_streams(
    client: TestClient, bad_body: dict[str, Any]
) -> dict[str, Any]:
    """Start a greedy stream, send `bad_body` while it runs; the stream must end normally with
    the same text as alone; returns the bad request's error."""
    alone = await (await client.post("/v1/completions", json=GOOD)).json()
    stream = await client.post("/v1/completions", json={**GOOD, "stream": True})
    await stream.content.readuntil(b"\n\n")  # it runs
    bad = await client.post("/v1/completions", json=bad_body)
    text_rest, finish, errors = await read_stream(stream)
    assert errors == [] and finish == "length"
    assert alone["choices"][0]["text"].endswith(text_rest)
    assert bad.status == 500, await bad.text()
    err = (await bad.json())["error"]
    assert err["code"] == "request_failed"
    await still_serves(client)
    return err


async def test_a_forward_that_raises_for_one_request_fails_it_alone(served) -> None:
    client, engine = served
    marker = 7  # a token id only the bad prompt holds
    runner = engine.runner
    model = runner.model

    class RaisesOnMarker:
        def __call__(self, input_ids, positions, batch):
            if bool((input_ids == marker).any()):
                raise RuntimeError("kernel fault")
            return model(input_ids, positions, batch)

        def compute_logits(self, hidden):
            return model.compute_logits(hidden)

    runner.model = RaisesOnMarker()
    err = await _one_fails_while_another_streams(
        client, {"prompt": [marker, 8, 9], "max_tokens": 5}
    )
    assert "forward" in err["message"] and "kernel fault" not in err["message"]


async def test_a_sampler_row_of_nan_fails_only_its_request(served) -> None:
    client, engine = served
    sampler = engine.runner.sampler
    real = sampler.__call__

    def nan_for_seed_666(logits, rows):
        logits = logits.clone()
        for i, r in enumerate(rows):
            if r.params.seed == 666:
                logits[i] = float("nan")
        return real(logits, rows)

    engine.runner.sampler = nan_for_seed_666
    err = await _one_fails_while_another_streams(
        client, {"prompt": "Hello", "max_tokens": 5, "seed": 666, "temperature": 0.8}
    )
    assert "non-finite" in err["message"]


async def test_a_detokenizer_that_throws_fails_only_its_request(served, monkeypatch) -> None:
    client, _ = served

    class Throwing(IncrementalDetokenizer):
        def add_tokens(self, new_ids):
            if "@@boom@@" in self._stop:
                raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
            return super().add_tokens(new_ids)

    monkeypatch.setattr(engine_module, "IncrementalDetokenizer", Throwing)
    err = await _one_fails_while_another_streams(
        client, {"prompt": "Hello", "max_tokens": 5, "stop": ["@@boom@@"]}
    )
    assert "detokeniz" in err["message"]


async def test_a_streamed_request_that_fails_alone_gets_an_error_frame(served) -> None:
    client, engine = served
    sampler = engine.runner.sampler
    real = sampler.__call__

    def nan_rows(logits, rows):
        return real(torch.full_like(logits, float("nan")), rows)

    engine.runner.sampler = nan_rows
    resp = await client.post("/v1/completions", json={**GOOD, "stream": True})
    _, _, errors = await asyncio.wait_for(read_stream(resp), 30)
    assert [e["code"] for e in errors] == ["request_failed"]
    engine.runner.sampler = sampler
    await still_serves(client)

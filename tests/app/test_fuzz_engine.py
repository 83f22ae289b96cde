"""Property-based request bodies through the REAL engine (tiny random Llama, real scheduler,
sampler and detokenizer), combining parameters (min_tokens with stop_token_ids, logprobs with
n, penalties with seeds, stop strings with streaming ...), valid and invalid values alike.

Every case gets an answer below 500 (a 200 whose stream ends with [DONE] and no error, or an
OpenAI-shaped 4xx); after every case /health is 200 and an unrelated request completes; at
the end the engine is idle and no KV block leaked. 220 cases run by default, 2,000
in the slow suite.
"""

from __future__ import annotations

import asyncio
import collections
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import hypothesis.strategies as st
import pytest
import requests
from hypothesis import HealthCheck, Phase, given, settings

from tandem.app.config import ServerConfig
from tandem.app.serve import RunningServer, start_server
from tandem.runtime.engine import Engine
from tests.app.tiny_engine import TinyTokenizer, make_tiny_engine

TIMEOUT_S = 30.0
MAX_MODEL_LEN = 64


@dataclass
class Served:
    loop: asyncio.AbstractEventLoop
    running: RunningServer
    engine: Engine
    session: requests.Session

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.running.port}"

    def call(self, coro):  # noqa: ANN001, ANN201
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(TIMEOUT_S)


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="fuzz-server", daemon=True)
    thread.start()
    engine = make_tiny_engine(
        TinyTokenizer(), num_blocks=64, max_num_seqs=8, max_model_len=MAX_MODEL_LEN
    )
    running = asyncio.run_coroutine_threadsafe(
        start_server(ServerConfig(port=0, max_queue=64), engine), loop
    ).result(TIMEOUT_S)
    s = Served(loop, running, engine, requests.Session())
    try:
        yield s
    finally:
        s.call(running.shutdown(timeout=5))
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


VOCAB = 300  # about the tiny tokenizer's; ids past the real one are drawn on purpose
ints = st.integers
small_text = st.text(alphabet="ab <>/#\n\u00e9\u65e5🎉", min_size=0, max_size=6)
in_vocab = ints(0, VOCAB - 20)

# field -> (valid values, invalid or edge values); a body takes the second now and then
COMMON: dict[str, tuple[st.SearchStrategy[Any], st.SearchStrategy[Any]]] = {
    "max_tokens": (ints(1, 8), st.one_of(st.none(), ints(-1, 0), st.just(MAX_MODEL_LEN))),
    "min_tokens": (ints(0, 3), st.sampled_from([-1, 9])),
    "n": (ints(1, 3), st.one_of(ints(-1, 0), st.just(17))),
    "temperature": (st.one_of(st.just(0), st.floats(0, 2)), st.sampled_from([100, -0.5, 1e-9])),
    "top_p": (st.floats(0.01, 1), st.sampled_from([0, 1.5])),
    "top_k": (ints(-1, 50), ints(VOCAB - 5, VOCAB + 5)),
    "min_p": (st.floats(0, 1), st.just(1.5)),
    "seed": (ints(-(2**63), 2**64 - 1), st.sampled_from([2**64 - 1, -(2**63), 2**64])),
    "presence_penalty": (st.floats(-2, 2), st.just(2.5)),
    "frequency_penalty": (st.floats(-2, 2), st.just(-2.5)),
    "repetition_penalty": (st.floats(1e-6, 10), st.sampled_from([0, 1e-7, 11])),
    "stop_token_ids": (
        st.lists(in_vocab, max_size=4),
        st.lists(in_vocab, max_size=2).flatmap(
            lambda ids: st.sampled_from([VOCAB + 1, 49_152, 50_000, 2**63 - 1]).map(
                lambda bad: [*ids, bad]  # one id past the vocabulary, at least
            )
        ),
    ),
    "stop": (
        st.one_of(small_text.filter(bool), st.lists(small_text.filter(bool), max_size=4)),
        st.sampled_from(["", ["x"] * 17]),
    ),
    "ignore_eos": (st.booleans(), st.just("yes")),
    "skip_special_tokens": (st.booleans(), st.just(1)),
    "stream": (st.booleans(), st.just("true")),
    "stream_options": (st.just({"include_usage": True}), st.just({"x": 1})),
}
COMPLETION_ONLY = {
    "prompt": (
        st.one_of(
            small_text.filter(bool),
            st.lists(small_text.filter(bool), min_size=1, max_size=3),
            st.lists(in_vocab, min_size=1, max_size=6),
            st.lists(st.lists(in_vocab, min_size=1, max_size=4), min_size=1, max_size=3),
        ),
        st.one_of(st.just(""), st.just([]), st.lists(ints(-2, 2**63 - 1), min_size=1, max_size=3)),
    ),
    "logprobs": (ints(0, 5), st.sampled_from([-1, 21])),
}
CHAT_ONLY = {
    "messages": (
        st.lists(
            st.fixed_dictionaries(
                {"role": st.sampled_from(["system", "user", "assistant", "developer"]),
                 "content": small_text}
            ),
            min_size=1, max_size=3,
        ),
        st.one_of(st.just([]), st.just([{"role": ["user"], "content": "a"}]),
                  st.just([{"role": "tool", "content": "a"}])),
    ),
    "logprobs": (st.booleans(), st.just(3)),
    "top_logprobs": (ints(0, 5), st.just(21)),
}  # fmt: skip
# parameters whose combination the engine must survive; a body often takes one or two whole
COMBOS = [
    ("min_tokens", "stop_token_ids"),
    ("logprobs", "n"),
    ("logprobs", "top_logprobs", "n"),
    ("presence_penalty", "frequency_penalty", "repetition_penalty", "seed", "temperature"),
    ("seed", "n", "temperature"),
    ("stop", "stream", "min_tokens"),
    ("min_tokens", "ignore_eos", "stop_token_ids", "stream"),
]


@st.composite
def bodies(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    chat = draw(st.booleans())
    fields = {**COMMON, **(CHAT_ONLY if chat else COMPLETION_ONLY)}
    required = "messages" if chat else "prompt"
    names = set(draw(st.sets(st.sampled_from(sorted(set(fields) - {required})), max_size=5)))
    for combo in draw(st.lists(st.sampled_from(COMBOS), max_size=2)):
        names.update(n for n in combo if n in fields)
    if draw(ints(0, 19)):  # now and then the required field is missing
        names.add(required)
    # at most one field takes an invalid or edge value, so that most bodies reach the engine
    odd = draw(st.none() | st.sampled_from(sorted(names))) if names else None
    body = {}
    for name in sorted(names):
        valid, invalid = fields[name]
        body[name] = draw(invalid if name == odd else valid)
    body.setdefault("max_tokens", draw(ints(1, 4)))  # keep cases quick
    return ("/v1/chat/completions" if chat else "/v1/completions"), body


def _check_stream(resp: requests.Response) -> None:
    frames = [line for line in resp.iter_lines() if line]
    assert frames and frames[-1] == b"data: [DONE]", frames[-3:]
    assert not [f for f in frames if b'"error"' in f[:20]], frames[-3:]


def _unrelated_request_completes(served: Served) -> None:
    health = served.session.get(f"{served.base}/health", timeout=TIMEOUT_S)
    assert health.status_code == 200, health.text
    resp = served.session.post(
        f"{served.base}/v1/completions",
        json={"prompt": "Hello", "max_tokens": 1, "ignore_eos": True},
        timeout=TIMEOUT_S,
    )
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == 1


def _fuzz(served: Served, num_cases: int) -> collections.Counter[int]:
    seen: collections.Counter[int] = collections.Counter()

    @settings(
        max_examples=num_cases,
        deadline=None,
        database=None,
        derandomize=True,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=bodies())
    def run(case: tuple[str, dict[str, Any]]) -> None:
        url, body = case
        resp = served.session.post(
            f"{served.base}{url}", json=body, timeout=TIMEOUT_S, stream=bool(body.get("stream"))
        )
        seen[resp.status_code] += 1
        assert resp.status_code < 500, (body, resp.text[:500])
        if resp.status_code >= 400:
            err = resp.json()["error"]
            assert isinstance(err["message"], str) and err["message"], body
        elif body.get("stream"):
            _check_stream(resp)
        else:
            choices = resp.json()["choices"]
            assert choices and all(c["finish_reason"] in ("stop", "length") for c in choices)
        _unrelated_request_completes(served)

    run()
    served.call(asyncio.wait_for(served.running.engine_loop.wait_idle(), TIMEOUT_S))
    engine = served.engine
    assert not engine.has_unfinished_requests()
    pool = engine.scheduler.block_pool
    pool.check_invariants()
    assert pool.usage == 0.0
    return seen


def test_fuzzed_bodies_through_the_real_engine(served: Served) -> None:
    seen = _fuzz(served, 220)
    # both outcomes are exercised: bodies the engine ran, and bodies validation refused
    assert seen[200] >= 50 and seen[400] >= 40, seen


@pytest.mark.slow
def test_fuzzed_bodies_through_the_real_engine_2000(served: Served) -> None:
    seen = _fuzz(served, 2000)
    assert seen[200] >= 400 and seen[400] >= 400, seen

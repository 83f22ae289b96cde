"""Schemathesis against /openapi.json: 500 generated requests, valid and invalid, on a real
listening server around the FakeEngine. No 5xx, no hang (each call has a timeout), responses
conform to the document (status codes, content types, JSON and SSE schemas), requests that
violate the schema are refused, and the server is idle and healthy afterwards.

Requests valid by the schema may still be refused for reasons a schema cannot state (prompt +
max_tokens over max_model_len, token ids outside the vocabulary), so schemathesis'
positive-data-acceptance check is left out.
"""

from __future__ import annotations

import asyncio
import collections
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import positive_data_acceptance

from tandem.app.config import ServerConfig
from tandem.app.serve import RunningServer, start_server
from tests.app.fake_engine import FakeEngine

NUM_CASES = 500
CALL_TIMEOUT_S = 10.0  # a case that takes longer is a hang


@dataclass
class ThreadedServer:
    """A real listening server on its own event loop in a background thread."""

    loop: asyncio.AbstractEventLoop
    thread: threading.Thread
    running: RunningServer
    engine: FakeEngine

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.running.port}"

    def call(self, coro, timeout: float = 30):  # noqa: ANN001, ANN201
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)


@pytest.fixture
def threaded_server() -> Iterator[ThreadedServer]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="server-loop", daemon=True)
    thread.start()
    engine = FakeEngine(max_model_len=256, max_num_seqs=8)
    running = asyncio.run_coroutine_threadsafe(
        start_server(ServerConfig(port=0, max_queue=64), engine), loop
    ).result(30)
    server = ThreadedServer(loop, thread, running, engine)
    try:
        yield server
    finally:
        server.call(running.shutdown(timeout=5))
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def test_generated_requests_never_5xx_or_hang(threaded_server: ThreadedServer) -> None:
    base = threaded_server.base_url
    # /tokenize and /detokenize have their own tests (tests/app/test_conventions.py); here they
    # would take cases from the generation endpoints, whose coverage is asserted below.
    schema = schemathesis.openapi.from_url(f"{base}/openapi.json").exclude(
        path=["/tokenize", "/detokenize"]
    )
    strategy = schema.as_strategy(GenerationMode.POSITIVE) | schema.as_strategy(
        GenerationMode.NEGATIVE
    )
    seen: collections.Counter[tuple[str, int]] = collections.Counter()
    session = requests.Session()

    @settings(
        max_examples=NUM_CASES,
        deadline=None,
        database=None,
        derandomize=True,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=strategy)
    def run(case: schemathesis.Case) -> None:
        response = case.call_and_validate(
            base_url=base,
            session=session,
            timeout=CALL_TIMEOUT_S,
            excluded_checks=[positive_data_acceptance],
        )
        seen[(case.operation.label, response.status_code)] += 1
        assert response.status_code < 500, response.text[:500]
        if response.status_code >= 400:
            error = response.json()["error"]
            assert isinstance(error["message"], str) and error["message"]
            assert isinstance(error["type"], str)

    run()
    total = sum(seen.values())
    assert total >= NUM_CASES, seen
    by_status = collections.Counter()
    for (label, status), count in seen.items():
        by_status[(label.split()[-1], status // 100)] += count
    # the generator reached the engine, and the validator refused, on both generation endpoints
    for path in ("/v1/chat/completions", "/v1/completions"):
        assert by_status[(path, 2)] >= 10, seen
        assert by_status[(path, 4)] >= 10, seen

    engine, engine_loop = threaded_server.engine, threaded_server.running.engine_loop
    threaded_server.call(asyncio.wait_for(engine_loop.wait_idle(), CALL_TIMEOUT_S))
    assert engine_loop.num_admitted == 0 and engine_loop.request_ids() == []
    left = [(r.request_id, r.params) for r in engine.waiting + engine.running]
    assert not engine.has_unfinished_requests(), left
    health = session.get(f"{base}/health", timeout=CALL_TIMEOUT_S)
    assert health.status_code == 200 and health.json() == {"status": "ok"}

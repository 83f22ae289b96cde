"""Fixtures: an app built by the real factory around a FakeEngine, driven by aiohttp's client."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from tandem.app.config import ServerConfig
from tandem.app.server import create_app
from tandem.runtime.loop import EngineLoop
from tests.app.fake_engine import FakeEngine


@dataclass
class Harness:
    client: TestClient
    engine: FakeEngine
    loop: EngineLoop


MakeHarness = Callable[..., Awaitable[Harness]]


@pytest.fixture
async def make_harness() -> AsyncIterator[MakeHarness]:
    clients: list[TestClient] = []

    async def factory(
        engine: FakeEngine | None = None,
        setup: Callable[[web.Application], None] | None = None,
        **config: Any,
    ) -> Harness:
        engine = engine or FakeEngine()
        cfg = ServerConfig(**config)
        loop = EngineLoop(engine, max_queue=cfg.max_queue, max_running=engine.max_num_seqs)
        app = create_app(cfg, loop)
        if setup is not None:
            setup(app)
        client = TestClient(TestServer(app))
        await client.start_server()
        clients.append(client)
        return Harness(client, engine, loop)

    yield factory
    for client in clients:
        await client.close()


@pytest.fixture
async def harness(make_harness: MakeHarness) -> Harness:
    return await make_harness()

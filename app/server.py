"""The aiohttp app factory and its thin REST handlers.

`create_app(config, engine_loop)` wires routes, middlewares (errors, then auth), the engine
loop's lifetime (cleanup_ctx) and shutdown (close websockets, abort what still runs).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import orjson
from aiohttp import WSCloseCode, web

from tandem.app.auth import make_auth_middleware
from tandem.app.config import ServerConfig
from tandem.app.cors import Cors
from tandem.app.errors import APIError, error_middleware, json_response
from tandem.app.generation import start_generation
from tandem.app.http_guard import refuse_encoded_bodies
from tandem.app.metrics import metrics
from tandem.app.openapi import build_openapi
from tandem.app.protocol import Kind, parse_json_body
from tandem.app.sse import stream_sse
from tandem.app.state import STATE_KEY, ServerState, TokenText
from tandem.app.tokenize import detokenize, tokenize
from tandem.app.version import tandem_version
from tandem.app.webui import add_webui_routes
from tandem.app.ws import ws_handler
from tandem.runtime.loop import EngineDeadError, EngineLoop


async def _generate(request: web.Request, kind: Kind) -> web.StreamResponse:
    state = request.app[STATE_KEY]
    try:
        raw = await asyncio.wait_for(request.read(), state.config.body_timeout_s)
    except asyncio.TimeoutError:  # noqa: UP041 (py3.10: not the builtin)
        raise APIError(
            408, "The request body did not arrive in time", code="request_timeout"
        ) from None
    body = parse_json_body(raw)
    generation = await start_generation(state, kind, body, len(raw))
    if generation.request.stream:
        return await stream_sse(request, generation)
    try:
        return json_response(await generation.collect())
    except EngineDeadError as exc:
        raise APIError(503, str(exc), code="engine_dead") from None
    finally:
        generation.close()


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "chat")


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "completion")


def _model_card(state: ServerState) -> dict:
    return {
        "id": state.model_name,
        "object": "model",
        "created": state.created,
        "owned_by": "tandem",
        "root": state.engine_loop.model_name,
        "max_model_len": state.engine_loop.max_model_len,
    }


async def list_models(request: web.Request) -> web.Response:
    return json_response({"object": "list", "data": [_model_card(request.app[STATE_KEY])]})


async def retrieve_model(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    model_id = request.match_info["model_id"]
    if model_id not in state.model_names:
        raise APIError(
            404, f"The model {model_id!r} does not exist", param="model", code="model_not_found"
        )
    return json_response(_model_card(state))


async def version(request: web.Request) -> web.Response:
    return json_response({"version": tandem_version()})


async def cancel_request(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    request_id = request.match_info["request_id"]
    if not state.engine_loop.abort(request_id):
        raise APIError(
            404, f"No running request with id {request_id!r}", param="request_id", code="not_found"
        )
    return json_response({"id": request_id, "object": "request.cancelled", "cancelled": True})


async def health(request: web.Request) -> web.Response:
    loop = request.app[STATE_KEY].engine_loop
    if loop.dead:
        return json_response({"status": "dead"}, status=503)
    if loop.draining:
        return json_response({"status": "draining"}, status=503)
    return json_response({"status": "ok"})


async def openapi(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    return web.Response(
        body=orjson.dumps(build_openapi(state.model_names, bool(state.config.api_keys))),
        content_type="application/json",
    )


async def _engine_loop_ctx(app: web.Application) -> AsyncIterator[None]:
    loop = app[STATE_KEY].engine_loop
    await loop.start()
    yield
    await loop.stop()


async def _on_shutdown(app: web.Application) -> None:
    state = app[STATE_KEY]
    for request_id in state.engine_loop.request_ids():
        state.engine_loop.abort(request_id)  # open SSE streams end with finish_reason abort
    for ws in list(state.websockets):
        await ws.close(code=WSCloseCode.GOING_AWAY, message=b"server shutdown")


def create_app(config: ServerConfig, engine_loop: EngineLoop) -> web.Application:
    middlewares = [error_middleware, refuse_encoded_bodies]
    cors = Cors(config.allowed_origins) if config.allowed_origins else None
    if cors is not None:
        middlewares.append(cors.middleware())  # preflights carry no credentials: before auth
    if config.api_keys:
        middlewares.append(make_auth_middleware(config.api_keys))
    app = web.Application(middlewares=middlewares, client_max_size=config.max_body_bytes)
    if cors is not None:
        app.on_response_prepare.append(cors.on_response_prepare)
    app[STATE_KEY] = ServerState(config, engine_loop, TokenText(engine_loop.tokenizer))
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model_id}", retrieve_model)
    app.router.add_post("/v1/requests/{request_id}/cancel", cancel_request)
    app.router.add_get("/v1/ws", ws_handler)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/openapi.json", openapi)
    if config.web_ui:
        add_webui_routes(app)
    app.router.add_get("/version", version)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.cleanup_ctx.append(_engine_loop_ctx)
    app.on_shutdown.append(_on_shutdown)
    return app

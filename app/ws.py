"""WebSocket streaming at /v1/ws: several requests per socket, each with a client-chosen id.

Client → server: `{"type": "chat.completions" | "completions", "id": str, "body": {...}}` and
`{"type": "cancel", "id": str}`. Server → client: `{"type": "delta", "id", "chunk"}` (the SSE
chunk), then `{"type": "done", "id", "usage"}`; failures as `{"type": "error", "id", "error"}`.
Closing the socket aborts its requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import orjson
from aiohttp import WSMsgType, web

from tandem.app.errors import APIError, error_dict
from tandem.app.generation import Generation, start_generation
from tandem.app.protocol import Kind
from tandem.app.state import STATE_KEY, ServerState
from tandem.runtime.loop import EngineDeadError

logger = logging.getLogger(__name__)

_KINDS: dict[str, Kind] = {"chat.completions": "chat", "completions": "completion"}


class WSSession:
    """The requests running on one socket; sends are serialised by a lock."""

    def __init__(self, ws: web.WebSocketResponse, state: ServerState) -> None:
        self.ws = ws
        self.state = state
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.generations: dict[str, Generation] = {}
        # cancelled before their generation started: aborted as soon as it exists
        self.pending_cancel: set[str] = set()
        self._send_lock = asyncio.Lock()

    async def send(self, message: dict[str, Any]) -> None:
        if self.ws.closed:
            raise ConnectionResetError("websocket closed")
        async with self._send_lock:
            await self.ws.send_str(orjson.dumps(message).decode())

    async def send_error(self, client_id: Any, err: APIError) -> None:
        with contextlib.suppress(ConnectionResetError, OSError):
            await self.send({"type": "error", "id": client_id, "error": err.to_dict()["error"]})

    async def handle(self, raw: str) -> None:
        try:
            msg = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            await self.send_error(
                None, APIError(400, f"Invalid JSON message: {exc}", code="invalid_json")
            )
            return
        if not isinstance(msg, dict):
            await self.send_error(None, APIError(400, "A message must be a JSON object"))
            return
        client_id, kind = msg.get("id"), msg.get("type")
        if not isinstance(client_id, str) or not client_id:
            await self.send_error(
                client_id, APIError(400, "'id' must be a non-empty string", param="id")
            )
        elif not isinstance(kind, str):
            await self.send_error(
                client_id,
                APIError(400, f"'type' must be a string, got {type(kind).__name__}", param="type"),
            )
        elif kind == "cancel":
            gen = self.generations.get(client_id)
            if gen is not None:
                self.state.engine_loop.abort(gen.id)
            elif client_id in self.tasks:  # still being admitted: abort once it is
                self.pending_cancel.add(client_id)
            else:
                await self.send_error(
                    client_id,
                    APIError(
                        404,
                        f"No running request with id {client_id!r}",
                        param="id",
                        code="not_found",
                    ),
                )
        elif kind in _KINDS:
            if client_id in self.tasks:
                await self.send_error(
                    client_id,
                    APIError(
                        400, f"A request with id {client_id!r} is already running", param="id"
                    ),
                )
                return
            body = msg.get("body")
            if not isinstance(body, dict):
                await self.send_error(
                    client_id, APIError(400, "'body' must be an object", param="body")
                )
                return
            task = asyncio.create_task(self._run(client_id, _KINDS[kind], body, len(raw)))
            self.tasks[client_id] = task
        else:
            await self.send_error(
                client_id,
                APIError(
                    400,
                    f"Unknown message type {kind!r}; expected chat.completions, completions "
                    "or cancel",
                    param="type",
                ),
            )

    async def _run(self, client_id: str, kind: Kind, body: dict[str, Any], size: int) -> None:
        gen: Generation | None = None
        try:
            gen = await start_generation(self.state, kind, body, size)
            self.generations[client_id] = gen
            if client_id in self.pending_cancel:
                self.state.engine_loop.abort(gen.id)
            async for chunk in gen.chunks():
                await self.send({"type": "delta", "id": client_id, "chunk": chunk})
            await self.send({"type": "done", "id": client_id, "usage": gen.usage()})
        except APIError as err:
            await self.send_error(client_id, err)
        except EngineDeadError as exc:
            await self.send_error(client_id, APIError(503, str(exc), code="engine_dead"))
        except (ConnectionResetError, OSError):
            pass  # socket gone; close() below aborts
        except Exception:
            logger.exception("websocket request %s failed", client_id)
            with contextlib.suppress(ConnectionResetError, OSError):
                await self.send(
                    {
                        "type": "error",
                        "id": client_id,
                        "error": error_dict("internal error", "internal_server_error")["error"],
                    }
                )
        finally:
            if gen is not None:
                gen.close()
            self.generations.pop(client_id, None)
            self.pending_cancel.discard(client_id)
            self.tasks.pop(client_id, None)

    async def close(self) -> None:
        """The socket is gone: cancel every request task (each aborts its request)."""
        tasks = list(self.tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def ws_handler(request: web.Request) -> web.WebSocketResponse:
    state = request.app[STATE_KEY]
    ws = web.WebSocketResponse(
        heartbeat=state.config.ws_heartbeat_s, max_msg_size=state.config.max_body_bytes
    )
    await ws.prepare(request)
    state.websockets.add(ws)
    session = WSSession(ws, state)
    try:
        async for msg in ws:
            if msg.type in (WSMsgType.TEXT, WSMsgType.BINARY):
                data = (
                    msg.data if msg.type == WSMsgType.TEXT else msg.data.decode("utf-8", "replace")
                )
                try:
                    await session.handle(data)
                except (ConnectionResetError, OSError):
                    break
                except Exception:  # one bad message must not end the socket's other requests
                    logger.exception("websocket message failed")
                    await session.send_error(None, APIError(500, "internal error"))
            elif msg.type == WSMsgType.ERROR:
                break
    finally:
        await session.close()
        state.websockets.discard(ws)
    return ws

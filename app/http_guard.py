"""Connection-level protections around the app, below the handlers: idle, half-open and slow
connections time out; compressed request bodies are refused before a byte is inflated (on the
event loop, inflating even up to the size limit stalls every stream); a body the app refused
is not read after the answer; malformed HTTP gets an OpenAI-shaped 400 and one log line
instead of a traceback.

`GuardedAppRunner` is the `web.AppRunner` that `tandem serve` runs the app with;
`refuse_encoded_bodies` is a middleware of the app itself.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import orjson
from aiohttp import web
from aiohttp.typedefs import Handler
from aiohttp.web_protocol import RequestHandler

from tandem.app.errors import APIError

logger = logging.getLogger(__name__)


@web.middleware
async def refuse_encoded_bodies(request: web.Request, handler: Handler) -> web.StreamResponse:
    encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
    if encoding not in ("", "identity") and request.body_exists:
        raise APIError(
            415,
            f"request bodies with Content-Encoding {encoding!r} are not accepted; "
            "send the body uncompressed",
            param="Content-Encoding",
            code="unsupported_content_encoding",
        )
    return await handler(request)


class _GuardedHandler(RequestHandler):
    """Closes a connection whose first request has not arrived in full within the keep-alive
    timeout (aiohttp times out only the idle time between requests), and answers protocol
    errors in OpenAI's shape."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._first_request_timer = self._loop.call_later(
            self.keepalive_timeout, self._close_if_no_request
        )

    def _close_if_no_request(self) -> None:
        if self._request_count == 0 and not self._request_in_progress:
            logger.info("closing a connection that sent no complete request in time")
            self.force_close()

    def connection_lost(self, exc: BaseException | None) -> None:
        self._first_request_timer.cancel()
        super().connection_lost(exc)

    def handle_error(
        self,
        request: Any,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if status >= 500:
            logger.error("error handling a request from %s", request.remote, exc_info=exc)
            err = APIError(status, "internal error")
        else:  # a client's malformed request: one line, no traceback
            logger.info("bad HTTP request from %s: %s", request.remote, message or exc)
            err = APIError(status, f"Malformed HTTP request: {message or exc}", code="bad_request")
        if request.writer.output_size > 0:
            raise ConnectionError("the response has started; cannot answer the error")
        resp = web.Response(
            status=status, body=orjson.dumps(err.to_dict()), content_type="application/json"
        )
        resp.force_close()
        return resp


class _GuardedServer(web.Server):
    def __call__(self) -> RequestHandler:
        return _GuardedHandler(self, loop=self._loop, **self._kwargs)


class GuardedAppRunner(web.AppRunner):
    """`web.AppRunner` with the guards of this module. `idle_timeout`: seconds a connection may
    stay without a complete request (first or next) before it is closed."""

    def __init__(self, app: web.Application, *, idle_timeout: float, **kwargs: Any) -> None:
        # lingering_time 0: a request body the app did not read (a 413, a 401) is not drained
        # and inflated after the answer; the connection closes instead.
        super().__init__(app, keepalive_timeout=idle_timeout, lingering_time=0, **kwargs)

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _GuardedServer  # same state; only the protocol factory differs
        return server

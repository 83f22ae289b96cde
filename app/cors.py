"""CORS for browser front-ends on another origin (`--allowed-origins`): a middleware answers
preflight OPTIONS requests (ahead of auth, as browsers send them without credentials) and a
response-prepare hook marks every response to an allowed Origin, streamed ones included."""

from __future__ import annotations

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

_ALLOW_HEADERS = "Authorization, Content-Type"
_ALLOW_METHODS = "GET, POST, OPTIONS"


class Cors:
    def __init__(self, origins: tuple[str, ...]) -> None:
        self.any_origin = "*" in origins
        self.origins = frozenset(o.rstrip("/") for o in origins)

    def allowed(self, origin: str | None) -> bool:
        return origin is not None and (self.any_origin or origin.rstrip("/") in self.origins)

    def headers(self, origin: str) -> dict[str, str]:
        return {"Access-Control-Allow-Origin": "*" if self.any_origin else origin, "Vary": "Origin"}

    def middleware(self) -> Middleware:
        @web.middleware
        async def preflight(request: web.Request, handler: Handler) -> web.StreamResponse:
            if (
                request.method != "OPTIONS"
                or "Access-Control-Request-Method" not in request.headers
            ):
                return await handler(request)
            origin = request.headers.get("Origin")
            if origin is None or not self.allowed(origin):
                return web.Response(status=403, text="origin not allowed")
            return web.Response(
                status=204,
                headers={
                    **self.headers(origin),
                    "Access-Control-Allow-Methods": _ALLOW_METHODS,
                    "Access-Control-Allow-Headers": _ALLOW_HEADERS,
                    "Access-Control-Max-Age": "600",
                },
            )

        return preflight

    async def on_response_prepare(self, request: web.Request, response: web.StreamResponse) -> None:
        origin = request.headers.get("Origin")
        if origin is not None and self.allowed(origin):
            response.headers.update(self.headers(origin))

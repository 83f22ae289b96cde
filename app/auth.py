"""Bearer API-key auth: a middleware comparing the token in constant time against every key.

/health, /metrics and the Web UI's static files stay public (the page itself asks for the key).
With no keys configured, everything is public.
"""

from __future__ import annotations

import hmac
from collections.abc import Sequence

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from tandem.app.errors import APIError, error_response
from tandem.app.webui import is_webui_path

PUBLIC_PATHS = frozenset({"/health", "/metrics"})


def key_matches(token: str, keys: Sequence[bytes]) -> bool:
    """Compare against every key without stopping early, so timing reveals nothing."""
    candidate = token.encode("utf-8", "surrogateescape")
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(candidate, key)
    return matched


def make_auth_middleware(api_keys: Sequence[str]) -> Middleware:
    keys = [k.encode("utf-8") for k in api_keys]

    @web.middleware
    async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if (
            request.path in PUBLIC_PATHS
            or request.method == "OPTIONS"
            or is_webui_path(request.method, request.path)
        ):
            return await handler(request)
        header = request.headers.get("Authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not key_matches(token.strip(), keys):
            return error_response(
                APIError(
                    401,
                    "Invalid or missing API key; send 'Authorization: Bearer <key>'",
                    type_="invalid_request_error",
                    code="invalid_api_key",
                ),
                headers={"WWW-Authenticate": "Bearer"},
            )
        return await handler(request)

    return auth_middleware

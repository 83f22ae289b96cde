"""OpenAI-shaped errors: `APIError`, JSON responses via orjson, and the error middleware.

Every failure the server answers with is `{"error": {"message", "type", "param", "code"}}`,
including aiohttp's own 404 (no route), 405 (wrong method) and 413 (body too large).
"""

from __future__ import annotations

import logging
from typing import Any

import orjson
from aiohttp import web
from aiohttp.typedefs import Handler

logger = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    """An error answered to the client; `param` names the offending request field."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type_: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.headers = headers
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type_ or _TYPES.get(status, "invalid_request_error")

    def to_dict(self) -> dict[str, Any]:
        return error_dict(self.message, self.type, self.param, self.code)


def error_dict(
    message: str, type_: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def json_response(
    obj: Any, status: int = 200, headers: dict[str, str] | None = None
) -> web.Response:
    return web.Response(
        body=orjson.dumps(obj), status=status, headers=headers, content_type="application/json"
    )


def error_response(err: APIError, headers: dict[str, str] | None = None) -> web.Response:
    return json_response(err.to_dict(), status=err.status, headers=headers)


def _from_http_exception(exc: web.HTTPException, request: web.Request) -> web.Response:
    status = exc.status
    headers: dict[str, str] = {}
    if status == 404:
        err = APIError(404, f"Unknown route: {request.method} {request.path}", code="not_found")
    elif status == 405:
        allowed = ", ".join(sorted(getattr(exc, "allowed_methods", ()) or ()))
        err = APIError(
            405,
            f"Method {request.method} not allowed for {request.path}"
            + (f"; allowed: {allowed}" if allowed else ""),
            code="method_not_allowed",
        )
        if allowed:
            headers["Allow"] = allowed
    elif status == 413:
        err = APIError(
            413, f"Request body too large: {exc.text or ''}".strip(), code="request_too_large"
        )
    else:
        err = APIError(status, exc.reason or exc.text or "error", code=None)
    return error_response(err, headers)


def _unread_body_closes(request: web.Request, response: web.Response) -> web.Response:
    """A refusal before the body was read in full (413, 401, 408) ends the connection: the
    rest of the body is neither read nor inflated, and the client must not reuse it."""
    if request.body_exists and not request.content.is_eof():
        response.force_close()
    return response


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Turns APIError, aiohttp HTTP errors and unexpected exceptions into OpenAI errors."""
    try:
        response = await handler(request)
    except APIError as err:
        return _unread_body_closes(request, error_response(err, err.headers))
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return _unread_body_closes(request, _from_http_exception(exc, request))
    except (ConnectionResetError, OSError):
        raise  # the client is gone; nothing to answer
    except Exception:
        logger.exception("unhandled error on %s %s", request.method, request.path)
        return error_response(APIError(500, "Internal server error", code="internal_error"))
    if isinstance(response, web.Response) and response.status >= 400:  # e.g. auth's 401
        _unread_body_closes(request, response)
    return response

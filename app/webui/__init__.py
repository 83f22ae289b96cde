"""The Web UI: a chat page of plain HTML/CSS/JS files served at `/` (no build step).

The files live next to this module; `add_webui_routes` serves them, read once at start-up,
with a Content-Security-Policy that allows only this origin's scripts and styles.
"""

from __future__ import annotations

from pathlib import Path

from aiohttp import web

UI_PREFIX = "/ui/"
_DIR = Path(__file__).parent
_TYPES = {
    ".html": "text/html",
    ".js": "text/javascript",
    ".css": "text/css",
    ".svg": "image/svg+xml",
}
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)


def is_webui_path(method: str, path: str) -> bool:
    """Whether a request only fetches the page's static files (public even with API keys)."""
    return method in ("GET", "HEAD") and (path == "/" or path.startswith(UI_PREFIX))


def _load_files() -> dict[str, tuple[bytes, str]]:
    return {
        p.name: (p.read_bytes(), _TYPES[p.suffix])
        for p in sorted(_DIR.iterdir())
        if p.suffix in _TYPES
    }


def add_webui_routes(app: web.Application) -> None:
    files = _load_files()
    headers = {
        "Cache-Control": "no-cache",
        "Content-Security-Policy": CSP,
        "X-Content-Type-Options": "nosniff",
        "Referrer-Policy": "no-referrer",
    }

    def serve(name: str) -> web.Response:
        body, content_type = files[name]
        return web.Response(body=body, content_type=content_type, charset="utf-8", headers=headers)

    async def index(request: web.Request) -> web.Response:
        return serve("index.html")

    async def static(request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if name not in files:
            raise web.HTTPNotFound(text=f"no Web UI file {name!r}")
        return serve(name)

    app.router.add_get("/", index)
    app.router.add_get(UI_PREFIX + "{name}", static)

"""`GET /metrics` in the app layer: the engine loop's Prometheus text with a `model_name`
label added to every sample, as dashboards made for vLLM filter on it."""

from __future__ import annotations

from aiohttp import web

from tandem.app.state import STATE_KEY


def add_label(text: str, name: str, value: str) -> str:
    """Every sample line of Prometheus exposition `text` with `name="value"` added first."""
    escaped = value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    label = f'{name}="{escaped}"'
    out = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            out.append(line)
            continue
        brace, space = line.find("{"), line.find(" ")
        if brace != -1 and (space == -1 or brace < space):
            rest = line[brace + 1 :]
            sep = "" if rest.startswith("}") else ","
            out.append(f"{line[: brace + 1]}{label}{sep}{rest}")
        else:
            out.append(f"{line[:space]}{{{label}}}{line[space:]}")
    return "\n".join(out) + ("\n" if text.endswith("\n") else "")


async def metrics(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    text = add_label(state.engine_loop.render_metrics(), "model_name", state.model_name)
    return web.Response(
        text=text,
        content_type="text/plain",
        charset="utf-8",
        headers={"X-Prometheus-Format": "0.0.4"},
    )

"""The Web UI's serving: `/` and `/ui/*` with a strict CSP, public under API keys, off with
--no-ui, and every file the page loads present in the package."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from tandem.app import webui as app_webui
from tandem.app.serve import add_serve_arguments, server_config_from_args
from tests.app.conftest import MakeHarness

UI_DIR = Path(app_webui.__file__).parent


async def test_page_and_files_are_served_with_a_csp(make_harness: MakeHarness) -> None:
    client = (await make_harness()).client
    resp = await client.get("/")
    assert resp.status == 200 and resp.content_type == "text/html"
    csp = resp.headers["Content-Security-Policy"]
    assert "script-src 'self'" in csp and "default-src 'none'" in csp
    assert "unsafe-inline" not in csp
    html = await resp.text()
    for name in re.findall(r'(?:src|href)="/ui/([^"]+)"', html):
        file = await client.get(f"/ui/{name}")
        assert file.status == 200, name
        assert file.headers["X-Content-Type-Options"] == "nosniff"
    js = await client.get("/ui/app.js")
    assert js.content_type == "text/javascript"
    # app.js imports its modules by relative path: each must be served
    for module in re.findall(r'from "\./([\w.]+)"', (UI_DIR / "app.js").read_text()):
        assert (await client.get(f"/ui/{module}")).status == 200, module
    missing = await client.get("/ui/nope.js")
    assert missing.status == 404
    assert (await client.get("/ui/..%2Fserver.py")).status == 404


async def test_page_is_public_but_the_api_is_not(make_harness: MakeHarness) -> None:
    client = (await make_harness(api_keys=("k",))).client
    assert (await client.get("/")).status == 200
    assert (await client.get("/ui/style.css")).status == 200
    assert (await client.get("/v1/models")).status == 401
    assert (await client.post("/")).status == 401  # only reads are public
    ok = await client.get("/v1/models", headers={"Authorization": "Bearer k"})
    assert ok.status == 200


async def test_no_ui(make_harness: MakeHarness) -> None:
    client = (await make_harness(web_ui=False)).client
    assert (await client.get("/")).status == 404
    assert (await client.get("/ui/app.js")).status == 404
    assert (await client.get("/health")).status == 200


def test_no_ui_flag() -> None:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    assert server_config_from_args(parser.parse_args([]), environ={}).web_ui is True
    args = parser.parse_args(["--no-ui"])
    assert server_config_from_args(args, environ={}).web_ui is False


def test_package_data_ships_the_page() -> None:
    text = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    patterns = re.search(r'^"tandem.app" = \[(.*)\]$', text, re.M).group(1)
    shipped = {p.strip().strip('"').split("*")[1] for p in patterns.split(",")}
    for path in UI_DIR.iterdir():
        if path.suffix != ".py" and path.is_file():
            assert path.suffix in shipped, f"{path.name} is not in the package data"

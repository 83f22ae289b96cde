"""`vllm serve` habits: CLI flags, /version, /tokenize, /detokenize, GET /v1/models/{id} (the
openai client's `models.retrieve`), CORS, the server's default max_tokens, the model_name label
on /metrics, and one error line with exit code 2 for a busy port or a bad model path."""

from __future__ import annotations

import argparse
import logging
import re
import socket
import subprocess
import sys
from pathlib import Path

import openai
import pytest

from tandem.app.cli import build_parser
from tandem.app.config import ServerConfig
from tandem.app.metrics import add_label
from tandem.app.serve import start_server
from tandem.app.version import tandem_version
from tests.app.conftest import MakeHarness
from tests.app.fake_engine import FakeEngine

ROOT = Path(__file__).resolve().parents[2]
MSG = [{"role": "user", "content": "hi"}]


def run_tandem(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tandem.app.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )


# ---- CLI ----------------------------------------------------------------------------------


def _serve_args(*argv: str) -> argparse.Namespace:
    from tandem.app.serve import resolve_model_argument

    args = build_parser().parse_args(["serve", *argv])
    resolve_model_argument(args)
    return args


def test_model_is_positional_or_dash_m() -> None:
    assert _serve_args("./m.gguf").model == "./m.gguf"
    assert _serve_args("-m", "./m.gguf").model == "./m.gguf"
    assert _serve_args("--port", "1", "./m.gguf", "--seed", "3").model == "./m.gguf"
    assert _serve_args().model is None
    with pytest.raises(ValueError, match="given twice"):
        _serve_args("a.gguf", "--model", "b.gguf")


def test_serve_flags_reach_the_configs(tmp_path: Path) -> None:
    from tandem.app.serve import server_config_from_args

    template = tmp_path / "t.jinja"
    template.write_text("{{ messages[0].content }}")
    args = _serve_args(
        "m", "--tokenizer", "tok", "--chat-template", str(template), "--seed", "7",
        "--allowed-origins", "http://a.example,http://b.example/", "--allowed-origins", "*",
        "--max-tokens-default", "0", "--stream-wakeups", "0", "--engine-process",
    )  # fmt: skip
    cfg = server_config_from_args(args, environ={})
    spec = cfg.engine.model
    assert (spec.model, spec.tokenizer_path, spec.seed, cfg.engine.seed) == ("m", "tok", 7, 7)
    assert spec.chat_template == "{{ messages[0].content }}"
    assert cfg.allowed_origins == ("http://a.example", "http://b.example", "*")
    assert cfg.max_tokens_default is None  # 0: up to the end of the context
    assert cfg.engine.scheduler.max_model_len is None  # the model's own
    defaults = server_config_from_args(_serve_args(), environ={})
    assert defaults.max_tokens_default == ServerConfig.max_tokens_default == 1024
    assert cfg.stream_wakeups is None and defaults.stream_wakeups == 8000  # 0: no pacing
    assert cfg.engine_process is True and defaults.engine_process is None  # None: by device
    inline = _serve_args("--chat-template", "{{ x }}")
    assert server_config_from_args(inline, environ={}).engine.model.chat_template == "{{ x }}"
    with pytest.raises(FileNotFoundError, match="--chat-template file"):
        server_config_from_args(_serve_args("--chat-template", "nope.jinja"), environ={})


def test_version_and_help_show_defaults() -> None:
    proc = run_tandem("--version")
    assert proc.returncode == 0 and proc.stdout.strip() == f"tandem {tandem_version()}"
    help_text = " ".join(run_tandem("serve", "--help").stdout.split())
    for shown in (
        "--port PORT port to listen on (default: 8000)",
        "(default: 127.0.0.1)",
        "--max-tokens-default MAX_TOKENS_DEFAULT",
        "(default: 1024)",
        "(default: the model's own",
        "--max-num-seqs MAX_NUM_SEQS sequences decoded together in one step (default: 64)",
    ):
        assert shown in help_text, shown
    assert "(default: None)" not in help_text


def test_busy_port_is_one_error_line_and_exit_2() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = run_tandem("serve", "--port", str(port))
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert lines == [
        f"tandem: error: cannot listen on 127.0.0.1:{port}: the address is already in use "
        "(another server? pick one with --port)"
    ]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["serve", "/no/such/model"], "model path '/no/such/model' does not exist"),
        (["serve", "--port", "0", "-m", "README.md"], "is a file but not a .gguf file"),
        (["serve", "a", "-m", "b"], "the model is given twice"),
        (["serve", "--port", "0", "--max-model-len", "100000"], "is more than this model allows"),
    ],
)
def test_bad_model_is_one_error_line_and_exit_2(argv: list[str], message: str) -> None:
    proc = run_tandem(*argv)
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if line.startswith("tandem: error:")]
    assert len(errors) == 1 and message in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr


# ---- endpoints ----------------------------------------------------------------------------


async def test_models_retrieve_with_the_openai_client() -> None:
    engine = FakeEngine(max_model_len=512)
    running = await start_server(ServerConfig(port=0, served_model_name="my-model"), engine)
    try:
        client = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{running.port}/v1", api_key="x", max_retries=0
        )
        model = await client.models.retrieve("my-model")
        assert (model.id, model.object, model.owned_by) == ("my-model", "model", "tandem")
        assert model.model_extra["max_model_len"] == 512
        assert (await client.models.retrieve("fake-model")).id == "my-model"  # the engine's own
        with pytest.raises(openai.NotFoundError):
            await client.models.retrieve("other")
    finally:
        await running.shutdown(timeout=5)


async def test_version_tokenize_detokenize(make_harness: MakeHarness) -> None:
    c = (await make_harness()).client
    assert await (await c.get("/version")).json() == {"version": tandem_version()}
    got = await (await c.post("/tokenize", json={"prompt": "Hi!"})).json()
    assert got == {"tokens": [72, 105, 33], "count": 3, "max_model_len": 256}
    special = await c.post("/tokenize", json={"prompt": "a", "add_special_tokens": True})
    assert (await special.json())["tokens"] == [1, 97]
    chat = await (await c.post("/tokenize", json={"messages": MSG})).json()
    rendered = "<user>hi?<assistant>"  # the fake tokenizer reads a newline as "?"
    assert chat["tokens"] == [ord(ch) for ch in rendered]
    back = await (await c.post("/detokenize", json={"tokens": chat["tokens"]})).json()
    assert back == {"prompt": rendered}
    for path, body, param in [
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": "a", "messages": MSG}, "prompt"),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {"prompt": "a", "add_special_tokens": "yes"}, "add_special_tokens"),
        ("/tokenize", {"prompt": "a", "colour": 1}, "colour"),
        ("/tokenize", {"messages": []}, "messages"),
        ("/detokenize", {"tokens": [1, 1000]}, "tokens"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
    ]:
        resp = await c.post(path, json=body)
        assert resp.status == 400, (path, body)
        assert (await resp.json())["error"]["param"] == param, (path, body)
    resp = await c.post("/tokenize", json={"model": "other", "prompt": "a"})
    assert resp.status == 404


async def test_default_max_tokens_caps_requests_without_one(make_harness: MakeHarness) -> None:
    c = (await make_harness(FakeEngine(max_model_len=256), max_tokens_default=5)).client

    async def tokens(body: dict) -> int:
        resp = await c.post("/v1/chat/completions", json={"messages": MSG, **body})
        assert resp.status == 200, await resp.text()
        return (await resp.json())["usage"]["completion_tokens"]

    assert await tokens({}) == 5
    assert await tokens({"max_tokens": None}) == 5
    assert await tokens({"max_tokens": 9}) == 9  # a request's own value is not capped
    uncapped = (await make_harness(FakeEngine(max_model_len=64), max_tokens_default=None)).client
    resp = await uncapped.post("/v1/chat/completions", json={"messages": MSG})
    prompt = len("<user>hi\n<assistant>")
    assert (await resp.json())["usage"]["completion_tokens"] == 64 - prompt


async def test_cors(make_harness: MakeHarness) -> None:
    origin = "http://ui.example"
    h = await make_harness(allowed_origins=(origin,), api_keys=("k",))
    c = h.client
    pre = await c.options(
        "/v1/chat/completions",
        headers={"Origin": origin, "Access-Control-Request-Method": "POST"},
    )
    assert pre.status == 204  # answered before auth: a preflight carries no credentials
    assert pre.headers["Access-Control-Allow-Origin"] == origin
    assert "Authorization" in pre.headers["Access-Control-Allow-Headers"]
    denied = await c.options(
        "/v1/models",
        headers={"Origin": "http://evil.example", "Access-Control-Request-Method": "GET"},
    )
    assert denied.status == 403 and "Access-Control-Allow-Origin" not in denied.headers
    auth = {"Authorization": "Bearer k", "Origin": origin}
    models = await c.get("/v1/models", headers=auth)
    assert models.status == 200 and models.headers["Access-Control-Allow-Origin"] == origin
    stream = await c.post(
        "/v1/chat/completions",
        json={"messages": MSG, "max_tokens": 2, "stream": True},
        headers=auth,
    )
    assert stream.headers["Access-Control-Allow-Origin"] == origin  # a streamed answer too
    await stream.read()
    other = await c.get("/v1/models", headers={**auth, "Origin": "http://evil.example"})
    assert "Access-Control-Allow-Origin" not in other.headers
    plain = (await make_harness()).client  # no --allowed-origins: no CORS headers at all
    resp = await plain.get("/v1/models", headers={"Origin": origin})
    assert "Access-Control-Allow-Origin" not in resp.headers


async def test_every_metric_sample_has_the_model_name(make_harness: MakeHarness) -> None:
    c = (await make_harness(served_model_name="served")).client
    await c.post("/v1/completions", json={"prompt": "a", "max_tokens": 2})
    text = await (await c.get("/metrics")).text()
    samples = [line for line in text.splitlines() if line and not line.startswith("#")]
    assert samples and all('{model_name="served"' in line for line in samples)
    assert 'tandem:request_success_total{model_name="served",finished_reason="length"} 1' in text


def test_add_label() -> None:
    text = '# HELP a x\na 1\nb{le="0.1"} 2\nc{} 3\n'
    assert add_label(text, "model_name", 'q"m') == (
        '# HELP a x\na{model_name="q\\"m"} 1\nb{model_name="q\\"m",le="0.1"} 2\n'
        'c{model_name="q\\"m"} 3\n'
    )


def test_progress_lines_show_without_verbose_and_phases_with_it() -> None:
    from tandem.app.cli import log_filter

    def record(level: int, **extra: object) -> logging.LogRecord:
        rec = logging.LogRecord("x", level, __file__, 1, "msg", None, None)
        rec.__dict__.update(extra)
        return rec

    quiet, verbose = log_filter(False), log_filter(True)
    assert quiet(record(logging.WARNING)) and quiet(record(logging.INFO, progress=True))
    assert not quiet(record(logging.INFO))  # e.g. a start-up phase: -v only
    assert verbose(record(logging.INFO))


def test_startup_phase_names_the_phase_and_its_duration(caplog) -> None:
    from tandem.runtime.startup import startup_phase

    with caplog.at_level(logging.INFO, logger="tandem.runtime.startup"), startup_phase("weights"):
        pass
    assert re.search(r"start-up: weights done in \d+\.\d\ds", caplog.text)

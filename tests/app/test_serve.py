"""`tandem serve` plumbing: arguments → ServerConfig, and SIGTERM drain in a real process."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import re
import shutil
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp

from tandem.app.serve import add_serve_arguments, server_config_from_args

ROOT = Path(__file__).resolve().parents[2]


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return parser.parse_args(argv)


def test_arguments_build_the_config() -> None:
    args = parse(
        [
            "--model",
            "m.gguf",
            "--port",
            "9001",
            "--api-key",
            "a",
            "--api-key",
            "b",
            "--max-num-seqs",
            "8",
            "--max-model-len",
            "1024",
            "--max-queue",
            "5",
            "--block-size",
            "32",
            "--num-kv-blocks",
            "100",
            "--dtype",
            "float32",
            "--max-num-batched-tokens",
            "512",
            "--served-model-name",
            "alias",
            "--shutdown-timeout",
            "2.5",
        ]
    )
    cfg = server_config_from_args(args, environ={"TANDEM_API_KEY": "c"})
    assert cfg.api_keys == ("a", "b", "c")
    assert (cfg.host, cfg.port, cfg.max_queue, cfg.shutdown_timeout) == ("127.0.0.1", 9001, 5, 2.5)
    assert cfg.served_model_name == "alias"
    assert cfg.engine.model.model == "m.gguf" and cfg.engine.model.dtype == "float32"
    assert (cfg.engine.cache.block_size, cfg.engine.cache.num_blocks) == (32, 100)
    s = cfg.engine.scheduler
    assert (s.max_num_seqs, s.max_model_len, s.max_num_batched_tokens) == (8, 1024, 512)
    assert server_config_from_args(parse([]), environ={}).api_keys == ()


SERVER_SCRIPT = """
import asyncio, logging, sys
sys.path.insert(0, {root!r})
logging.basicConfig(level=logging.INFO)
from tandem.app.config import ServerConfig
from tandem.app.serve import serve_until_signal
from tests.app.fake_engine import FakeEngine
sys.exit(asyncio.run(serve_until_signal(ServerConfig(port=0, shutdown_timeout=1.0),
                                        FakeEngine(step_delay=0.01))))
"""


@contextlib.asynccontextmanager
async def _spawned(*argv: str) -> AsyncIterator[asyncio.subprocess.Process]:
    """`argv` as a child process (stderr piped, cwd the repository), killed on the way out if it
    is still running."""
    proc = await asyncio.create_subprocess_exec(
        *argv, stderr=asyncio.subprocess.PIPE, cwd=str(ROOT)
    )
    try:
        yield proc
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def _listening_at(proc: asyncio.subprocess.Process) -> str:
    """The base URL the server script logs once it listens (its stderr, 30 s a line)."""
    while True:
        line = (await asyncio.wait_for(proc.stderr.readline(), 30)).decode()
        assert line, "server exited before listening"
        if m := re.search(r"http://127\.0\.0\.1:(\d+)", line):
            return f"http://127.0.0.1:{m.group(1)}"


async def _signal_mid_stream(
    http: aiohttp.ClientSession,
    base: str,
    proc: asyncio.subprocess.Process,
    sig: int,
    max_tokens: int,
) -> tuple[aiohttp.ClientResponse, aiohttp.ClientResponse]:
    """A streamed completion with its first event read, then `sig` to the server: the stream's
    response and the first /health answer once the signal is handled (503; bounded poll)."""
    resp = await http.post(
        f"{base}/v1/completions",
        json={"prompt": "a", "max_tokens": max_tokens, "stream": True},
    )
    assert (await resp.content.readuntil(b"\n\n")).startswith(b"data: {")
    proc.send_signal(sig)
    for _ in range(2000):
        health = await http.get(f"{base}/health")
        if health.status == 503:
            break
        await asyncio.sleep(0.005)
    return resp, health


async def test_sigterm_drains_then_aborts_and_exits_zero() -> None:
    async with _spawned(sys.executable, "-c", SERVER_SCRIPT.format(root=str(ROOT))) as proc:
        base = await _listening_at(proc)
        async with aiohttp.ClientSession() as http:
            resp, health = await _signal_mid_stream(http, base, proc, signal.SIGTERM, 200)
            assert (await health.json()) == {"status": "draining"}
            refused = await http.post(f"{base}/v1/completions", json={"prompt": "a"})
            assert refused.status == 503
            rest = await resp.read()
            assert b'"finish_reason":"abort"' in rest and rest.endswith(b"data: [DONE]\n\n")
        assert await asyncio.wait_for(proc.wait(), 30) == 0


async def test_a_second_signal_aborts_the_drain_now() -> None:
    script = SERVER_SCRIPT.replace("shutdown_timeout=1.0", "shutdown_timeout=120.0").replace(
        "step_delay=0.01", "step_delay=0.2"
    )
    async with _spawned(sys.executable, "-c", script.format(root=str(ROOT))) as proc:
        base = await _listening_at(proc)
        async with aiohttp.ClientSession() as http:
            # 250 tokens: ~50 s of steps, far longer than the test waits
            resp, _ = await _signal_mid_stream(http, base, proc, signal.SIGINT, 250)
            proc.send_signal(signal.SIGINT)  # before: ignored, the drain ran its 120 s
            rest = await asyncio.wait_for(resp.read(), 10)
            assert b'"finish_reason":"abort"' in rest and rest.endswith(b"data: [DONE]\n\n")
        assert await asyncio.wait_for(proc.wait(), 10) == 0


def _tandem_command() -> list[str]:
    """The installed console script, else the same entry point through this interpreter."""
    script = shutil.which("tandem")
    if script is not None:
        return [script]
    return [sys.executable, "-c", "import sys; from app.cli import main; sys.exit(main())"]


async def test_tandem_serve_without_model_serves_the_default_model() -> None:
    argv = [*_tandem_command(), "serve", "--port", "0", "--shutdown-timeout", "2"]
    async with _spawned(*argv) as proc:
        port = None
        for _ in range(200):  # log lines until the listening one (bounded)
            line = (await asyncio.wait_for(proc.stderr.readline(), 120)).decode()
            assert line, "tandem serve exited before listening"
            if m := re.search(r"serving (\S+) on http://127\.0\.0\.1:(\d+)", line):
                assert m.group(1) == "smollm2-135m-instruct"
                port = int(m.group(2))
                break
        assert port is not None
        base = f"http://127.0.0.1:{port}"
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{base}/health") as health:
                assert health.status == 200
            async with http.get(f"{base}/v1/models") as models:
                assert [m["id"] for m in (await models.json())["data"]] == ["smollm2-135m-instruct"]
            async with http.post(
                f"{base}/v1/chat/completions",
                json={
                    "messages": [{"role": "user", "content": "What is the capital of France?"}],
                    "max_tokens": 8,
                    "temperature": 0,
                },
            ) as resp:
                assert resp.status == 200, await resp.text()
                body = await resp.json()
        choice = body["choices"][0]
        assert choice["message"]["role"] == "assistant" and choice["message"]["content"]
        assert body["model"] == "smollm2-135m-instruct"
        assert 1 <= body["usage"]["completion_tokens"] <= 8
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 30) == 0


DYING_SCRIPT = """
import asyncio, logging, sys
sys.path.insert(0, {root!r})
logging.basicConfig(level=logging.INFO)  # the ready line is INFO
from tandem.app.config import ServerConfig
from tandem.app.serve import serve_until_signal
from tests.app.fake_engine import FakeEngine

class Dying(FakeEngine):
    def step(self):
        if self.num_steps >= 5:
            raise RuntimeError("secret internal detail")
        return super().step()

sys.exit(asyncio.run(serve_until_signal(ServerConfig(port=0), Dying(step_delay=0.01))))
"""


async def test_an_engine_failure_ends_streams_generically_and_exits_non_zero() -> None:
    from tandem.app.serve import ENGINE_DEAD_EXIT

    async with _spawned(sys.executable, "-c", DYING_SCRIPT.format(root=str(ROOT))) as proc:
        base = await _listening_at(proc)
        async with aiohttp.ClientSession() as http:
            resp = await http.post(
                f"{base}/v1/completions", json={"prompt": "a", "max_tokens": 200, "stream": True}
            )
            rest = await asyncio.wait_for(resp.read(), 30)
            assert b"engine_dead" in rest and rest.endswith(b"data: [DONE]\n\n")
            assert b"secret internal detail" not in rest  # in the log only
        # before: the process stayed up, answering 503 for as long as it lived
        assert await asyncio.wait_for(proc.wait(), 30) == ENGINE_DEAD_EXIT
        log = (await proc.stderr.read()).decode()
        assert "secret internal detail" in log


def _tiny_model_dir(path: Path) -> Path:
    import json

    from tandem.models.config import ModelConfig
    from tandem.models.hf_export import to_hf_config_dict

    cfg = ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=512, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=512,
    )  # fmt: skip
    (path / "config.json").write_text(json.dumps(to_hf_config_dict(cfg)))
    return path


def _engine_process_serve(model_dir: Path, *more: str) -> list[str]:
    return [*_tandem_command(), "serve", str(model_dir), "--load-format", "dummy", "--device",
            "cpu", "--port", "0", "--engine-process", "--no-ui", *more]  # fmt: skip


async def test_engine_process_serves_and_stops_on_sigterm(tmp_path: Path) -> None:
    argv = _engine_process_serve(_tiny_model_dir(tmp_path), "--shutdown-timeout", "1")
    async with _spawned(*argv) as proc:
        base = await _listening_at(proc)
        async with aiohttp.ClientSession() as http:
            body = {"prompt": [1, 2, 3], "max_tokens": 5, "temperature": 0, "ignore_eos": True}
            async with http.post(f"{base}/v1/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()
                assert (await resp.json())["usage"]["completion_tokens"] == 5
            async with http.post(f"{base}/v1/completions", json={"prompt": [1, 999]}) as bad:
                assert bad.status == 400 and (await bad.json())["error"]["param"] == "prompt"
            resp, _ = await _signal_mid_stream(http, base, proc, signal.SIGTERM, 400)
            rest = await asyncio.wait_for(resp.read(), 30)
            assert rest.endswith(b"data: [DONE]\n\n")
        assert await asyncio.wait_for(proc.wait(), 30) == 0


async def test_ctrl_c_to_the_process_group_drains_the_engine_process(tmp_path: Path) -> None:
    """A terminal's Ctrl-C reaches the engine's child too: it must keep stepping while the
    server drains, so the stream in flight finishes normally."""
    import os

    argv = _engine_process_serve(_tiny_model_dir(tmp_path), "--shutdown-timeout", "60")
    proc = await asyncio.create_subprocess_exec(
        *argv, stderr=asyncio.subprocess.PIPE, cwd=str(ROOT), start_new_session=True
    )
    try:
        base = await _listening_at(proc)
        async with aiohttp.ClientSession() as http:
            body = {"prompt": [1, 2], "max_tokens": 60, "ignore_eos": True, "stream": True}
            resp = await http.post(f"{base}/v1/completions", json=body)
            assert (await resp.content.readuntil(b"\n\n")).startswith(b"data: {")
            os.killpg(proc.pid, signal.SIGINT)
            rest = await asyncio.wait_for(resp.read(), 60)
            assert b'"finish_reason":"length"' in rest and rest.endswith(b"data: [DONE]\n\n")
        assert await asyncio.wait_for(proc.wait(), 30) == 0
    finally:
        if proc.returncode is None:
            os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()

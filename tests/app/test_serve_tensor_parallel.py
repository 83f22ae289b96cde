"""`tandem serve --tensor-parallel-size 2` on the CPU (gloo): the openai client gets answers,
and a killed worker rank turns /health 503 and ends the server with an error, not a hang."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
from pathlib import Path

import aiohttp
import openai

from tests.app.test_serve import _spawned, _tandem_command

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 300,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
}


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text().split()
        out.extend(int(c) for c in text)
    return out


def _worker_pids(pid: int) -> list[int]:
    pids = []
    for child in _children(pid):
        cmd = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        if "multiprocessing.spawn" in cmd and "resource_tracker" not in cmd:
            pids.append(child)
    return pids


async def _listening(proc: asyncio.subprocess.Process) -> str:
    for _ in range(200):
        line = (await asyncio.wait_for(proc.stderr.readline(), 120)).decode()
        assert line, "tandem serve exited before listening"
        if m := re.search(r"serving \S+ on http://127\.0\.0\.1:(\d+)", line):
            return f"http://127.0.0.1:{m.group(1)}"
    raise AssertionError("no listening line")


def _argv(tmp_path: Path) -> list[str]:
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    return [
        *_tandem_command(), "serve", "--model", str(tmp_path), "--load-format", "dummy",
        "--device", "cpu", "--dtype", "float32", "--tensor-parallel-size", "2",
        "--num-kv-blocks", "64", "--max-model-len", "256", "--port", "0",
        "--shutdown-timeout", "5",
    ]  # fmt: skip


async def test_tp2_server_answers_then_dies_cleanly_with_a_worker(tmp_path: Path) -> None:
    async with _spawned(*_argv(tmp_path)) as proc:
        base = await _listening(proc)
        workers = _worker_pids(proc.pid)
        assert len(workers) == 1
        client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=60)
        model = (await client.models.list()).data[0].id
        done = await client.completions.create(
            model=model, prompt="hello", max_tokens=5, temperature=0
        )
        again = await client.completions.create(
            model=model, prompt="hello", max_tokens=5, temperature=0
        )
        assert done.usage.completion_tokens == 5
        assert done.choices[0].text == again.choices[0].text

        os.kill(workers[0], signal.SIGKILL)
        async with aiohttp.ClientSession() as http:
            for _ in range(100):  # bounded: 200 until the death is seen, then 503 or gone
                try:
                    async with http.get(f"{base}/health") as health:
                        if health.status != 200:
                            assert health.status == 503
                            break
                except aiohttp.ClientError:
                    break
                await asyncio.sleep(0.05)
            else:
                raise AssertionError("the server stayed healthy after its worker died")
        code = await asyncio.wait_for(proc.wait(), 30)
        assert code != 0
        err = (await proc.stderr.read()).decode()
        assert "tensor-parallel rank 1 exited" in err


async def test_tp2_server_sigterm_stops_every_rank(tmp_path: Path) -> None:
    async with _spawned(*_argv(tmp_path)) as proc:
        await _listening(proc)
        workers = _worker_pids(proc.pid)
        assert len(workers) == 1
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 30) == 0
        for _ in range(50):  # the worker has exited (it is reaped by now or within a moment)
            if not Path(f"/proc/{workers[0]}").exists():
                break
            await asyncio.sleep(0.1)
        else:
            raise AssertionError(f"worker {workers[0]} outlived the server")

"""tools/gpu_serving.sh end to end on the CPU (`--smoke`: a tiny shape, tiny lengths): it writes
a config-only model directory, starts `tandem serve --load-format dummy` on it, sweeps
tools/bench_serving.py, stops the server cleanly and summarizes, so the device run is known to
work before it costs device time."""

from __future__ import annotations

import json
import os
import socket
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_smoke_sweep_end_to_end(tmp_path: Path) -> None:
    env = {**os.environ, "OUT": str(tmp_path), "DEVICE": "cpu", "PORT": str(free_port())}
    env["HBM_GBPS"] = "1000"  # the floor column without a bandwidth measurement
    proc = subprocess.run(
        ["bash", str(ROOT / "tools" / "gpu_serving.sh"), "--smoke"],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "serving.json").read_text())
    assert result["model"] == "llama-tiny-dummy"
    runs = result["runs"]
    assert [(r["max_concurrency"], r["num_prompts"], r["failed"]) for r in runs] == [
        (1, 3, 0),
        (4, 8, 0),
    ]
    for r in runs:  # token-id prompts and ignore_eos: exact lengths
        assert r["total_input_tokens"] == 12 * r["num_prompts"]
        assert r["total_output_tokens"] == 6 * r["num_prompts"]
        assert r["ttft_ms"]["p50"] > 0 and r["tpot_ms"]["p99"] >= r["tpot_ms"]["p50"] > 0
    plot = tmp_path / "serving.png"
    assert plot.exists() or (tmp_path / "serving.svg").exists()
    summary = (tmp_path / "summary.txt").read_text().splitlines()
    rows = [line.split() for line in summary if line.split()[:1] in (["1"], ["4"])]
    assert [row[:3] for row in rows] == [["1", "3", "0"], ["4", "8", "0"]]
    assert all(row[-1].endswith("x") for row in rows)  # TPOT over the batch-1 floor
    assert any("batch-1 TPOT floor" in line for line in summary)
    log = (tmp_path / "server.log").read_text()
    assert "synthetic byte-level tokenizer" in log
    assert "stopped (0 request(s) aborted)" in log  # SIGTERM drained, exit 0

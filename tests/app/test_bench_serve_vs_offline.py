"""tools/bench_serve_vs_offline.py: its /metrics parsing, and one whole run on a tiny model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "bench_serve_vs_offline.py"
sys.path.insert(0, str(ROOT))
from tools.bench_serve_vs_offline import _counters  # noqa: E402


def test_counters_read_labelled_prometheus_lines() -> None:
    text = (
        "# HELP tandem:engine_step_seconds_total Wall time.\n"
        'tandem:engine_step_seconds_total{model_name="m"} 1.5\n'
        'tandem:num_steps_total{model_name="m"} 12\n'
        'tandem:loop_cpu_seconds_total{model_name="m"} 0.25\n'
        'tandem:e2e_request_latency_seconds_count{model_name="m"} 3\n'
    )
    assert _counters(text) == {
        "tandem:engine_step_seconds_total": 1.5,
        "tandem:num_steps_total": 12.0,
        "tandem:loop_cpu_seconds_total": 0.25,
    }


@pytest.mark.slow
def test_one_run_reports_both_rates_and_host_time(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    args = ["--concurrency", "2,20", "--input-len", "4", "--output-len", "6", "--port", "8263"]
    subprocess.run([sys.executable, str(TOOL), *args, "--json", str(out)], check=True, timeout=600)
    rows = json.loads(out.read_text())["rows"]
    assert [r["concurrency"] for r in rows] == [2, 20]
    for r in rows:
        assert r["offline"] > 0 and r["serve"] > 0 and r["offline_cpu_us"] > 0
        host = r["serve_host_us"]
        assert host["engine_step"] >= host["engine_step_cpu"] * 0.9 > 0  # wall >= CPU
        assert host["loop_cpu"] > 0 and host["tokens_per_step"] > 1

"""tools/device/gpu-serving.sh end to end on the CPU (`--smoke`: a tiny shape, tiny lengths): it writes
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


def run_smoke(out: Path, **env: str) -> None:
    """tools/device/gpu-serving.sh --smoke on the CPU into `out`, with `env` on top; must succeed."""
    env = {**os.environ, "OUT": str(out), "DEVICE": "cpu", "PORT": str(free_port()), **env}
    proc = subprocess.run(
        ["bash", str(ROOT / "tools" / "device_check.sh"), "gpu-serving", "--smoke"],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_smoke_sweep_end_to_end(tmp_path: Path) -> None:
    run_smoke(tmp_path, HBM_GBPS="1000")  # the floor column without a bandwidth measurement
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


def test_smoke_sweep_of_a_hybrid_moe_shape(tmp_path: Path) -> None:
    """SHAPE=tiny-moe: a Qwen3-MoE config served with every routed expert on the CPU pool
    (int4, random experts made layer by layer); the summary's floor is the expert bytes over
    the CPU read bandwidth."""
    run_smoke(tmp_path, SHAPE="tiny-moe", CONCURRENCY="1,2", NUM_PROMPTS="2,4", CPU_GBPS="50")
    result = json.loads((tmp_path / "serving.json").read_text())
    assert result["model"] == "qwen3moe-tiny-moe-dummy"
    assert [(r["max_concurrency"], r["failed"]) for r in result["runs"]] == [(1, 0), (2, 0)]
    log = (tmp_path / "server.log").read_text()
    assert "cpu_pool: 2 MoE layers (int4" in log and "0 experts a layer on the GPU" in log
    summary = (tmp_path / "summary.txt").read_text()
    # 2 active experts x 3 x 64 x 32 x (0.5 + 4/64) bytes x 2 layers = 13,824 B at 50 GB/s
    assert "int4 experts on the CPU pool" in summary and "at 50 GB/s" in summary
    assert "TPOT floor is 0.00 ms (3616898.1 tok/s)" in summary
    assert "prefill at concurrency 1: 12 tokens in" in summary


def test_smoke_sweep_of_a_moe_shape_with_every_expert_resident(tmp_path: Path) -> None:
    """MOE_EXPERTS=gpu: no CPU pool; the floor counts the dense weights and the experts a step
    touches, over HBM_GBPS."""
    run_smoke(tmp_path, SHAPE="tiny-moe", MOE_EXPERTS="gpu", CONCURRENCY="1,2",
              NUM_PROMPTS="2,4", HBM_GBPS="1000")  # fmt: skip
    result = json.loads((tmp_path / "serving.json").read_text())
    assert [(r["max_concurrency"], r["failed"]) for r in result["runs"]] == [(1, 0), (2, 0)]
    assert "cpu_pool" not in (tmp_path / "server.log").read_text()
    summary = (tmp_path / "summary.txt").read_text()
    assert "every expert on the GPU" in summary and "at 1000 GB/s (HBM_GBPS)" in summary
    rows = [line.split() for line in summary.splitlines() if line.split()[:1] in (["1"], ["2"])]
    assert len(rows) == 2 and all(row[-1].endswith("x") for row in rows)


def test_smoke_sweep_of_a_config_file(tmp_path: Path) -> None:
    """CONFIG=any HF config.json (here a tiny Mixtral, cut to LAYERS=1): served hybrid, named
    after the file; the floor counts the MoE layers from the config (Mixtral's expert size is
    its intermediate_size)."""
    cfg = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": 32000,
           "hidden_size": 64, "intermediate_size": 32, "num_hidden_layers": 3,
           "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 4,
           "num_experts_per_tok": 2, "max_position_embeddings": 512,
           "tie_word_embeddings": False}  # fmt: skip
    path = tmp_path / "tiny-mixtral.json"
    path.write_text(json.dumps(cfg))
    out = tmp_path / "out"
    run_smoke(out, CONFIG=str(path), LAYERS="1", CONCURRENCY="1,2", NUM_PROMPTS="2,4",
              CPU_GBPS="50")  # fmt: skip
    result = json.loads((out / "serving.json").read_text())
    assert result["model"] == "tiny-mixtral-dummy"
    assert [(r["max_concurrency"], r["failed"]) for r in result["runs"]] == [(1, 0), (2, 0)]
    assert "cpu_pool: 1 MoE layers (int4" in (out / "server.log").read_text()
    summary = (out / "summary.txt").read_text()
    # 2 active experts x 3 x 64 x 32 x (0.5 + 4/64) bytes x 1 layer = 6,912 B at 50 GB/s
    assert "TPOT floor is 0.00 ms (7233796.3 tok/s)" in summary

"""tools/bench_hybrid_moe.py end to end on the CPU at a tiny shape: no pool runs (`--formats`
with none), the all-experts-resident run with its floors and the gpu backend's paths, and the HF
transformers peer of the same shape, into the JSON."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tools import bench_hybrid_moe  # noqa: E402

TINY = (
    "--device cpu --attention-backend torch --layers 2 --hidden 64 --experts 8 --topk 2 "
    "--inter 32 --heads 4 --kv-heads 2 --head-dim 16 --vocab 128 --decode-steps 3 --batch 2 "
    "--prompt 8 --prefill 16 --graphs off"
).split()


def test_gpu_all_and_hf_peer_at_a_tiny_shape(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    assert bench_hybrid_moe.main([*TINY, "--formats", "--gpu-all", "--hf", "--json", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    ours = results["gpu_all_bf16_gpu_eager"]  # no graphs on the CPU
    assert ours["decode_b1_tok_s"] > 0 and ours["prefill_tok_s"] > 0
    assert ours["decode_b1_floor_tok_s"] > ours["decode_b2_floor_tok_s"] / 2 > 0
    assert ours["expert_calls"]["grouped"] > 0  # no kernels off CUDA
    peers = [r for name, r in results.items() if name.startswith("hf_transformers_")]
    assert peers and all("error" not in r for r in peers), peers
    assert all(r["decode_b1_tok_s"] > 0 and r["decode_b2_tok_s"] > 0 for r in peers)


def test_formats_may_be_empty() -> None:
    assert bench_hybrid_moe.parse_args(["--formats"]).formats == []
    with pytest.raises(SystemExit):
        bench_hybrid_moe.parse_args(["--gpu-all-backend", "cpu_pool"])


def test_bench_hybrid_engine_on_the_cpu(tmp_path: Path) -> None:
    """tools/bench_hybrid_engine.py: one layer of the 30B-A3B shape through the engine (int4
    experts on the pool), a decode rate in the JSON (no CUDA events off CUDA)."""
    from tools import bench_hybrid_engine

    out = tmp_path / "e.json"
    argv = ["--device", "cpu", "--layers", "1", "--prompt", "16", "--new", "3", "--json", str(out)]
    assert bench_hybrid_engine.main(argv) == 0
    res = json.loads(out.read_text())
    assert res["decode_b1_tok_s"] > 0 and res["load_s"] > 0 and "graph_steps" not in res

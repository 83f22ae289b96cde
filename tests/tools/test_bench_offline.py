"""tools/bench_offline.py's MoE options: --cpu-experts puts the experts on the CPU pool, and the
floor then counts the top-k share of the pool's bytes per token."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

from tests.models.moe_cases import _save

ROOT = Path(__file__).resolve().parents[2]


def _tool():  # noqa: ANN202
    spec = importlib.util.spec_from_file_location(
        "bench_offline", ROOT / "tools" / "bench_offline.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_cpu_experts_go_to_the_pool_and_count_in_the_floor(tmp_path: Path) -> None:
    bench = _tool()
    _save("qwen3_moe", tmp_path)  # layer 0 dense, layer 1: 8 experts, top-2
    args = argparse.Namespace(model=str(tmp_path), cpu_experts="all", cpu_expert_format="int8")
    llm = bench.make_llm(args, "float32")
    backend = llm.engine.model.expert_backend
    try:
        assert backend.name == "cpu_pool" and backend.pool.layer_format(1)[0] == "int8"
        pool_total = sum(backend.pool.info()["bytes_per_format"].values())
        assert pool_total > 0 and bench.pool_bytes_per_token(llm) == pool_total * 2 // 8
    finally:
        backend.close()
    dense = bench.make_llm(argparse.Namespace(model=str(tmp_path), cpu_experts=None), "float32")
    assert bench.pool_bytes_per_token(dense) == 0  # torch experts: already in the parameters

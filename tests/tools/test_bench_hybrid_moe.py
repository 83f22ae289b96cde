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


def test_shape_from_an_hf_config(tmp_path: Path) -> None:
    """--config: a Qwen2-MoE config.json (shared expert, every other layer dense, tied
    embeddings) through a pool run, the all-resident run and the HF peer; the floors count the
    MoE layers only, and the tied table as the LM head the step reads."""
    cfg = {
        "architectures": ["Qwen2MoeForCausalLM"],
        "model_type": "qwen2_moe",
        "vocab_size": 128,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_experts": 6,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48,
        "decoder_sparse_step": 2,
        "tie_word_embeddings": True,
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "r.json"
    argv = [
        *"--device cpu --attention-backend torch --decode-steps 3 --batch 2 --prompt 8".split(),
        *"--prefill 16 --graphs off --gpu-prefill off --threads 1 --formats int4".split(),
        *["--config", str(tmp_path), "--layers", "4", "--gpu-all", "--hf", "--json", str(out)],
    ]
    assert bench_hybrid_moe.main(argv) == 0
    results = json.loads(out.read_text())["results"]
    pool = results["hybrid_int4_eager"]
    assert pool["decode_b1_tok_s"] > 0
    per_token = 2 * bench_hybrid_moe.expert_bytes(64, 32, "int4") * 2  # layers 1 and 3 are MoE
    assert pool["active_expert_GB_per_token"] == pytest.approx(per_token / 1e9)
    assert results["gpu_all_bf16_gpu_eager"]["decode_b1_tok_s"] > 0
    peers = [r for name, r in results.items() if name.startswith("hf_transformers_")]
    assert peers and all("error" not in r for r in peers), peers
    with pytest.raises(SystemExit, match="not a mixture of experts"):
        (tmp_path / "config.json").write_text(json.dumps(cfg | {"model_type": "llama",
                                                                "architectures": []}))  # fmt: skip
        bench_hybrid_moe.model_config(bench_hybrid_moe.parse_args(["--config", str(tmp_path)]))


def _v3_args(tmp_path: Path, layers: int):
    """A DeepSeek-V3 config cut to toy sizes (3 dense layers first, 32 experts top-8)."""
    cfg = json.loads((ROOT / "tools" / "shapes" / "deepseek-v3.json").read_text())
    cfg.update(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
               num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
               n_routed_experts=32, kv_lora_rank=32, q_lora_rank=24, qk_rope_head_dim=8,
               v_head_dim=16, qk_nope_head_dim=16, n_group=4, topk_group=2)  # fmt: skip
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    a = bench_hybrid_moe.parse_args(["--config", str(path), "--batch", "16"])
    return a, bench_hybrid_moe.model_config(a)


def test_fit_ram_keeps_the_dense_layers_and_what_memory_holds(tmp_path: Path, monkeypatch) -> None:
    a, cfg = _v3_args(tmp_path, 61)
    one_layer = 32 * bench_hybrid_moe.expert_bytes(64, 32, "int4")
    a.ram_reserve_gb = 1.0
    monkeypatch.setattr(bench_hybrid_moe, "mem_available_bytes", lambda: 1e9 + 5.5 * one_layer)
    assert bench_hybrid_moe.fit_ram(cfg, "int4", a).num_hidden_layers == 3 + 5
    a.layers = 6  # --layers caps it
    assert bench_hybrid_moe.fit_ram(cfg, "int4", a).num_hidden_layers == 6


def test_extrapolation_to_the_full_depth(tmp_path: Path) -> None:
    """A run of 3 dense + 2 MoE layers: the pool's time a MoE layer times the full model's 58
    MoE layers, plus the rest of the step scaled by 61 / 5 layers."""
    a, full = _v3_args(tmp_path, 61)
    cut = bench_hybrid_moe.dataclasses.replace(full, num_hidden_layers=5)
    a.measured_gbps = 100.0
    # batch 1: a 10 ms step of which the pool took 4 ms (2 ms a MoE layer)
    res = {"decode_b1_tok_s": 100.0, "decode_b1_pool_tok_s": 250.0,
           "decode_b16_tok_s": 160.0, "decode_b16_pool_tok_s": 320.0}  # fmt: skip
    x = bench_hybrid_moe.extrapolate(res, cut, full, "int4", a)
    assert (x["moe_layers"], x["full_layers"]) == (2, 61)
    assert x["b1_pool_ms_per_moe_layer"] == pytest.approx(2.0)
    assert x["b1_rest_ms_per_step"] == pytest.approx(6.0)
    assert x["b1_full_depth_tok_s"] == pytest.approx(1e3 / (58 * 2.0 + 6.0 * 61 / 5))
    assert x["b16_pool_ms_per_moe_layer"] == pytest.approx(25.0)  # 50 ms of a 100 ms step
    one = bench_hybrid_moe.expert_bytes(64, 32, "int4")
    touched16 = bench_hybrid_moe.touched_experts(32, 8, 16)
    assert x["b16_floor_ms_per_moe_layer"] == pytest.approx(touched16 * one / 100e9 * 1e3)
    assert x["b1_full_depth_floor_tok_s"] == pytest.approx(100e9 / (8 * one * 58))

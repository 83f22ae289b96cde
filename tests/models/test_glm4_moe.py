"""GLM-4.5 (Glm4MoeForCausalLM) against HF transformers: tiny random checkpoints run as a ragged,
chunk-prefilled, mixed prefill+decode batch through the paged cache (partial rotary, q/k/v
biases, optional per-head q/k norms, DeepSeek-V3 routing in groups with shared experts, the
first layer dense), on the torch expert backend and through the CPU pool; the config rules."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers as hf

from tandem.ext.cpu import quantize
from tandem.models.config import ModelConfig
from tandem.models.loader import load_model
from tests.models.deepseek_cases import save_random_hf
from tests.models.test_deepseek import _run_mixed, max_rel_diff

BASE = dict(
    vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, moe_intermediate_size=32,
    n_routed_experts=8, num_experts_per_tok=2, first_k_dense_replace=1, initializer_range=0.05,
)  # fmt: skip
CASES = {
    # GLM-4.5-like: q/k/v biases, 4 groups of 2 (best 2), renormalized, scaled 2.5
    "grouped": dict(attention_bias=True, use_qk_norm=False, n_group=4, topk_group=2,
                    n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True),
    # q/k norms, one group, two shared experts, weights not renormalized, a quarter rotary
    "qk_norm": dict(attention_bias=False, use_qk_norm=True, n_group=1, topk_group=1,
                    n_shared_experts=2, norm_topk_prob=False,
                    rope_parameters={"rope_theta": 10000.0, "rope_type": "default",
                                     "partial_rotary_factor": 0.25}),
}  # fmt: skip


def save_glm(name: str, path: Path, expert_fmt: str | None = None) -> torch.nn.Module:
    """`save_random_hf` of GLM case `name`; `expert_fmt` rounds the routed experts to that pool
    format (the pool is then exact)."""
    config = hf.Glm4MoeConfig(**{**BASE, **CASES[name]})
    rounded = (
        (lambda w: quantize(w.to(torch.bfloat16).float(), expert_fmt, 64)) if expert_fmt else None
    )
    return save_random_hf(config, path, rounded)


@pytest.mark.parametrize("name,block_size", [("grouped", 4), ("grouped", 16), ("qk_norm", 16)])
def test_parity_with_hf(name: str, block_size: int, tmp_path: Path, paged_runner) -> None:
    hf_model = save_glm(name, tmp_path)
    model, config = load_model(tmp_path, dtype=torch.float32, device="cpu")
    assert type(model).__name__ == "Glm4MoeForCausalLM"
    _, seqs, rows = _run_mixed(model, config, paged_runner, block_size)
    assert max_rel_diff(hf_model, seqs, rows) < 1e-4


@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4"])
def test_pool_matches_hf(fmt: str, tmp_path: Path, paged_runner) -> None:
    hf_model = save_glm("grouped", tmp_path, expert_fmt=fmt)
    model, config = load_model(
        tmp_path, dtype=torch.float32, device="cpu", expert_backend="cpu_pool",
        expert_options={"fmt": fmt, "isa": "scalar", "num_threads": 2},
    )  # fmt: skip
    blocks = [m for m in model.modules() if hasattr(m, "w13")]
    assert len(blocks) == 2 and all(b.shared_experts is not None for b in blocks)
    _, seqs, rows = _run_mixed(model, config, paged_runner, 4)
    assert max_rel_diff(hf_model, seqs, rows) < 1e-4
    model.expert_backend.close()


def test_split_placement_and_rebalance_match_hf(tmp_path: Path, paged_runner) -> None:
    """--gpu-experts 3: three routed experts a layer on the model's device (here the CPU), the
    rest on the pool, summed; re-placed by routing counts (in place); still HF's logits."""
    hf_model = save_glm("grouped", tmp_path, expert_fmt="bf16")
    model, config = load_model(
        tmp_path, dtype=torch.float32, device="cpu", expert_backend="cpu_pool",
        expert_options={"isa": "scalar", "num_threads": 2, "gpu_experts": 3,
                        "rebalance_after_tokens": 0},
    )  # fmt: skip
    backend = model.expert_backend
    assert all(ids == [0, 1, 2] for ids in backend.stats().gpu_experts.values())
    _, seqs, rows = _run_mixed(model, config, paged_runner, 4)
    assert max_rel_diff(hf_model, seqs, rows) < 1e-4
    ptrs = {layer: p.w13.data_ptr() for layer, p in backend._placements.items()}
    backend.rebalance()
    assert any(ids != [0, 1, 2] for ids in backend.stats().gpu_experts.values())
    assert {layer: p.w13.data_ptr() for layer, p in backend._placements.items()} == ptrs
    _, seqs, rows = _run_mixed(model, config, paged_runner, 4)
    assert max_rel_diff(hf_model, seqs, rows) < 1e-4
    backend.close()


def test_config_rules(tmp_path: Path) -> None:
    save_glm("qk_norm", tmp_path)
    d = json.loads((tmp_path / "config.json").read_text())
    c = ModelConfig.from_hf_dict(d)
    assert (c.head_dim, c.rotary_dim, c.qk_norm, c.attention_bias, c.o_proj_bias) == (
        16, 4, True, False, False)  # fmt: skip
    assert (c.scoring_func, c.topk_method, c.n_shared_experts, c.first_k_dense_replace) == (
        "sigmoid", "noaux_tc", 2, 1)  # fmt: skip
    assert [c.is_moe_layer(i) for i in range(3)] == [False, True, True]
    # keys a file leaves out take transformers' GLM-4.5 defaults
    bare = {"architectures": ["Glm4MoeForCausalLM"], "vocab_size": 64, "hidden_size": 32,
            "num_hidden_layers": 2, "num_attention_heads": 4}  # fmt: skip
    c = ModelConfig.from_hf_dict(bare)
    assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size) == (128, 8, 1408)
    assert (c.partial_rotary_factor, c.rotary_dim, c.first_k_dense_replace) == (0.5, 4, 1)
    d.update(n_group=3)  # 8 experts do not split into 3 groups
    with pytest.raises(ValueError, match="n_group"):
        ModelConfig.from_hf_dict(d)


def test_mtp_layer_is_not_read(tmp_path: Path) -> None:
    """GLM-4.5 checkpoints carry one multi-token-prediction layer after the last; it is skipped."""
    save_glm("grouped", tmp_path)
    from safetensors.torch import load_file, save_file

    (f,) = tmp_path.glob("*.safetensors")
    tensors = load_file(f)
    tensors["model.layers.3.self_attn.q_proj.weight"] = torch.zeros(64, 64)
    tensors["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)
    save_file(tensors, f, metadata={"format": "pt"})
    model, _ = load_model(tmp_path, dtype=torch.float32, device="cpu")
    assert len(model.layers) == 3

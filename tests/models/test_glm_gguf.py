"""llama.cpp's "glm4moe" GGUF: files written with the `gguf` package from tiny random HF GLM-4.5
models as llama.cpp's converter lays them out (stacked experts, `exp_probs_b`, shared experts
`*_shexp`, `post_attention_norm`, partial rope in `rope.dimension_count`, a trailing
next-token-prediction block counted in `block_count`); their config and logits match HF's.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import transformers as hf

from tandem.models.loader.gguf import gguf_model_config
from tests.models.deepseek_cases import save_random_hf
from tests.models.test_gguf import (
    _assert_hf_logits,
    _assert_pool_logits,
    _gguf_tensors,
    _moe_expert_tensors,
    _write_gguf,
)
from tests.models.test_glm4_moe import BASE, CASES

_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp",
    "mlp.shared_experts.gate_proj": "ffn_gate_shexp", "mlp.shared_experts.up_proj": "ffn_up_shexp",
    "mlp.shared_experts.down_proj": "ffn_down_shexp",
}  # fmt: skip


def _glm4moe_gguf(name: str, tmp_path: Path, bf16_experts: bool = False, **extra):
    cfg = hf.Glm4MoeConfig(**{**BASE, **CASES[name], **extra})
    rounded = (lambda w: w.to(torch.bfloat16).float()) if bf16_experts else None
    ref = save_random_hf(cfg, tmp_path / "hf", rounded)
    inter = cfg.moe_intermediate_size

    def layer_tensors(rest: str, a: np.ndarray) -> dict[str, np.ndarray]:
        experts = _moe_expert_tensors(rest, a, inter)
        if experts is not None:
            return experts
        module, kind = rest.rsplit(".", 1)
        return {f"{_NAMES[module]}.{kind}": a}

    tensors = _gguf_tensors(ref, layer_tensors)
    layers, hidden = cfg.num_hidden_layers, cfg.hidden_size
    # the next-token-prediction block llama.cpp's converter writes last (never read by us):
    # NaN, so a layer that reads it poisons the logits
    nan = np.full((hidden, hidden), np.nan, dtype=np.float32)
    for suffix in ("attn_norm.weight", "nextn.eh_proj.weight", "nextn.enorm.weight"):
        tensors[f"blk.{layers}.{suffix}"] = nan[:, :2] if "norm" in suffix else nan
    head_dim = cfg.head_dim
    factor = cfg.rope_parameters.get("partial_rotary_factor", 0.5)
    a = "glm4moe"
    kv: dict = {
        f"{a}.block_count": layers + 1, f"{a}.nextn_predict_layers": 1,
        f"{a}.embedding_length": hidden, f"{a}.feed_forward_length": cfg.intermediate_size,
        f"{a}.vocab_size": cfg.vocab_size, f"{a}.context_length": cfg.max_position_embeddings,
        f"{a}.attention.head_count": cfg.num_attention_heads,
        f"{a}.attention.head_count_kv": cfg.num_key_value_heads,
        f"{a}.attention.key_length": head_dim, f"{a}.attention.value_length": head_dim,
        f"{a}.rope.dimension_count": int(head_dim * factor),
        f"{a}.rope.freq_base": float(cfg.rope_parameters["rope_theta"]),
        f"{a}.attention.layer_norm_rms_epsilon": cfg.rms_norm_eps,
        f"{a}.expert_count": cfg.n_routed_experts, f"{a}.expert_used_count": cfg.num_experts_per_tok,
        f"{a}.expert_feed_forward_length": inter, f"{a}.expert_shared_count": cfg.n_shared_experts,
        f"{a}.leading_dense_block_count": cfg.first_k_dense_replace,
        f"{a}.expert_gating_func": 2, f"{a}.expert_weights_scale": float(cfg.routed_scaling_factor),
        f"{a}.expert_weights_norm": bool(cfg.norm_topk_prob),
    }  # fmt: skip
    if cfg.n_group > 1:
        kv[f"{a}.expert_group_count"] = cfg.n_group
        kv[f"{a}.expert_group_used_count"] = cfg.topk_group
    path = tmp_path / f"{name}.gguf"
    _write_gguf(path, a, kv, tensors)
    return path, ref, cfg


@pytest.mark.parametrize(
    "name,extra",
    [("grouped", {}), ("qk_norm", {}), ("grouped", {"head_dim": 32})],  # 32: != hidden / heads
)
def test_glm4moe_gguf_matches_hf(name: str, extra: dict, tmp_path: Path, paged_runner) -> None:
    path, ref, hf_cfg = _glm4moe_gguf(name, tmp_path, **extra)
    cfg = gguf_model_config(path)
    assert cfg.architecture == "Glm4MoeForCausalLM"
    assert cfg.num_hidden_layers == hf_cfg.num_hidden_layers  # the nextn block left out
    assert (cfg.head_dim, cfg.rotary_dim) == (
        hf_cfg.head_dim,
        int(hf_cfg.head_dim * hf_cfg.rope_parameters.get("partial_rotary_factor", 0.5)),
    )
    assert (cfg.qk_norm, cfg.attention_bias) == (hf_cfg.use_qk_norm, hf_cfg.attention_bias)
    assert (cfg.n_group, cfg.topk_group, cfg.n_shared_experts, cfg.first_k_dense_replace) == (
        hf_cfg.n_group, hf_cfg.topk_group, hf_cfg.n_shared_experts, 1)  # fmt: skip
    assert cfg.routed_scaling_factor == pytest.approx(hf_cfg.routed_scaling_factor)
    _assert_hf_logits(path, ref, [5, 17, 3, 60, 9, 1, 33, 2, 90, 11, 4], paged_runner)


def test_glm4moe_gguf_experts_into_the_pool(tmp_path: Path, paged_runner) -> None:
    """--cpu-experts all on a glm4moe GGUF: the stacked experts go from the file straight into
    the pool (float32 -> bf16, exact for bf16-valued experts)."""
    path, ref, _ = _glm4moe_gguf("grouped", tmp_path, bf16_experts=True)
    _assert_pool_logits(path, ref, paged_runner)

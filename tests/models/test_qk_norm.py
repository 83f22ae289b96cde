"""q/k norms where transformers' code for the family has them: per head (Qwen3, Qwen3-MoE) or over
the whole projected q and k (OLMoE), against the modules transformers builds from the same
config; OLMoE's config rules (norm_topk_prob off by default, clip_qkv, experts on every layer);
the fused per-head norm + rotary prologue stepping aside for OLMoE's norms. Logits parity with HF
per family: tests/models/test_hf_parity.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers as hf

from tandem.models.config import ModelConfig
from tandem.models.loader import build_model, load_model
from tests.models.test_hf_parity import OLMOE, _save_hf_model

TINY = dict(
    vocab_size=128, hidden_size=64, intermediate_size=48, num_hidden_layers=1,
    num_attention_heads=4, num_key_value_heads=2,
)  # fmt: skip
MOE = dict(num_experts=4, num_experts_per_tok=2)


@pytest.mark.parametrize(
    "hf_cfg",
    [
        hf.LlamaConfig(**TINY),
        hf.Qwen3Config(**TINY, head_dim=32),
        hf.Qwen3MoeConfig(**TINY, **MOE, moe_intermediate_size=16),
        hf.OlmoeConfig(**TINY, **MOE),
        hf.OlmoeConfig(**{**TINY, "num_key_value_heads": 1}, **MOE),
    ],
    ids=["llama", "qwen3", "qwen3_moe", "olmoe", "olmoe_gqa4"],
)
def test_qk_norm_widths_follow_transformers(hf_cfg) -> None:
    ours = ModelConfig.from_hf_dict(hf_cfg.to_dict())
    attn = build_model(ours, dtype=torch.float32, device="cpu").layers[0].self_attn
    ref = hf.AutoModelForCausalLM.from_config(hf_cfg).model.layers[0].self_attn
    if not hasattr(ref, "q_norm"):
        assert attn.q_norm is None and attn.k_norm is None and not ours.qk_norm
        return
    assert attn.q_norm.weight.shape == ref.q_norm.weight.shape
    assert attn.k_norm.weight.shape == ref.k_norm.weight.shape
    whole_row = ref.q_norm.weight.shape[0] != ours.head_dim
    assert ours.qk_norm and ours.qk_norm_full is whole_row is attn.qk_norm_full


def test_olmoe_config_follows_transformers_defaults() -> None:
    """allenai's config.json names no norm_topk_prob (transformers' default: off); a clip_qkv is
    read; keys OLMoE's code never reads (mlp_only_layers, decoder_sparse_step, sliding_window)
    change nothing; model_type alone names the architecture."""
    d = hf.OlmoeConfig(**TINY, **MOE, clip_qkv=8.0).to_dict()
    d.pop("norm_topk_prob")
    d.pop("architectures", None)
    d |= {"mlp_only_layers": [0], "decoder_sparse_step": 2, "sliding_window": 16}
    cfg = ModelConfig.from_hf_dict(d)
    assert cfg.architecture == "OlmoeForCausalLM"
    assert (cfg.qk_norm, cfg.qk_norm_full, cfg.clip_qkv) == (True, True, 8.0)
    assert not cfg.norm_topk_prob and cfg.sliding_window is None
    assert cfg.is_moe_layer(0) and cfg.moe_intermediate_size == TINY["intermediate_size"]
    qwen3 = ModelConfig.from_hf_dict(hf.Qwen3MoeConfig(**TINY, **MOE, clip_qkv=8.0).to_dict())
    assert qwen3.clip_qkv is None and not qwen3.qk_norm_full  # no such switch in Qwen3's code
    block = build_model(cfg, dtype=torch.float32, device="cpu").layers[0].mlp
    assert block.renormalize is False and block.shared_expert is None


def test_fused_norm_rope_steps_aside_for_whole_row_norms(tmp_path: Path, paged_runner) -> None:
    """NormRopeAttention's kernel normalizes each head alone; on OLMoE's layers it must take the
    plain path (the swap never picks it for them; its forward checks again)."""
    from tandem.models.layers.cuda_linear import NormRopeAttention

    _save_hf_model(hf.OlmoeConfig(**OLMOE), tmp_path)
    model, config = load_model(tmp_path, dtype=torch.float32, device="cpu")
    ids = [5, 17, 3, 60, 9, 1, 33]
    plain = paged_runner(model, config, block_size=4).step([(0, ids)])[0]
    for layer in model.layers:
        layer.self_attn.__class__ = NormRopeAttention
    fused = paged_runner(model, config, block_size=4).step([(0, ids)])[0]
    torch.testing.assert_close(fused, plain, rtol=0, atol=0)

"""Qwen2-MoE's q/k/v bias as transformers >= 5 writes it (`qkv_bias`): a checkpoint saved with
qkv_bias=False has no bias tensors and must load, not fail on missing biases."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers as hf

from tandem.models.config import ModelConfig
from tandem.models.loader import load_model


@pytest.mark.parametrize("qkv_bias", [False, True])
def test_qwen2_moe_qkv_bias_follows_the_config(tmp_path: Path, qkv_bias: bool) -> None:
    torch.manual_seed(0)
    cfg = hf.Qwen2MoeConfig(
        vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, shared_expert_intermediate_size=24, qkv_bias=qkv_bias,
    )  # fmt: skip
    ref = hf.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    ref.save_pretrained(tmp_path)
    assert ModelConfig.from_pretrained(tmp_path).attention_bias is qkv_bias
    model, _ = load_model(tmp_path, dtype=torch.float32, device="cpu")
    assert (model.layers[0].self_attn.qkv_proj.bias is not None) is qkv_bias
    assert ModelConfig.from_hf_dict({**cfg.to_dict(), "qkv_bias": None}).attention_bias  # default

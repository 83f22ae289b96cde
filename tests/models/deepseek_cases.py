"""Tiny random DeepSeek-V2/V3 checkpoints (HF configs) shared by the DeepSeek model tests: MLA with
and without q_lora, YaRN, group-limited routing with several groups, sigmoid + correction bias
and softmax scoring, first-k-dense layers and shared experts. v_head_dim differs from
qk_nope_head_dim so a swapped W_UK / W_UV cannot pass.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import transformers as hf

MLA = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=24,
    moe_intermediate_size=32,
    n_routed_experts=8,
    num_experts_per_tok=2,
    first_k_dense_replace=1,
    initializer_range=0.05,
)
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 16,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 0.707,
    "mscale_all_dim": 0.707,
}


def _v3(**kw: object) -> hf.DeepseekV3Config:
    return hf.DeepseekV3Config(**{**MLA, **kw})


def _v2(**kw: object) -> hf.DeepseekV2Config:
    return hf.DeepseekV2Config(**{**MLA, **kw})


CASES = {
    # V3: q_lora, sigmoid + bias in 4 groups of 2 (best 2 groups), renormalized, scaled 2.5
    "v3": lambda: _v3(q_lora_rank=24, n_group=4, topk_group=2, n_shared_experts=1,
                      routed_scaling_factor=2.5, norm_topk_prob=True),
    # V3 without q_lora, YaRN (mscale on the softmax scale), rope not interleaved, one group,
    # two shared experts, weights not renormalized
    "v3_yarn_noq": lambda: _v3(q_lora_rank=None, n_group=1, topk_group=1, n_shared_experts=2,
                               norm_topk_prob=False, rope_interleave=False,
                               max_position_embeddings=256, rope_parameters=YARN),
    # V2-Lite-like: plain q_proj, softmax greedy routing, two shared experts
    "v2_lite": lambda: _v2(q_lora_rank=None, topk_method="greedy", n_shared_experts=2),
    # V2-like: q_lora, softmax group-limited (4 groups, best 2), YaRN, scaling 16
    "v2_grouped": lambda: _v2(q_lora_rank=24, topk_method="group_limited_greedy", n_group=4,
                              topk_group=2, n_shared_experts=1, routed_scaling_factor=16.0,
                              max_position_embeddings=256, rope_parameters=YARN),
}  # fmt: skip


def save_random_hf(
    config: hf.PretrainedConfig,
    path: Path,
    experts: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.nn.Module:
    """Saves a random HF model of `config` to `path` and returns it. Norms, biases and the
    router's correction bias get random values (HF starts them at 1 / 0), so a dropped one
    shows; `experts` replaces each routed-expert weight (e.g. rounded to a pool format)."""
    torch.manual_seed(0)
    model = hf.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith(".bias"):
                p.normal_(0.0, 0.1)
            elif "norm." in n:
                p.normal_(1.0, 0.2)
            elif experts is not None and ".experts." in n:
                p.copy_(experts(p))
        for n, b in model.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1)
    model.save_pretrained(path)
    return model


def save_deepseek(name: str, path: Path, bf16_experts: bool = False) -> torch.nn.Module:
    """`save_random_hf` of case `name`; `bf16_experts` rounds the routed experts to bf16 (the
    pool's bf16 format is then exact)."""
    config = CASES[name]()
    return save_random_hf(
        config, path, (lambda w: w.to(torch.bfloat16).float()) if bf16_experts else None
    )

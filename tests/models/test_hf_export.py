"""models/hf_export: a `ModelConfig` written as an HF config, read by transformers' own config
class and read back, is the same config (for every supported architecture)."""

from __future__ import annotations

import dataclasses

import pytest
import transformers as hf

from tandem.models.config import SUPPORTED_ARCHITECTURES, ModelConfig
from tandem.models.hf_export import to_hf_config_dict
from tests.models.deepseek_cases import CASES as DEEPSEEK_CASES

TINY = dict(
    vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
)  # fmt: skip
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
CASES = {
    "llama": lambda: hf.LlamaConfig(**TINY),
    "llama_bias": lambda: hf.LlamaConfig(**TINY, attention_bias=True, mlp_bias=True),
    "mistral": lambda: hf.MistralConfig(**TINY, head_dim=24, sliding_window=32),
    "mistral_no_window": lambda: hf.MistralConfig(**TINY, sliding_window=None),
    "qwen2": lambda: hf.Qwen2Config(**TINY),
    "qwen3": lambda: hf.Qwen3Config(**TINY, head_dim=32),
    "qwen3_moe": lambda: hf.Qwen3MoeConfig(**TINY, **MOE, mlp_only_layers=[0]),
    "qwen3_moe_bias": lambda: hf.Qwen3MoeConfig(**TINY, **MOE, attention_bias=True),
    "qwen2_moe": lambda: hf.Qwen2MoeConfig(**TINY, **MOE, shared_expert_intermediate_size=48),
    "qwen2_moe_no_bias": lambda: hf.Qwen2MoeConfig(**TINY, **MOE, qkv_bias=False),
    "qwen2_moe_no_shared": lambda: hf.Qwen2MoeConfig(
        **TINY, **MOE, shared_expert_intermediate_size=0
    ),
    "mixtral": lambda: hf.MixtralConfig(**TINY, num_local_experts=4, sliding_window=64),
    "olmoe": lambda: hf.OlmoeConfig(**TINY, num_experts=8, num_experts_per_tok=2),
    "qwen2_window": lambda: hf.Qwen2Config(
        **{**TINY, "num_hidden_layers": 3},
        use_sliding_window=True,
        sliding_window=16,
        max_window_layers=1,
    ),  # fmt: skip
    "gpt_oss": lambda: hf.GptOssConfig(
        **{**TINY, "num_hidden_layers": 3},
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=16,
        swiglu_limit=5.0,
        head_dim=16,
    ),  # fmt: skip
    "olmoe_clip_bias_renorm": lambda: hf.OlmoeConfig(
        **TINY, num_experts=8, clip_qkv=2.5, attention_bias=True, norm_topk_prob=True
    ),
    **{f"deepseek_{name}": make for name, make in DEEPSEEK_CASES.items()},
    "glm4_moe": lambda: hf.Glm4MoeConfig(
        **TINY, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        n_shared_experts=1, first_k_dense_replace=1, n_group=4, topk_group=2,
        routed_scaling_factor=2.5, attention_bias=True, use_qk_norm=True,
    ),
    "glm4_moe_quarter_rotary": lambda: hf.Glm4MoeConfig(
        **TINY, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        partial_rotary_factor=0.25, norm_topk_prob=False,
    ),
}  # fmt: skip


def _fields(cfg: ModelConfig) -> dict:
    d = dataclasses.asdict(cfg)
    d.pop("extra")
    d.pop("torch_dtype")  # the checkpoint's, not the model's
    return d


@pytest.mark.parametrize("name", list(CASES))
def test_config_survives_hf_round_trip(name: str) -> None:
    ours = ModelConfig.from_hf_dict(CASES[name]().to_dict())
    back = hf.AutoConfig.for_model(**to_hf_config_dict(ours)).to_dict()
    assert _fields(ModelConfig.from_hf_dict(back)) == _fields(ours)


def test_every_architecture_has_a_case() -> None:
    read = {ModelConfig.from_hf_dict(make().to_dict()).architecture for make in CASES.values()}
    assert read == set(SUPPORTED_ARCHITECTURES)

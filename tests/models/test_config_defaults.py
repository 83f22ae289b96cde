"""models/config: a config.json that leaves keys out means what transformers' config class makes
of it (its per-family defaults: Mixtral's rope theta and norm eps, Qwen3's head_dim of 128, the
MoE families' expert counts and sizes, whether top-k weights are renormalized)."""

from __future__ import annotations

import pytest
import transformers as hf

from tandem.models.config import SUPPORTED_ARCHITECTURES, ModelConfig

REQUIRED = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4)
HF_CLASSES = {
    "LlamaForCausalLM": hf.LlamaConfig,
    "MistralForCausalLM": hf.MistralConfig,
    "Qwen2ForCausalLM": hf.Qwen2Config,
    "Qwen3ForCausalLM": hf.Qwen3Config,
    "Qwen2MoeForCausalLM": hf.Qwen2MoeConfig,
    "Qwen3MoeForCausalLM": hf.Qwen3MoeConfig,
    "MixtralForCausalLM": hf.MixtralConfig,
    "OlmoeForCausalLM": hf.OlmoeConfig,
    "DeepseekV2ForCausalLM": hf.DeepseekV2Config,
    "DeepseekV3ForCausalLM": hf.DeepseekV3Config,
    "Glm4MoeForCausalLM": hf.Glm4MoeConfig,
    "GptOssForCausalLM": hf.GptOssConfig,
}


def _hf_view(arch: str, c: hf.PretrainedConfig) -> dict[str, object]:
    """What transformers' modeling code of `arch` takes from config `c`."""
    moe = arch in (
        "Qwen2MoeForCausalLM",
        "Qwen3MoeForCausalLM",
        "MixtralForCausalLM",
        "OlmoeForCausalLM",
        "GptOssForCausalLM",
    )
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    experts = getattr(c, "num_local_experts", None) or getattr(c, "num_experts", None)
    view = {
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_parameters["rope_theta"],
        "max_position_embeddings": c.max_position_embeddings,
        "head_dim": head_dim,
        "num_experts": experts if moe else 0,
        "num_experts_per_tok": c.num_experts_per_tok if moe else 0,
        "shared_expert_intermediate_size": getattr(c, "shared_expert_intermediate_size", 0),
    }
    if arch.startswith("Deepseek"):  # MLA and DeepSeek MoE (V2's router never renormalizes)
        view.update(
            num_experts=c.n_routed_experts,
            num_experts_per_tok=c.num_experts_per_tok or 0,
            moe_intermediate_size=c.moe_intermediate_size,
            norm_topk_prob=arch == "DeepseekV3ForCausalLM" and c.norm_topk_prob,
            intermediate_size=c.intermediate_size,
            q_lora_rank=c.q_lora_rank or 0,
            kv_lora_rank=c.kv_lora_rank,
            qk_nope_head_dim=c.qk_nope_head_dim,
            qk_rope_head_dim=c.qk_rope_head_dim,
            v_head_dim=c.v_head_dim,
            n_shared_experts=c.n_shared_experts,
            first_k_dense_replace=c.first_k_dense_replace,
            routed_scaling_factor=c.routed_scaling_factor,
        )
    elif arch == "Glm4MoeForCausalLM":  # DeepSeek-V3's MoE, partial rotary
        view.update(
            num_experts=c.n_routed_experts,
            num_experts_per_tok=c.num_experts_per_tok,
            moe_intermediate_size=c.moe_intermediate_size,
            norm_topk_prob=c.norm_topk_prob,
            intermediate_size=c.intermediate_size,
            n_shared_experts=c.n_shared_experts,
            first_k_dense_replace=c.first_k_dense_replace,
            routed_scaling_factor=c.routed_scaling_factor,
            partial_rotary_factor=c.rope_parameters.get("partial_rotary_factor", 1.0),
        )
    elif moe:
        qwen = arch in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
        view["moe_intermediate_size"] = c.moe_intermediate_size if qwen else c.intermediate_size
        renormalized = arch in ("MixtralForCausalLM", "GptOssForCausalLM")
        view["norm_topk_prob"] = True if renormalized else c.norm_topk_prob
    return view


@pytest.mark.parametrize("arch", SUPPORTED_ARCHITECTURES)
def test_omitted_keys_take_transformers_defaults(arch: str) -> None:
    assert set(HF_CLASSES) == set(SUPPORTED_ARCHITECTURES)
    d = {"architectures": [arch], **REQUIRED}
    if arch in ("MixtralForCausalLM", "OlmoeForCausalLM"):
        d["intermediate_size"] = 96  # their experts' size: no default worth testing with
    ours = ModelConfig.from_hf_dict(d)
    expected = _hf_view(
        arch, HF_CLASSES[arch](**{k: v for k, v in d.items() if k != "architectures"})
    )
    got = {k: getattr(ours, k) for k in expected}
    assert got == pytest.approx(expected), arch


def test_either_spelling_of_the_expert_count() -> None:
    """transformers >= 5 writes Qwen3-MoE's num_experts as num_local_experts."""
    for key in ("num_experts", "num_local_experts"):
        d = {"architectures": ["Qwen3MoeForCausalLM"], **REQUIRED, key: 6}
        assert ModelConfig.from_hf_dict(d).num_experts == 6

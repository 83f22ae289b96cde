"""ModelConfig → an HF `config.json` dict, so weights Tandem loaded (from GGUF, say) can be
handed to HF transformers (parity tests, benchmarks) or written as an HF directory.
"""

from __future__ import annotations

from typing import Any

from tandem.models.config import ModelConfig

_MODEL_TYPES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "MixtralForCausalLM": "mixtral",
    "OlmoeForCausalLM": "olmoe",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "GptOssForCausalLM": "gpt_oss",
    "Glm4MoeForCausalLM": "glm4_moe",
}
# Families whose code windows every layer or none, whatever layer_types says
_ALL_LAYERS_WINDOWED = ("MistralForCausalLM", "MixtralForCausalLM", "Qwen3MoeForCausalLM")


def to_hf_config_dict(cfg: ModelConfig) -> dict[str, Any]:
    d: dict[str, Any] = {
        "architectures": [cfg.architecture],
        "model_type": _MODEL_TYPES[cfg.architecture],
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_position_embeddings,
        "sliding_window": cfg.sliding_window,
        "use_sliding_window": cfg.sliding_window is not None,  # the Qwen families' switch
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "hidden_act": cfg.hidden_act,
        "attention_bias": cfg.attention_bias,  # Llama, Qwen3(-MoE), OLMoE: q/k/v and o_proj
        "qkv_bias": cfg.attention_bias,  # Qwen2-MoE (transformers >= 5)
        "mlp_bias": cfg.mlp_bias,  # Llama
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": list(cfg.eos_token_ids)
        if len(cfg.eos_token_ids) > 1
        else (cfg.eos_token_ids[0] if cfg.eos_token_ids else None),
    }
    if cfg.rope_scaling:
        d["rope_scaling"] = dict(cfg.rope_scaling)
    if cfg.architecture not in _ALL_LAYERS_WINDOWED:
        d["layer_types"] = [
            "sliding_attention" if i in cfg.sliding_layers else "full_attention"
            for i in range(cfg.num_hidden_layers)
        ]
    if cfg.architecture == "GptOssForCausalLM":
        d["swiglu_alpha"] = cfg.swiglu_alpha
        d["swiglu_limit"] = cfg.swiglu_limit
    if cfg.is_moe:
        d["num_experts_per_tok"] = cfg.num_experts_per_tok
        if cfg.architecture in ("MixtralForCausalLM", "GptOssForCausalLM"):
            d["num_local_experts"] = cfg.num_experts
            d["intermediate_size"] = cfg.moe_intermediate_size
        elif cfg.architecture == "OlmoeForCausalLM":  # experts sized by intermediate_size
            d["num_experts"] = cfg.num_experts
            d["intermediate_size"] = cfg.moe_intermediate_size
            d["norm_topk_prob"] = cfg.norm_topk_prob
            d["clip_qkv"] = cfg.clip_qkv
        else:
            d["num_experts"] = cfg.num_experts
            d["moe_intermediate_size"] = cfg.moe_intermediate_size
            d["norm_topk_prob"] = cfg.norm_topk_prob
            d["decoder_sparse_step"] = cfg.decoder_sparse_step
            d["mlp_only_layers"] = list(cfg.mlp_only_layers)
        if cfg.architecture == "Qwen2MoeForCausalLM":  # 0 too: transformers' default is 5632
            d["shared_expert_intermediate_size"] = cfg.shared_expert_intermediate_size
    if cfg.is_mla:
        for key in (
            "num_experts",
            "head_dim",
            "decoder_sparse_step",
            "mlp_only_layers",
            "qkv_bias",
        ):
            d.pop(key, None)  # other families' keys; DeepSeek's config derives head_dim itself
        d.update(_deepseek_fields(cfg))
    if cfg.architecture == "Glm4MoeForCausalLM":
        d.update(
            n_routed_experts=cfg.num_experts,
            n_shared_experts=cfg.n_shared_experts,
            first_k_dense_replace=cfg.first_k_dense_replace,
            routed_scaling_factor=cfg.routed_scaling_factor,
            n_group=cfg.n_group,
            topk_group=cfg.topk_group,
            use_qk_norm=cfg.qk_norm,
            partial_rotary_factor=cfg.partial_rotary_factor,
        )
    return d


def _deepseek_fields(cfg: ModelConfig) -> dict[str, Any]:
    d = {
        "n_routed_experts": cfg.num_experts,
        "n_shared_experts": cfg.n_shared_experts,
        "first_k_dense_replace": cfg.first_k_dense_replace,
        "routed_scaling_factor": cfg.routed_scaling_factor,
        "n_group": cfg.n_group,
        "topk_group": cfg.topk_group,
        "topk_method": cfg.topk_method,
        "q_lora_rank": cfg.q_lora_rank or None,
        "kv_lora_rank": cfg.kv_lora_rank,
        "qk_nope_head_dim": cfg.qk_nope_head_dim,
        "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "v_head_dim": cfg.v_head_dim,
    }
    if cfg.architecture == "DeepseekV3ForCausalLM":
        d["rope_interleave"] = cfg.rope_interleave
        d["scoring_func"] = "sigmoid"
    return d

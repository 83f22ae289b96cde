"""llama.cpp's "deepseek2" GGUF architecture (DeepSeek-V2/V3, Kimi-K2): its metadata as a
`ModelConfig`, its MLA tensor names as HF's, and the newer files' split `attn_k_b` / `attn_v_b`
merged back into HF's `kv_b_proj`.

Two layouts exist. Older files keep `attn_kv_b` `[H * (nope + v), L]` and describe the heads by
key_length = nope + rope, value_length = v. Newer ones store `attn_k_b` `[H, L, nope]` (W_UK
transposed) and `attn_v_b` `[H, v, L]`, with key_length / value_length describing the
latent "MQA" view (L + rope, L) and key_length_mla / value_length_mla the heads. The rope dims
keep DeepSeek's interleaved pairs (llama.cpp's "normal" rope), as in the HF checkpoints.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from tandem.models.config import ModelConfig, UnsupportedModelError
from tandem.models.gguf_reader import GGUFReader

ARCH = "deepseek2"
# gating function ids of llama.cpp's expert_gating_func
_SOFTMAX, _SIGMOID = 1, 2

LAYER_NAMES = {
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",
    "attn_k_b": "self_attn.k_b_proj",  # merged with v_b into kv_b_proj (merge_kv_b)
    "attn_v_b": "self_attn.v_b_proj",
    "exp_probs_b": "mlp.gate.e_score_correction",  # + ".bias" -> e_score_correction_bias
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
}


def deepseek2_config(reader: GGUFReader, common: dict[str, Any]) -> ModelConfig:
    """`common`: the fields every architecture reads the same way (models/loader/gguf.py)."""

    def key(name: str, default: Any = None) -> Any:
        return reader.get(f"{ARCH}.{name}", default)

    rope = int(key("rope.dimension_count"))
    split = "blk.0.attn_k_b.weight" in reader.tensors
    if split:
        qk_head, v_head = key("attention.key_length_mla"), key("attention.value_length_mla")
    else:
        qk_head, v_head = key("attention.key_length"), key("attention.value_length")
    if qk_head is None or v_head is None:
        raise UnsupportedModelError("deepseek2 GGUF without its attention key/value lengths")
    gating = int(key("expert_gating_func", _SOFTMAX) or _SOFTMAX)
    if gating not in (_SOFTMAX, _SIGMOID):
        raise UnsupportedModelError(f"unsupported deepseek2 expert_gating_func {gating}")
    sigmoid = gating == _SIGMOID
    n_group = int(key("expert_group_count", 1) or 1)
    topk_group = int(key("expert_group_used_count", n_group) or n_group)
    if sigmoid:
        topk_method = "noaux_tc"
    else:
        topk_method = "group_limited_greedy" if n_group > 1 else "greedy"
    scaling = common.pop("rope_scaling")
    if scaling is not None and scaling["rope_type"] == "yarn":
        # llama.cpp keeps 0.1 * mscale_all_dim; DeepSeek's configs set mscale equal to it
        log_mul = key("rope.scaling.yarn_log_multiplier")
        if log_mul:
            scaling["mscale"] = scaling["mscale_all_dim"] = float(log_mul) / 0.1
    experts = int(key("expert_count", 0) or 0)
    if experts == 0:
        raise UnsupportedModelError("deepseek2 GGUF without experts is not supported")
    return ModelConfig(
        architecture="DeepseekV3ForCausalLM" if sigmoid else "DeepseekV2ForCausalLM",
        **common,
        num_key_value_heads=common["num_attention_heads"],
        head_dim=rope,
        rope_scaling=scaling,
        attention_bias="blk.0.attn_kv_a_mqa.bias" in reader.tensors,
        o_proj_bias="blk.0.attn_output.bias" in reader.tensors,
        num_experts=experts,
        num_experts_per_tok=int(key("expert_used_count", 0) or 0),
        moe_intermediate_size=int(key("expert_feed_forward_length", 0) or 0),
        norm_topk_prob=sigmoid and bool(key("expert_weights_norm", False)),
        first_k_dense_replace=int(key("leading_dense_block_count", 0) or 0),
        n_shared_experts=int(key("expert_shared_count", 0) or 0),
        scoring_func="sigmoid" if sigmoid else "softmax",
        topk_method=topk_method,
        n_group=n_group,
        topk_group=topk_group,
        routed_scaling_factor=float(key("expert_weights_scale", 1.0) or 1.0),
        q_lora_rank=int(key("attention.q_lora_rank", 0) or 0),
        kv_lora_rank=int(key("attention.kv_lora_rank")),
        qk_nope_head_dim=int(qk_head) - rope,
        qk_rope_head_dim=rope,
        v_head_dim=int(v_head),
        rope_interleave=True,
    )


def merge_kv_b(
    pieces: Iterator[tuple[str, torch.Tensor]], config: ModelConfig
) -> Iterator[tuple[str, torch.Tensor]]:
    """Passes HF-named tensors through, except each layer's `k_b_proj` `[H, L, nope]` and
    `v_b_proj` `[H, v, L]`, which leave as one `kv_b_proj` `[H * (nope + v), L]` once both
    arrived."""
    held: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in pieces:
        for part in ("k_b_proj", "v_b_proj"):
            if f".self_attn.{part}." in name:
                target = name.replace(part, "kv_b_proj")
                got = held.setdefault(target, {})
                got[part] = tensor
                if len(got) == 2:
                    del held[target]
                    yield target, _kv_b(got["k_b_proj"], got["v_b_proj"], config)
                break
        else:
            yield name, tensor
    if held:
        raise UnsupportedModelError(f"deepseek2 GGUF: attn_k_b without attn_v_b for {list(held)}")


def _kv_b(k_b: torch.Tensor, v_b: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    heads, latent = config.num_attention_heads, config.kv_lora_rank
    nope, v = config.qk_nope_head_dim, config.v_head_dim
    if tuple(k_b.shape) != (heads, latent, nope) or tuple(v_b.shape) != (heads, v, latent):
        raise UnsupportedModelError(
            f"deepseek2 GGUF: attn_k_b {tuple(k_b.shape)} / attn_v_b {tuple(v_b.shape)} do not "
            f"match heads={heads}, kv_lora_rank={latent}, nope={nope}, v={v}"
        )
    return torch.cat((k_b.transpose(1, 2), v_b), dim=1).reshape(heads * (nope + v), latent)

"""llama.cpp's "glm4moe" GGUF architecture (GLM-4.5 / 4.5-Air / 4.6): its metadata as a
`ModelConfig` and its tensor names as HF's.

The files count the multi-token-prediction layers in `block_count` (`nextn_predict_layers` of
them, last); Tandem does not run those layers, so their tensors (`blk.N.nextn.*` and the
layer's own) are left unread (`num_main_layers`). Rotary covers `rope.dimension_count` of each
head's `key_length` dims, in HF's rotate_half order (llama.cpp's neox rope: no q/k
permutation); routing is DeepSeek-V3's (sigmoid + `exp_probs_b`, groups, shared experts).
"""

from __future__ import annotations

from typing import Any

from tandem.models.config import ModelConfig, UnsupportedModelError
from tandem.models.gguf_reader import GGUFReader

ARCH = "glm4moe"
_SIGMOID = 2  # llama.cpp's expert_gating_func

LAYER_NAMES = {
    "exp_probs_b": "mlp.gate.e_score_correction",  # + ".bias" -> e_score_correction_bias
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
}


def num_main_layers(reader: GGUFReader) -> int:
    """Decoder layers Tandem runs: block_count less the trailing next-token-prediction ones."""
    blocks = int(reader.get(f"{ARCH}.block_count"))
    nextn = int(reader.get(f"{ARCH}.nextn_predict_layers", 0) or 0)
    if not 0 <= nextn < blocks:
        raise UnsupportedModelError(f"glm4moe GGUF: {nextn} nextn layers of {blocks} blocks")
    return blocks - nextn


def glm4moe_config(reader: GGUFReader, common: dict[str, Any]) -> ModelConfig:
    """`common`: the fields every architecture reads the same way (models/loader/gguf.py)."""

    def key(name: str, default: Any = None) -> Any:
        return reader.get(f"{ARCH}.{name}", default)

    heads = common["num_attention_heads"]
    head_dim = int(key("attention.key_length") or common["hidden_size"] // heads)
    rope_dims = int(key("rope.dimension_count") or head_dim // 2)
    gating = int(key("expert_gating_func", _SIGMOID) or _SIGMOID)
    if gating != _SIGMOID:
        raise UnsupportedModelError(f"glm4moe GGUF with expert_gating_func {gating} (not sigmoid)")
    experts = int(key("expert_count", 0) or 0)
    if experts == 0:
        raise UnsupportedModelError("glm4moe GGUF without experts is not supported")
    n_group = int(key("expert_group_count", 1) or 1)
    kv_heads = key("attention.head_count_kv", heads)
    if isinstance(kv_heads, list):
        kv_heads = kv_heads[0]
    return ModelConfig(
        architecture="Glm4MoeForCausalLM",
        **common,
        num_key_value_heads=int(kv_heads),
        head_dim=head_dim,
        partial_rotary_factor=rope_dims / head_dim,
        attention_bias="blk.0.attn_q.bias" in reader.tensors,
        qk_norm="blk.0.attn_q_norm.weight" in reader.tensors,
        num_experts=experts,
        num_experts_per_tok=int(key("expert_used_count", 0) or 0),
        moe_intermediate_size=int(key("expert_feed_forward_length", 0) or 0),
        norm_topk_prob=bool(key("expert_weights_norm", True)),
        first_k_dense_replace=int(key("leading_dense_block_count", 0) or 0),
        n_shared_experts=int(key("expert_shared_count", 0) or 0),
        scoring_func="sigmoid",
        topk_method="noaux_tc",
        n_group=n_group,
        topk_group=int(key("expert_group_used_count", n_group) or n_group),
        routed_scaling_factor=float(key("expert_weights_scale", 1.0) or 1.0),
    )

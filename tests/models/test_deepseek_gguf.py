"""llama.cpp's "deepseek2" GGUF: files written with the `gguf` package from tiny random HF
DeepSeek models, in both layouts (one attn_kv_b; split attn_k_b / attn_v_b with the MLA key
and value lengths), as llama.cpp's converter lays them out; their config and logits match the
HF model they were written from.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tandem.models.loader.gguf import gguf_model_config
from tests.models.deepseek_cases import CASES, save_deepseek
from tests.models.test_gguf import (
    _assert_hf_logits,
    _assert_pool_logits,
    _gguf_tensors,
    _moe_expert_tensors,
    _write_gguf,
)

_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.q_a_proj": "attn_q_a",
    "self_attn.q_a_layernorm": "attn_q_a_norm", "self_attn.q_b_proj": "attn_q_b",
    "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa", "self_attn.kv_a_layernorm": "attn_kv_a_norm",
    "self_attn.kv_b_proj": "attn_kv_b", "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp", "mlp.shared_experts.gate_proj": "ffn_gate_shexp",
    "mlp.shared_experts.up_proj": "ffn_up_shexp", "mlp.shared_experts.down_proj": "ffn_down_shexp",
}  # fmt: skip


def _deepseek2_gguf(name: str, split: bool, tmp_path: Path, bf16_experts: bool = False):
    ref = save_deepseek(name, tmp_path / "hf", bf16_experts)
    c = CASES[name]()
    heads, nope, v, lora = c.num_attention_heads, c.qk_nope_head_dim, c.v_head_dim, c.kv_lora_rank
    inter = c.moe_intermediate_size

    def layer_tensors(rest: str, a: np.ndarray) -> dict[str, np.ndarray]:
        experts = _moe_expert_tensors(rest, a, inter)
        if experts is not None:
            return experts
        if rest == "self_attn.kv_b_proj.weight" and split:  # W_UK transposed, W_UV
            kv_b = a.reshape(heads, nope + v, lora)
            return {"attn_k_b.weight": np.ascontiguousarray(kv_b[:, :nope].transpose(0, 2, 1)),
                    "attn_v_b.weight": np.ascontiguousarray(kv_b[:, nope:])}  # fmt: skip
        module, kind = rest.rsplit(".", 1)
        return {f"{_NAMES[module]}.{kind}": a}

    tensors = _gguf_tensors(ref, layer_tensors)
    sigmoid = c.model_type == "deepseek_v3"
    rope = c.qk_rope_head_dim
    a = "deepseek2"
    kv: dict = {
        f"{a}.block_count": c.num_hidden_layers, f"{a}.embedding_length": c.hidden_size,
        f"{a}.feed_forward_length": c.intermediate_size, f"{a}.vocab_size": c.vocab_size,
        f"{a}.attention.head_count": heads, f"{a}.rope.freq_base": 10000.0,
        f"{a}.attention.layer_norm_rms_epsilon": c.rms_norm_eps,
        f"{a}.context_length": c.max_position_embeddings,
        f"{a}.leading_dense_block_count": c.first_k_dense_replace,
        f"{a}.attention.kv_lora_rank": lora, f"{a}.rope.dimension_count": rope,
        f"{a}.expert_feed_forward_length": inter, f"{a}.expert_count": c.n_routed_experts,
        f"{a}.expert_used_count": c.num_experts_per_tok,
        f"{a}.expert_shared_count": c.n_shared_experts,
        f"{a}.expert_weights_scale": float(c.routed_scaling_factor),
        f"{a}.expert_weights_norm": bool(c.norm_topk_prob),
        f"{a}.expert_gating_func": 2 if sigmoid else 1,
    }  # fmt: skip
    if c.q_lora_rank:
        kv[f"{a}.attention.q_lora_rank"] = c.q_lora_rank
    if sigmoid or c.topk_method == "group_limited_greedy":
        kv[f"{a}.expert_group_count"] = c.n_group
        kv[f"{a}.expert_group_used_count"] = c.topk_group
    if split:  # the latent "MQA" view, and the heads' own lengths
        kv.update({f"{a}.attention.head_count_kv": 1, f"{a}.attention.key_length": lora + rope,
                   f"{a}.attention.value_length": lora,
                   f"{a}.attention.key_length_mla": nope + rope,
                   f"{a}.attention.value_length_mla": v})  # fmt: skip
    else:
        kv.update({f"{a}.attention.head_count_kv": heads,
                   f"{a}.attention.key_length": nope + rope, f"{a}.attention.value_length": v})  # fmt: skip
    scaling = c.rope_parameters
    if scaling.get("rope_type") == "yarn":
        kv.update({f"{a}.rope.scaling.type": "yarn", f"{a}.rope.scaling.factor": scaling["factor"],
                   f"{a}.rope.scaling.original_context_length":
                       scaling["original_max_position_embeddings"],
                   f"{a}.rope.scaling.yarn_log_multiplier": 0.1 * scaling["mscale_all_dim"]})  # fmt: skip
    path = tmp_path / f"{name}.gguf"
    _write_gguf(path, a, kv, tensors)
    return path, ref


@pytest.mark.parametrize(
    "name,split", [("v3", True), ("v3", False), ("v2_grouped", False), ("v2_lite", True)]
)
def test_deepseek2_gguf_matches_hf(name: str, split: bool, tmp_path: Path, paged_runner) -> None:
    path, ref = _deepseek2_gguf(name, split, tmp_path)
    cfg = gguf_model_config(path)
    c = CASES[name]()
    assert cfg.architecture == (
        "DeepseekV3ForCausalLM" if name == "v3" else "DeepseekV2ForCausalLM"
    )
    assert (cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank) == (
        c.qk_nope_head_dim, c.v_head_dim, c.kv_lora_rank)  # fmt: skip
    assert (cfg.q_lora_rank, cfg.first_k_dense_replace) == (c.q_lora_rank or 0, 1)
    _assert_hf_logits(path, ref, [5, 17, 3, 60, 9, 1, 33, 2, 90, 11, 4], paged_runner)


def test_deepseek2_gguf_experts_into_the_pool(tmp_path: Path, paged_runner) -> None:
    """--cpu-experts all on a deepseek2 GGUF: the routed experts go from the file's stacked
    tensors straight into the pool (float32 -> bf16, exact for bf16-valued experts)."""
    path, ref = _deepseek2_gguf("v3", True, tmp_path, bf16_experts=True)
    _assert_pool_logits(path, ref, paged_runner)


def test_split_layout_without_v_b_is_refused(tmp_path: Path) -> None:
    from tandem.models.config import UnsupportedModelError
    from tandem.models.loader import load_model

    path, _ = _deepseek2_gguf("v2_lite", True, tmp_path)
    import gguf

    reader = gguf.GGUFReader(path)
    tensors = {t.name: np.array(t.data).reshape([int(x) for x in reversed(t.shape)])
               for t in reader.tensors if t.name != "blk.2.attn_v_b.weight"}  # fmt: skip
    kv = {}
    for k, f in reader.fields.items():
        if k.startswith("GGUF.") or k == "general.architecture":
            continue
        val = f.contents()
        kv[k] = float(val) if isinstance(val, float) else val
    bad = tmp_path / "bad.gguf"
    _write_gguf(bad, "deepseek2", kv, tensors)
    with pytest.raises(UnsupportedModelError, match="attn_k_b without attn_v_b"):
        load_model(bad, dtype=torch.float32, device="cpu")

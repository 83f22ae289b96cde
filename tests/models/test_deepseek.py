"""DeepSeek-V2/V3 against HF transformers: tiny random checkpoints loaded with `load_model` and run
as a ragged, chunk-prefilled, mixed prefill+decode batch through the paged latent cache; every
logit row must match HF's full-sequence forward at that position. Plus the config rules
(defaults, kimi_k2, MTP layers) and the routing function against transformers' routers.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers as hf

from tandem.models.batch import KVCache
from tandem.models.config import ModelConfig
from tandem.models.layers.moe_routing import deepseek_route
from tandem.models.loader import load_model
from tests.models.deepseek_cases import CASES, save_deepseek

PROMPT_LENS = [5, 17, 33, 9]


def _run_mixed(model, config, paged_runner, block_size: int):
    runner = paged_runner(model, config, block_size=block_size, seed=block_size)
    gen = torch.Generator().manual_seed(1)
    seqs = {
        i: torch.randint(0, config.vocab_size, (n,), generator=gen).tolist()
        for i, n in enumerate(PROMPT_LENS)
    }
    rows: dict[int, list[torch.Tensor]] = {i: [] for i in seqs}

    def run(work, sample):
        for seq_id, logits in runner.step(work).items():
            rows[seq_id].append(logits)
            if seq_id in sample:
                seqs[seq_id].append(int(logits[-1].argmax()))

    run([(0, seqs[0][:5]), (1, seqs[1][:8]), (2, seqs[2][:16])], sample={0})
    run([(1, seqs[1][8:17]), (0, seqs[0][5:6]), (2, seqs[2][16:33]), (3, seqs[3][:9])],
        sample={0, 1, 2, 3})  # fmt: skip
    for order in ([3, 1, 0, 2], [0, 1, 2, 3], [2, 3, 1, 0]):
        run([(i, seqs[i][-1:]) for i in order], sample=set(order))
    return runner, seqs, {i: torch.cat(r) for i, r in rows.items()}


def max_rel_diff(hf_model, seqs, rows) -> float:
    worst = 0.0
    for seq_id, ours in rows.items():
        ids = torch.tensor([seqs[seq_id][: ours.shape[0]]])
        with torch.no_grad():
            ref = hf_model(ids).logits[0].float()
        worst = max(worst, float((ours - ref).abs().max() / ref.abs().max()))
    return worst


@pytest.mark.parametrize(
    "name,block_size",
    [("v3", 4), ("v3", 16), ("v3_yarn_noq", 16), ("v2_lite", 4), ("v2_grouped", 16)],
)
def test_parity_with_hf(name: str, block_size: int, tmp_path: Path, paged_runner) -> None:
    hf_model = save_deepseek(name, tmp_path)
    model, config = load_model(tmp_path, dtype=torch.float32, device="cpu")
    assert type(model).__name__ == config.architecture and config.is_mla
    runner, seqs, rows = _run_mixed(model, config, paged_runner, block_size)
    # the cache is the latent layout: one [blocks, block_size, L + R] tensor a layer
    kv = runner.kv_cache
    assert not kv.k and not kv.v and len(kv.latent) == config.num_hidden_layers
    assert kv.latent[0].shape[1:] == (block_size, 32 + 8)
    assert max_rel_diff(hf_model, seqs, rows) < 1e-4


def test_config_reads_the_family_rules(tmp_path: Path) -> None:
    save_deepseek("v3", tmp_path)
    d = json.loads((tmp_path / "config.json").read_text())
    c = ModelConfig.from_hf_dict(d)
    assert (c.q_lora_rank, c.kv_lora_rank, c.head_dim, c.latent_dim) == (24, 32, 8, 40)
    assert (c.scoring_func, c.n_group, c.topk_group, c.routed_scaling_factor) == (
        "sigmoid", 4, 2, 2.5)  # fmt: skip
    assert [c.is_moe_layer(i) for i in range(3)] == [False, True, True]
    # Kimi-K2: model_type kimi_k2 with the V3 architecture, or by model_type alone
    kimi = ModelConfig.from_hf_dict({**d, "model_type": "kimi_k2", "architectures": None})
    assert kimi.architecture == "DeepseekV3ForCausalLM" and kimi.n_group == 4
    # keys left out take transformers' family defaults
    bare = {k: d[k] for k in ("vocab_size", "hidden_size", "num_hidden_layers",
                              "num_attention_heads", "architectures")}  # fmt: skip
    v3 = ModelConfig.from_hf_dict(bare)
    ref = hf.DeepseekV3Config(**{k: v for k, v in bare.items() if k != "architectures"})
    assert (v3.q_lora_rank, v3.kv_lora_rank, v3.qk_nope_head_dim, v3.v_head_dim) == (
        ref.q_lora_rank, ref.kv_lora_rank, ref.qk_nope_head_dim, ref.v_head_dim)  # fmt: skip
    assert (v3.num_experts, v3.num_experts_per_tok, v3.moe_intermediate_size) == (
        ref.n_routed_experts, ref.num_experts_per_tok, ref.moe_intermediate_size)  # fmt: skip
    assert (v3.first_k_dense_replace, v3.n_shared_experts, v3.n_group, v3.topk_group) == (
        ref.first_k_dense_replace, ref.n_shared_experts, ref.n_group, ref.topk_group)  # fmt: skip
    assert v3.routed_scaling_factor == ref.routed_scaling_factor and v3.norm_topk_prob
    assert v3.intermediate_size == ref.intermediate_size and v3.rope_interleave
    bare2 = {**bare, "architectures": ["DeepseekV2ForCausalLM"], "num_experts_per_tok": 6}
    v2 = ModelConfig.from_hf_dict(bare2)
    ref2 = hf.DeepseekV2Config(**{k: v for k, v in bare2.items() if k != "architectures"})
    assert (v2.q_lora_rank, v2.num_experts, v2.moe_intermediate_size, v2.n_shared_experts) == (
        ref2.q_lora_rank, ref2.n_routed_experts, ref2.moe_intermediate_size,
        ref2.n_shared_experts)  # fmt: skip
    assert (v2.first_k_dense_replace, v2.topk_method, v2.scoring_func) == (0, "greedy", "softmax")
    assert v2.max_position_embeddings == ref2.max_position_embeddings


def test_latent_kv_sizing() -> None:
    c = ModelConfig.from_hf_dict({
        "architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 10, "hidden_size": 7168,
        "num_hidden_layers": 61, "num_attention_heads": 128,
    })  # fmt: skip
    # 576 bf16 values a token and layer, not 128 heads of K (192) and V (128)
    assert KVCache.bytes_per_block_for(c, 16, torch.bfloat16) == 61 * 16 * 576 * 2
    cache = KVCache.for_model(c, 3, 16, torch.bfloat16, "meta")
    assert cache.num_blocks == 3 and len(cache.latent) == 61 and not cache.k


def test_mtp_layers_are_ignored_and_unknown_tensors_refused(tmp_path: Path, paged_runner) -> None:
    from safetensors.torch import load_file, save_file

    from tandem.models.config import UnsupportedModelError

    save_deepseek("v3", tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    extra = {"model.layers.3.eh_proj.weight": torch.zeros(4, 4),
             "model.layers.3.self_attn.kv_a_layernorm.weight": torch.ones(32)}  # fmt: skip
    save_file({**tensors, **extra}, tmp_path / "model.safetensors", metadata={"format": "pt"})
    load_model(tmp_path, dtype=torch.float32, device="cpu")  # layer 3 (MTP) is skipped
    bad = {**tensors, "model.layers.0.self_attn.k_proj.weight": torch.zeros(4, 4)}
    save_file(bad, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(UnsupportedModelError, match="k_proj"):
        load_model(tmp_path, dtype=torch.float32, device="cpu")


@pytest.mark.parametrize("name", list(CASES))
def test_routing_matches_transformers_router(name: str) -> None:
    """The routing function alone against the checkpoint family's HF router, on logits with
    many near ties between groups."""
    config = CASES[name]()
    torch.manual_seed(3)
    if isinstance(config, hf.DeepseekV3Config):
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

        router = DeepseekV3TopkRouter(config)
        router.e_score_correction_bias.normal_(0.0, 0.3)
        bias, scoring, method = router.e_score_correction_bias, "sigmoid", "noaux_tc"
        renorm = config.norm_topk_prob
    else:
        from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

        router = DeepseekV2TopkRouter(config)
        bias, scoring, method, renorm = None, "softmax", config.topk_method, False
    with torch.no_grad():
        router.weight.normal_(0.0, 1.0)
        x = torch.randn(200, config.hidden_size)
        logits, ref_w, ref_ids = router(x)
    ids, w = deepseek_route(
        logits, config.num_experts_per_tok, scoring_func=scoring, topk_method=method,
        n_group=config.n_group or 1, topk_group=config.topk_group or 1, correction_bias=bias,
        renormalize=renorm, scaling_factor=config.routed_scaling_factor,
    )  # fmt: skip
    ours = torch.zeros(200, 8).scatter_add_(1, ids, w)
    ref = torch.zeros(200, 8).scatter_add_(1, ref_ids, ref_w)
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)


def test_correction_bias_stays_float32_in_a_bf16_model(tmp_path: Path) -> None:
    """V3's router bias picks experts by small differences: a bf16 model keeps it float32, as
    stored (transformers keeps it float32 too)."""
    from safetensors.torch import load_file

    save_deepseek("v3", tmp_path)
    stored = load_file(tmp_path / "model.safetensors")[
        "model.layers.1.mlp.gate.e_score_correction_bias"
    ]
    model, _ = load_model(tmp_path, dtype=torch.bfloat16, device="cpu")
    bias = model.layers[1].mlp.e_score_correction_bias
    assert bias.dtype == torch.float32 and torch.equal(bias, stored)
    assert model.layers[1].mlp.gate.weight.dtype == torch.bfloat16

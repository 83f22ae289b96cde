"""Tiny random Qwen3-MoE, Qwen2-MoE, Mixtral and OLMoE checkpoints (HF configs) and the helpers
that the cpu_pool model tests share: save one, quantize an HF reference like the pool, run a
model through the paged runner, compare with HF, build a CPU LLM over a checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import torch
import transformers as hf

from tandem.ext.cpu import quantize

COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    initializer_range=0.05,
)
CASES = {
    "qwen3_moe": lambda: hf.Qwen3MoeConfig(
        **COMMON,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        mlp_only_layers=[0],
    ),
    "qwen2_moe": lambda: hf.Qwen2MoeConfig(
        **COMMON,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
    ),
    "mixtral": lambda: hf.MixtralConfig(**COMMON, num_local_experts=8, num_experts_per_tok=2),
    # whole-row q/k norms and clip_qkv in attention; experts sized by intermediate_size, top-k
    # weights not renormalized
    "olmoe": lambda: hf.OlmoeConfig(
        **{**COMMON, "intermediate_size": 32},
        num_experts=8,
        num_experts_per_tok=2,
        clip_qkv=1.0,
        eos_token_id=2,
    ),
}
# Shapes the kernels pad (hidden and expert sizes not multiples of 32/64), expert counts at the
# edges (1 expert; top-k = all experts) and the Qwen layer rules (sparse step, mlp-only layers),
# tied embeddings. Every token takes every expert (or the only one), so no routing can flip
# between the pool's bf16/int8 activations and HF's fp32.
ODD_CASES = {
    "qwen2_moe_odd": lambda: hf.Qwen2MoeConfig(
        **{
            **COMMON,
            "hidden_size": 72,
            "num_hidden_layers": 3,
            "num_attention_heads": 3,
            "num_key_value_heads": 1,
        },
        decoder_sparse_step=2,  # layer 1 alone is MoE
        num_experts=3,
        num_experts_per_tok=3,
        moe_intermediate_size=40,
        shared_expert_intermediate_size=50,
        norm_topk_prob=True,
    ),
    "qwen3_moe_odd": lambda: hf.Qwen3MoeConfig(
        **{**COMMON, "hidden_size": 136},
        head_dim=34,
        num_experts=5,
        num_experts_per_tok=5,
        moe_intermediate_size=100,
        norm_topk_prob=False,
        mlp_only_layers=[0],
        tie_word_embeddings=True,
    ),
    "mixtral_one_expert": lambda: hf.MixtralConfig(
        **{
            **COMMON,
            "hidden_size": 200,
            "intermediate_size": 40,
            "num_attention_heads": 5,
            "num_key_value_heads": 1,
        },
        num_local_experts=1,
        num_experts_per_tok=1,
        tie_word_embeddings=True,
    ),
}
PROMPT_LENS = [5, 17, 9]


def _expert_params(model: torch.nn.Module):
    return [(n, p) for n, p in model.named_parameters() if ".experts." in n]


def _save(name: str, path: Path) -> torch.nn.Module:
    torch.manual_seed(0)
    config = {**CASES, **ODD_CASES}[name]()
    model = hf.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():
        for _, p in _expert_params(model):
            p.copy_(p.to(torch.bfloat16).float())
    model.save_pretrained(path)
    return model


def _quantize_reference(model: torch.nn.Module, fmt: str, group_size: int = 64) -> None:
    with torch.no_grad():
        for _, p in _expert_params(model):
            p.copy_(quantize(p, fmt, group_size))


def _run(model, config, paged_runner) -> tuple[dict[int, list[int]], dict[int, torch.Tensor]]:
    """Chunked prefill + mixed decode steps; returns the sequences and their logits rows."""
    runner = paged_runner(model, config, block_size=4)
    gen = torch.Generator().manual_seed(1)
    seqs = {
        i: torch.randint(0, config.vocab_size, (n,), generator=gen).tolist()
        for i, n in enumerate(PROMPT_LENS)
    }
    rows: dict[int, list[torch.Tensor]] = {i: [] for i in seqs}
    steps = [[(0, seqs[0]), (1, seqs[1][:8])], [(1, seqs[1][8:]), (2, seqs[2])]]
    for work in steps:
        for seq_id, logits in runner.step(work).items():
            rows[seq_id].append(logits)
    for _ in range(3):
        for seq_id in seqs:
            seqs[seq_id].append(int(rows[seq_id][-1][-1].argmax()))
        for seq_id, logits in runner.step([(i, seqs[i][-1:]) for i in seqs]).items():
            rows[seq_id].append(logits)
    return seqs, {i: torch.cat(r) for i, r in rows.items()}


def _max_rel_diff(hf_model, seqs, rows) -> float:
    worst = 0.0
    for seq_id, ours in rows.items():
        ids = torch.tensor([seqs[seq_id][: ours.shape[0]]])
        with torch.no_grad():
            ref = hf_model(ids).logits[0].float()
        worst = max(worst, float((ours - ref).abs().max() / ref.abs().max()))
    return worst


def _llm(path: Path, **spec: object):
    from tandem.runtime.config import CacheConfig, EngineConfig, ModelSpec, SchedulerConfig
    from tandem.runtime.llm import LLM

    ec = EngineConfig(
        model=ModelSpec(**{"model": str(path), "device": "cpu", "dtype": "float32", **spec}),
        cache=CacheConfig(block_size=4, num_blocks=96),
        scheduler=SchedulerConfig(max_num_seqs=8, max_model_len=128, max_num_batched_tokens=24),
    )
    return LLM(engine_config=ec)

"""Every supported architecture against HF transformers: a tiny random HF model is saved with
save_pretrained, loaded with Tandem's `load_model`, and run as a ragged, chunk-prefilled,
mixed prefill+decode batch over a paged KV cache with shuffled block ids. Every logit row we
produce must match HF's full-sequence forward at the same position.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import transformers as hf

from tandem.models.loader import load_model

COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    initializer_range=0.05,
)
MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32)
OLMOE = dict(COMMON, intermediate_size=32, num_experts=8, num_experts_per_tok=2, eos_token_id=2)


def _with(**overrides: object) -> dict:
    return {**COMMON, **overrides}


CASES = {
    "llama": (lambda: hf.LlamaConfig(**_with(num_hidden_layers=3)), 16),
    # SmolLM2-like: tied embeddings; Llama 3.1 rope scaling; GQA ratio 3.
    "llama3_rope_tied": (
        lambda: hf.LlamaConfig(
            **_with(hidden_size=96, num_attention_heads=6, tie_word_embeddings=True),
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
        4,
    ),
    # Mistral: Llama's computation; head_dim set apart from hidden / heads; its default window
    # (4096) is above every sequence here.
    "mistral": (lambda: hf.MistralConfig(**_with(head_dim=24)), 16),
    # attention_bias: a bias on q/k/v and o_proj (Llama, Qwen3, Qwen3-MoE).
    "llama_bias": (lambda: hf.LlamaConfig(**COMMON, attention_bias=True), 16),
    # mlp_bias: a bias on the dense MLP's gate/up/down (Llama).
    "llama_mlp_bias": (lambda: hf.LlamaConfig(**COMMON, mlp_bias=True), 4),
    "qwen3_bias": (lambda: hf.Qwen3Config(**_with(head_dim=32), attention_bias=True), 4),
    "qwen3_moe_bias": (
        lambda: hf.Qwen3MoeConfig(**COMMON, **MOE, num_experts=8, attention_bias=True),
        16,
    ),
    "qwen2_linear_rope": (
        lambda: hf.Qwen2Config(
            **COMMON, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
        ),
        4,
    ),
    # YaRN: the ramp between interpolated and original frequencies, the attention factor from
    # the factor; then one with explicit attention_factor and betas, no truncation.
    "qwen3_moe_yarn": (
        lambda: hf.Qwen3MoeConfig(
            **COMMON,
            **MOE,
            num_experts=8,
            max_position_embeddings=256,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        ),  # fmt: skip
        4,
    ),
    "llama_yarn_explicit": (
        lambda: hf.LlamaConfig(
            **COMMON,
            max_position_embeddings=128,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 500.0,
                "factor": 8.0,
                "original_max_position_embeddings": 32,
                "attention_factor": 1.3,
                "beta_fast": 16,
                "beta_slow": 2,
                "truncate": False,
            },
        ),  # fmt: skip
        16,
    ),
    # head_dim != hidden / heads; GQA ratio 4.
    "qwen3": (lambda: hf.Qwen3Config(**_with(num_key_value_heads=1, head_dim=32)), 16),
    # Layer 0 dense (mlp_only_layers), layer 1 MoE; renormalized top-k.
    "qwen3_moe": (
        lambda: hf.Qwen3MoeConfig(
            **COMMON, **MOE, num_experts=8, norm_topk_prob=True, mlp_only_layers=[0]
        ),
        4,
    ),
    "qwen2_moe": (
        lambda: hf.Qwen2MoeConfig(
            **COMMON, **MOE, num_experts=8, shared_expert_intermediate_size=48
        ),
        16,
    ),
    # No shared expert: HF saves it as zero-size tensors plus a shared_expert_gate.
    "qwen2_moe_no_shared": (
        lambda: hf.Qwen2MoeConfig(
            **COMMON, **MOE, num_experts=8, shared_expert_intermediate_size=0
        ),
        4,
    ),
    "mixtral": (lambda: hf.MixtralConfig(**COMMON, num_local_experts=8, num_experts_per_tok=2), 4),
    # OLMoE: q/k norms over the whole projected q and k, top-k weights not renormalized, experts
    # sized by intermediate_size; then clip_qkv (q/k/v clamped after the norms) with biases.
    "olmoe": (lambda: hf.OlmoeConfig(**OLMOE), 4),
    "olmoe_clip_bias": (lambda: hf.OlmoeConfig(**OLMOE, clip_qkv=0.5, attention_bias=True), 16),
}
PROMPT_LENS = [5, 17, 33, 9]


def _save_hf_model(config: hf.PretrainedConfig, path: Path) -> torch.nn.Module:
    torch.manual_seed(0)
    model = hf.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():  # HF starts biases at zero and norms at one: random values, so a
        for name, param in model.named_parameters():  # dropped or misplaced one shows
            if name.endswith(".bias"):
                param.normal_(0.0, 0.1)
            elif "norm." in name:
                param.normal_(1.0, 0.2)
    model.save_pretrained(path)
    return model


def _check_against_hf(
    hf_model: torch.nn.Module, seqs: dict[int, list[int]], rows: dict[int, list[torch.Tensor]]
) -> None:
    for seq_id, produced in rows.items():
        ours = torch.cat(produced)  # [n, vocab], positions 0..n-1
        ids = torch.tensor([seqs[seq_id][: ours.shape[0]]])
        with torch.no_grad():
            ref = hf_model(ids).logits[0].float()
        rel = (ours - ref).abs().max() / ref.abs().max()
        assert rel < 1e-4, f"sequence {seq_id}: relative max diff {rel:.3e}"


@pytest.mark.parametrize("name", list(CASES))
def test_parity_with_hf(name: str, tmp_path: Path, paged_runner) -> None:
    make_config, block_size = CASES[name]
    hf_model = _save_hf_model(make_config(), tmp_path)
    model, config = load_model(tmp_path, dtype=torch.float32, device="cpu")
    assert type(model).__name__ == config.architecture
    runner = paged_runner(model, config, block_size=block_size, seed=len(name))

    gen = torch.Generator().manual_seed(1)
    seqs = {
        i: torch.randint(0, config.vocab_size, (n,), generator=gen).tolist()
        for i, n in enumerate(PROMPT_LENS)
    }
    rows: dict[int, list[torch.Tensor]] = {i: [] for i in seqs}

    def run(work: list[tuple[int, list[int]]], sample: set[int]) -> None:
        out = runner.step(work)
        for seq_id, logits in out.items():
            rows[seq_id].append(logits)
            if seq_id in sample:
                seqs[seq_id].append(int(logits[-1].argmax()))

    # Step 1: a whole prompt and the first chunks of two others.
    run([(0, seqs[0][:5]), (1, seqs[1][:8]), (2, seqs[2][:16])], sample={0})
    # Step 2: remaining chunks, a decode token in the middle, and a new prompt.
    run(
        [(1, seqs[1][8:17]), (0, seqs[0][5:6]), (2, seqs[2][16:33]), (3, seqs[3][:9])],
        sample={0, 1, 2, 3},
    )
    # Decode-only steps, sequences in a different order each time.
    for order in ([3, 1, 0, 2], [0, 1, 2, 3], [2, 3, 1, 0]):
        run([(i, seqs[i][-1:]) for i in order], sample=set(order))

    _check_against_hf(hf_model, seqs, rows)
    assert [sum(r.shape[0] for r in rows[i]) for i in seqs] == [
        n + 3 + (i == 0) for i, n in enumerate(PROMPT_LENS)
    ]


def test_forward_returns_only_logits_rows(tmp_path: Path, paged_runner) -> None:
    make_config, _ = CASES["qwen2_moe"]
    _save_hf_model(make_config(), tmp_path)
    model, config = load_model(tmp_path, dtype=torch.float32, device="cpu")
    runner = paged_runner(model, config, block_size=4)
    ids, positions, batch = runner.build_batch([(0, [1, 2, 3]), (1, [4, 5])])
    full = model(ids, positions, batch)
    runner2 = paged_runner(model, config, block_size=4)
    ids, positions, batch = runner2.build_batch([(0, [1, 2, 3]), (1, [4, 5])])
    batch.logits_indices = torch.tensor([2, 4])
    last = model(ids, positions, batch)
    assert last.shape == (2, config.hidden_size)
    torch.testing.assert_close(last, full[[2, 4]])
    assert model.compute_logits(last).dtype == torch.float32


def test_rope_types_without_support_are_named() -> None:
    """dynamic NTK changes its frequencies with the sequence length: refused by name."""
    from tandem.models.config import UnsupportedModelError
    from tandem.models.layers.rotary import rope_attention_factor, rope_inv_freq

    with pytest.raises(UnsupportedModelError, match="'dynamic'"):
        rope_inv_freq(64, 10000.0, {"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(UnsupportedModelError, match="original_max_position_embeddings"):
        rope_inv_freq(64, 10000.0, {"rope_type": "yarn", "factor": 2.0})
    assert rope_attention_factor({"rope_type": "yarn", "factor": 4.0}, 256) == pytest.approx(
        0.1 * math.log(4.0) + 1.0
    )
    assert rope_attention_factor({"rope_type": "llama3", "factor": 4.0}) == 1.0

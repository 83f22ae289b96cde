"""The rounding-noise comparison of tests/models/greedy_compare.py (the yardstick of the DeepSeek
CUDA runner test) on the CPU: bf16 against float32 is noise, and a decode-only bug of the kind a
CUDA graph could hide (the newest key dropped from every decode step's attention) is flagged."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tandem.models.attention_backend import TorchAttentionBackend
from tests.models.greedy_compare import check_within, compare_greedy


def small_v3_config(**overrides: object):
    """A V3-proportioned toy: MLA with q_lora, grouped sigmoid + bias routing, shared expert,
    a dense first layer; every expert a token (top-8 of 8) so no bf16 rounding flips an
    expert choice (a flip is a step, not noise)."""
    from tandem.models.config import ModelConfig

    return ModelConfig.from_hf_dict({
        "architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 512, "hidden_size": 256,
        "intermediate_size": 512, "moe_intermediate_size": 128, "num_hidden_layers": 3,
        "num_attention_heads": 16, "q_lora_rank": 64, "kv_lora_rank": 128,
        "qk_nope_head_dim": 32, "qk_rope_head_dim": 32, "v_head_dim": 32,
        "n_routed_experts": 8, "num_experts_per_tok": 8, "n_group": 4, "topk_group": 4,
        "n_shared_experts": 1, "first_k_dense_replace": 1, "max_position_embeddings": 512,
        **overrides,
    })  # fmt: skip


def bf16_exact_state(cfg, seed: int = 0, std: float = 0.06) -> dict[str, torch.Tensor]:
    """Random weights (float32, CPU) rounded to bf16, so a bf16 model and a float32 one hold
    the same values. std 0.06: logits spread enough for greedy to mean something, while bf16
    rounding moves logprobs by a few hundredths (at 0.5 it moves them by units)."""
    from tandem.models.loader import build_model
    from tandem.models.loader.dummy import init_dummy_weights

    model = build_model(cfg, dtype=torch.float32, device="cpu")
    init_dummy_weights(model, seed=seed, std=std)
    return {k: v.to(torch.bfloat16).float() for k, v in model.state_dict().items()}


def prompts(
    n: int, vocab: int, seed: int = 0, longest: int = 150, shared: int = 0
) -> list[list[int]]:
    """`n` random prompts of 3..`longest` tokens after a common prefix of `shared` tokens."""
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(1, vocab, (shared,), generator=g).tolist()
    lens = torch.randint(3, longest, (n,), generator=g).tolist()
    return [prefix + torch.randint(1, vocab, (k,), generator=g).tolist() for k in lens]


def run_llm(
    cfg, model, device: str, dtype: str, ps, max_tokens: int, runner_options=None,
    num_blocks: int = 256,
):  # fmt: skip
    from tandem.runtime.config import CacheConfig, EngineConfig, ModelSpec, SchedulerConfig
    from tandem.runtime.llm import LLM
    from tandem.runtime.sampling_params import SamplingParams

    ec = EngineConfig(
        model=ModelSpec(model="small", device=device, dtype=dtype),
        cache=CacheConfig(block_size=16, num_blocks=num_blocks),
        scheduler=SchedulerConfig(max_num_seqs=32, max_model_len=512,
                                  max_num_batched_tokens=256),
    )  # fmt: skip
    params = SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=5
    )
    llm = LLM(engine_config=ec, model_module=model, model_config=cfg, runner_options=runner_options)
    outs = llm.generate(ps, params)
    pool = llm.engine.scheduler.block_pool
    pool.check_invariants()
    assert pool.usage == 0.0
    return outs, llm


class _DropNewestKeyOnDecode(TorchAttentionBackend):
    """A decode-only bug: every decode row attends to all but its own (newest) key."""

    def mla(self, q_latent, q_rope, latent_cache, batch, scale):
        if batch.max_query_len == 1:
            batch = dataclasses.replace(batch, seq_lens_cpu=[s - 1 for s in batch.seq_lens_cpu])
        return super().mla(q_latent, q_rope, latent_cache, batch, scale)


def _model(cfg, state, dtype: torch.dtype):
    from tandem.models.loader import build_model

    model = build_model(cfg, dtype=dtype, device="cpu", attn_backend="torch")
    model.load_state_dict(state)
    return model


def test_bf16_is_noise_and_a_decode_bug_is_not() -> None:
    cfg = small_v3_config()
    state = bf16_exact_state(cfg)
    ps = prompts(8, cfg.vocab_size, longest=40)
    ref, _ = run_llm(cfg, _model(cfg, state, torch.float32), "cpu", "float32", ps, 8)
    bf16, _ = run_llm(cfg, _model(cfg, state, torch.bfloat16), "cpu", "bfloat16", ps, 8)
    base = compare_greedy(ref, bf16)
    assert base.max_abs > 0, "bf16 and float32 agree exactly: no noise to measure"
    check_within(compare_greedy(ref, ref), base)
    buggy = _model(cfg, state, torch.bfloat16)
    backend = _DropNewestKeyOnDecode()
    for m in buggy.modules():
        if hasattr(m, "backend") and isinstance(m.backend, TorchAttentionBackend):
            m.backend = backend
    broken, _ = run_llm(cfg, buggy, "cpu", "bfloat16", ps, 8)
    with pytest.raises(AssertionError):
        check_within(compare_greedy(ref, broken), base)

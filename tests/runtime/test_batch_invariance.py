"""Greedy output is the same alone and in any batch at the default dtype on the CPU.

The reference run generates each prompt by itself (whole-prompt prefill, no prefix cache). The
batched runs put 36 prompts in one engine with a small token budget, so steps mix decode rows
with prefill chunks of other sequences, prompts are split at chunk boundaries that differ from
the reference, and prompts sharing a 32-token prefix hit the prefix cache; a second pass of the
same prompts hits the cache for whole prompts. Every token must match the reference.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from tandem.models.config import ModelConfig
from tandem.models.hf_export import to_hf_config_dict
from tandem.runtime import LLM, SamplingParams
from tandem.runtime.engine_setup import resolve_dtype

NEW_TOKENS = 12


def _prompts(vocab: int, n: int = 36) -> list[list[int]]:
    rng = random.Random(20)
    shared = [rng.randrange(1, vocab) for _ in range(32)]
    out = []
    for i in range(n):
        tail = [rng.randrange(1, vocab) for _ in range(rng.randint(1, 40))]
        out.append(shared + tail if i % 3 == 0 else tail)
    return out


def _greedy(llm: LLM, prompts: list[list[int]]) -> tuple[list[list], int]:
    """Greedy continuations as (token, logprob) pairs, and how many prompt tokens came from the
    prefix cache. The logprobs make the check bitwise: a random model's greedy tokens alone
    can survive a change in the last bits that a real model's near-ties do not."""
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=True)
    cached: dict[str, int] = {}

    def seen(d) -> None:
        cached[d.request_id] = max(cached.get(d.request_id, 0), d.num_cached_tokens)

    outs = llm.generate(prompts, params, on_delta=seen)
    tokens = [[(t.token_id, t.logprob) for t in o.outputs[0].logprobs] for o in outs]
    return tokens, sum(cached.values())


def _check(model: str, load_format: str, prompts: list[list[int]], **options) -> None:
    common = dict(device="cpu", dtype="auto", load_format=load_format, max_model_len=512)
    common.update(options)
    alone_llm = LLM(model, enable_prefix_caching=False, max_num_batched_tokens=512, **common)
    backend = alone_llm.engine.model.layers[0].self_attn.backend
    if common["device"] == "cuda":
        assert backend.name == "cupy" and backend.batch_invariant
    elif resolve_dtype("auto", torch.device("cpu")) == torch.bfloat16:
        assert backend.name == "cpu"  # the default on a bf16 CPU is the batch-invariant kernel
    alone = [_greedy(alone_llm, [p])[0][0] for p in prompts]
    del alone_llm
    batched_llm = LLM(model, max_num_batched_tokens=48, max_num_seqs=16, **common)
    first, hits_first = _greedy(batched_llm, prompts)
    cached, hits_again = _greedy(batched_llm, prompts[::-1])  # whole prompts from the cache
    cached = cached[::-1]
    assert hits_first >= 32 and hits_again >= hits_first + 16 * 10, (hits_first, hits_again)
    for i, ref in enumerate(alone):
        assert first[i] == ref, (i, len(prompts[i]))
        assert cached[i] == ref, (i, len(prompts[i]))


def _tiny(path: Path, head_dim: int) -> str:
    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=384, hidden_size=6 * head_dim,
                      intermediate_size=160, num_hidden_layers=2, num_attention_heads=6,
                      num_key_value_heads=2, head_dim=head_dim, max_position_embeddings=512)  # fmt: skip
    (path / "config.json").write_text(json.dumps(to_hf_config_dict(cfg)))
    return str(path)


def test_tiny_random_model_batched_equals_alone(tmp_path: Path) -> None:
    _check(_tiny(tmp_path, 16), "dummy", _prompts(384))


def test_deterministic_flag_on_the_cpu(tmp_path: Path) -> None:
    """--deterministic on the CPU is the default bf16 path, checked; float32 is refused."""
    model = _tiny(tmp_path, 16)
    if resolve_dtype("auto", torch.device("cpu")) == torch.bfloat16:
        llm = LLM(model, load_format="dummy", device="cpu", deterministic=True)
        assert llm.engine.model.layers[0].self_attn.backend.name == "cpu"
    with pytest.raises(ValueError, match="deterministic"):
        LLM(model, load_format="dummy", device="cpu", dtype="float32", deterministic=True)


@pytest.mark.gpu
def test_cuda_deterministic_batched_equals_alone(tmp_path: Path) -> None:
    """--deterministic on CUDA: fixed-shape GEMMs and the extend kernel for every batch, decode
    steps replayed from CUDA graphs."""
    _check(_tiny(tmp_path, 64), "dummy", _prompts(384), device="cuda", deterministic=True)


@pytest.mark.slow
def test_default_model_batched_equals_alone() -> None:
    _check("smollm2-135m-instruct", "auto", _prompts(49152, n=32))

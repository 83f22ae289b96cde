"""The CPU runner computes a bf16 model's step on one torch thread (its linears and attention are
ext/cpu kernels on the calling thread) and gives the caller back its own thread count."""

from __future__ import annotations

import pytest
import torch

from tandem.models.loader import build_model
from tandem.models.loader.dummy import init_dummy_weights
from tandem.runtime.config import CacheConfig, EngineConfig, ModelSpec
from tandem.runtime.llm import LLM
from tandem.runtime.sampling_params import SamplingParams

from .test_engine import tiny_config


@pytest.mark.parametrize("dtype,expected", [("bfloat16", 1), ("float32", 2)])
def test_step_threads(byte_bpe, dtype: str, expected: int) -> None:
    cfg = tiny_config(byte_bpe.vocab_size)
    model = build_model(cfg, dtype=getattr(torch, dtype), device="cpu")
    init_dummy_weights(model, seed=0, std=0.5)
    seen: list[int] = []
    forward = model.forward

    def spy(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return forward(*args, **kwargs)

    model.forward = spy
    ec = EngineConfig(
        model=ModelSpec(model="tiny", device="cpu", dtype=dtype),
        cache=CacheConfig(block_size=4, num_blocks=64),
    )
    llm = LLM(engine_config=ec, model_module=model, model_config=cfg, tokenizer=byte_bpe)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0.0))
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert len(out[0].token_ids) == 3 and seen and set(seen) == {expected}


def test_large_torch_matmuls_keep_the_callers_threads() -> None:
    """A plain nn.Linear of 64k+ weights, or torch-computed experts, stays on torch's threads."""
    from types import SimpleNamespace

    from tandem.runtime.model_runner import _torch_matmuls

    small = torch.nn.Sequential(torch.nn.Linear(64, 64))
    assert not _torch_matmuls(small)
    assert _torch_matmuls(torch.nn.Sequential(torch.nn.Linear(256, 256)))
    small.expert_backend = SimpleNamespace(name="torch")
    assert _torch_matmuls(small)
    small.expert_backend = SimpleNamespace(name="cpu_pool")
    assert not _torch_matmuls(small)

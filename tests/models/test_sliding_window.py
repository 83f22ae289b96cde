"""Mixtral's `sliding_window`: attention here is never windowed, so the engine caps
max_model_len at the window (where full attention equals HF's windowed one) instead of
computing longer sequences differently from the checkpoint's own code."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers as hf

from models.config import ModelConfig
from runtime.config import CacheConfig, EngineConfig, ModelSpec, SchedulerConfig
from runtime.llm import LLM
from runtime.sampling_params import SamplingParams

TINY = dict(
    vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
    num_attention_heads=2, num_key_value_heads=1, num_local_experts=2, num_experts_per_tok=1,
)  # fmt: skip


def test_config_reads_mixtral_sliding_window() -> None:
    d = hf.MixtralConfig(**TINY, sliding_window=8, max_position_embeddings=64).to_dict()
    d["architectures"] = ["MixtralForCausalLM"]
    cfg = ModelConfig.from_hf_dict(d)
    assert cfg.sliding_window == 8 and cfg.max_context == 8
    d["sliding_window"] = None
    assert ModelConfig.from_hf_dict(d).max_context == 64


@pytest.mark.parametrize("window", [8, None])
def test_engine_caps_max_model_len_at_the_window(tmp_path: Path, window: int | None) -> None:
    torch.manual_seed(0)
    cfg = hf.MixtralConfig(**TINY, sliding_window=window, max_position_embeddings=64)
    hf.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    ec = EngineConfig(
        model=ModelSpec(model=str(tmp_path), device="cpu", dtype="float32"),
        cache=CacheConfig(block_size=4, num_blocks=64),
        scheduler=SchedulerConfig(max_num_seqs=2, max_model_len=48),
    )
    llm = LLM(engine_config=ec)
    assert llm.engine.max_model_len == (8 if window else 48)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    (out,) = llm.generate([[1, 2, 3, 4]], params)
    assert len(out.outputs[0].token_ids) == 3
    if window:  # longer than the window: refused, never computed unlike HF
        with pytest.raises(ValueError):
            llm.generate([list(range(1, 13))], params)

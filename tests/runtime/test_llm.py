"""The offline `LLM`: ModelSpec fields as keyword arguments, as vLLM's LLM takes engine args."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tandem.models.config import ModelConfig
from tandem.models.hf_export import to_hf_config_dict
from tandem.runtime.config import EngineConfig, ModelSpec
from tandem.runtime.llm import LLM
from tandem.runtime.sampling_params import SamplingParams


@pytest.fixture
def moe_dir(tmp_path: Path) -> Path:
    cfg = ModelConfig(architecture="Qwen3MoeForCausalLM", vocab_size=512, hidden_size=64,
                      intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                      num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(to_hf_config_dict(cfg)))
    return tmp_path


def test_expert_options_as_keyword_arguments(moe_dir: Path) -> None:
    """LLM(model, cpu_experts="all", ...) was a TypeError from Engine.__init__."""
    llm = LLM(str(moe_dir), load_format="dummy", device="cpu", dtype="float32",
              cpu_experts="all", cpu_expert_format="int4", cpu_threads=1)  # fmt: skip
    backend = llm.engine.model.expert_backend
    assert backend.name == "cpu_pool"
    assert {backend.pool.layer_format(i) for i in backend._num_experts} == {("int4", 64)}
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0))
    assert len(out[0].outputs[0].token_ids) == 2
    backend.close()


def test_spec_keywords_next_to_an_engine_config_are_refused(moe_dir: Path) -> None:
    config = EngineConfig(model=ModelSpec(model=str(moe_dir), load_format="dummy", device="cpu"))
    with pytest.raises(ValueError, match="cpu_experts"):
        LLM(engine_config=config, cpu_experts="all")

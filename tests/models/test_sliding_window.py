"""Sliding-window attention (Mistral's and Mixtral's `sliding_window`, the Qwen families'
`use_sliding_window`): the config names the windowed layers as transformers' code does, and the
engine serves sequences past the window (windowed attention, logits parity in
tests/models/test_gpt_oss.py) up to max_model_len."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers as hf

from tandem.models.config import ModelConfig
from tandem.runtime.config import CacheConfig, EngineConfig, ModelSpec, SchedulerConfig
from tandem.runtime.llm import LLM
from tandem.runtime.sampling_params import SamplingParams

TINY = dict(
    vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
    num_attention_heads=2, num_key_value_heads=1, num_local_experts=2, num_experts_per_tok=1,
)  # fmt: skip
DENSE_TINY = {k: v for k, v in TINY.items() if "expert" not in k}  # Mistral's


def _llm_of(cfg: hf.PretrainedConfig, path: Path) -> LLM:
    """An engine on a random checkpoint of `cfg` saved at `path`, max_model_len 48 asked."""
    torch.manual_seed(0)
    hf.AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    ec = EngineConfig(
        model=ModelSpec(model=str(path), device="cpu", dtype="float32"),
        cache=CacheConfig(block_size=4, num_blocks=64),
        scheduler=SchedulerConfig(max_num_seqs=2, max_model_len=48),
    )
    return LLM(engine_config=ec)


def test_config_reads_mixtral_sliding_window() -> None:
    d = hf.MixtralConfig(**TINY, sliding_window=8, max_position_embeddings=64).to_dict()
    d["architectures"] = ["MixtralForCausalLM"]
    cfg = ModelConfig.from_hf_dict(d)
    assert cfg.sliding_window == 8 and cfg.sliding_layers == (0,) and cfg.max_context == 64
    assert cfg.layer_window(0) == 8
    d["sliding_window"] = None
    cfg = ModelConfig.from_hf_dict(d)
    assert cfg.max_context == 64 and cfg.layer_window(0) is None


@pytest.mark.parametrize("layer_types", [None, ["full_attention"]])
def test_config_reads_mistral_sliding_window(layer_types: list[str] | None) -> None:
    """Mistral windows every layer when `sliding_window` is set; its code ignores layer_types
    (transformers warns that it does), so one that says "full" changes nothing."""
    d = hf.MistralConfig(**DENSE_TINY, sliding_window=8, max_position_embeddings=64).to_dict()
    if layer_types is not None:
        d["layer_types"] = layer_types
    cfg = ModelConfig.from_hf_dict(d)  # no `architectures`: read from model_type "mistral"
    assert cfg.architecture == "MistralForCausalLM"
    assert cfg.sliding_window == 8 and cfg.sliding_layers == (0,) and cfg.max_context == 64
    d["sliding_window"] = None
    assert ModelConfig.from_hf_dict(d).sliding_layers == ()


QWEN_TINY = dict(
    vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
    num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64, sliding_window=8,
)  # fmt: skip


@pytest.mark.parametrize(
    "config_cls,extra,layers",
    [
        (hf.Qwen3MoeConfig, dict(use_sliding_window=True), (0, 1, 2, 3)),  # every layer
        (hf.Qwen3MoeConfig, dict(use_sliding_window=False), ()),
        (hf.Qwen2MoeConfig, dict(use_sliding_window=True, max_window_layers=2), (0,)),
        (hf.Qwen2MoeConfig, dict(use_sliding_window=True, max_window_layers=0), ()),
        (hf.Qwen2Config, dict(use_sliding_window=True, max_window_layers=2), (2, 3)),
        (hf.Qwen2Config, dict(use_sliding_window=True, max_window_layers=4), ()),
        (hf.Qwen3Config, dict(use_sliding_window=True, max_window_layers=3), (3,)),
        (hf.Qwen3Config, dict(use_sliding_window=False, max_window_layers=0), ()),
    ],
)
def test_config_reads_qwen_sliding_windows(config_cls, extra, layers) -> None:
    """The window sits on the layers transformers' code windows."""
    d = config_cls(**QWEN_TINY, **extra).to_dict()
    d["architectures"] = [config_cls.__name__.replace("Config", "ForCausalLM")]
    cfg = ModelConfig.from_hf_dict(d)
    assert cfg.sliding_layers == layers
    assert cfg.sliding_window == (8 if layers else None)
    assert cfg.max_context == 64
    d.pop("layer_types", None)  # older configs: the rule from use_sliding_window alone
    assert ModelConfig.from_hf_dict(d).sliding_layers == layers


def test_qwen3_moe_sliding_window_serves_past_the_window(tmp_path: Path) -> None:
    cfg = hf.Qwen3MoeConfig(
        **QWEN_TINY, use_sliding_window=True, num_experts=2, num_experts_per_tok=1,
        moe_intermediate_size=16,
    )  # fmt: skip
    llm = _llm_of(cfg, tmp_path)
    assert llm.engine.max_model_len == 48
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    (out,) = llm.generate([list(range(1, 13))], params)
    assert len(out.outputs[0].token_ids) == 3


@pytest.mark.parametrize("family", ["mixtral", "mistral"])
@pytest.mark.parametrize("window", [8, None])
def test_engine_serves_past_the_window(tmp_path: Path, window: int | None, family: str) -> None:
    """A windowed checkpoint serves up to max_model_len, the same greedy tokens as HF's
    generate past the window."""
    if family == "mixtral":
        cfg = hf.MixtralConfig(**TINY, sliding_window=window, max_position_embeddings=64)
    else:
        cfg = hf.MistralConfig(**DENSE_TINY, sliding_window=window, max_position_embeddings=64)
    llm = _llm_of(cfg, tmp_path)
    assert llm.engine.model_config.architecture == type(cfg).__name__.replace(
        "Config", "ForCausalLM"
    )
    assert llm.engine.max_model_len == 48
    prompt = list(range(1, 13))
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    (out,) = llm.generate([prompt], params)
    hf_model = hf.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    ref = hf_model.generate(
        torch.tensor([prompt]), max_new_tokens=6, do_sample=False, min_new_tokens=6
    )
    assert list(out.outputs[0].token_ids) == ref[0, len(prompt) :].tolist()


@pytest.mark.parametrize(
    "config_cls,extra",
    [
        (hf.Qwen2Config, dict(use_sliding_window=True, max_window_layers=2)),  # layers 2, 3
        (hf.Qwen3Config, dict(use_sliding_window=True, max_window_layers=3)),  # layer 3
    ],
)
def test_qwen_with_some_layers_windowed_keeps_them_in_the_window_pool(
    tmp_path: Path, config_cls, extra
) -> None:
    """A Qwen config that windows some layers is a mixed model: those layers' KV lives in the
    bounded window pool, and greedy tokens past the window still equal transformers'."""
    cfg = config_cls(**QWEN_TINY, **extra)
    llm = _llm_of(cfg, tmp_path)
    mc = llm.engine.model_config
    assert llm.engine.kv_cache.window_layers == mc.sliding_layers != ()
    assert llm.engine.scheduler.window_pool is not None
    prompt = list(range(1, 13))
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    (out,) = llm.generate([prompt], params)
    hf_model = hf.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    ref = hf_model.generate(
        torch.tensor([prompt]), max_new_tokens=30, do_sample=False, min_new_tokens=30
    )
    assert list(out.outputs[0].token_ids) == ref[0, len(prompt) :].tolist()
    for pool in (llm.engine.scheduler.block_pool, llm.engine.scheduler.window_pool):
        pool.check_invariants()
        assert pool.num_free_blocks == pool.num_usable_blocks

"""Sliding-window models on the CUDA runner with the cupy kernels, inside the decode CUDA graphs:
a Mistral-like model (every layer windowed, so blocks behind the window are released and the
block tables have holes) and a GPT-OSS-like one (alternating windows, sinks, biased experts).
Graph decode equals eager decode past the window; the pool is clean afterwards.

GPU tests: marked `gpu`, skipped without CUDA and CuPy.
"""

from __future__ import annotations

import pytest
import torch

import tandem.ext.cuda as cuda_ext
from tandem.models.config import ModelConfig
from tandem.models.loader import build_model
from tandem.models.loader.dummy import init_dummy_weights
from tandem.runtime.config import CacheConfig, EngineConfig, ModelSpec, SchedulerConfig
from tandem.runtime.llm import LLM
from tandem.runtime.sampling_params import SamplingParams
from tests.runtime.test_cuda_runner import VOCAB, prompts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not cuda_ext.is_available(), reason="needs CUDA and CuPy"),
]

WINDOW = 16
COMMON = dict(
    vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
    num_attention_heads=8, num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
    sliding_window=WINDOW,
)  # fmt: skip
CONFIGS = {
    "mistral": lambda: ModelConfig(
        architecture="MistralForCausalLM", sliding_layers=(0, 1), **COMMON
    ),
    "gpt_oss": lambda: ModelConfig(
        architecture="GptOssForCausalLM",
        sliding_layers=(0,),
        attention_sinks=True,
        attention_bias=True,
        o_proj_bias=True,
        moe_bias=True,
        swiglu_limit=7.0,
        num_experts=4,
        num_experts_per_tok=4,
        moe_intermediate_size=128,
        **COMMON,
    ),  # fmt: skip
}


def make_llm(model, config: ModelConfig, graphs: bool) -> LLM:
    from tandem.runtime.cuda_runner import CudaRunnerOptions

    ec = EngineConfig(
        model=ModelSpec(model="small", device="cuda", dtype="bfloat16"),
        cache=CacheConfig(block_size=16, num_blocks=512),
        scheduler=SchedulerConfig(max_num_seqs=32, max_model_len=512, max_num_batched_tokens=256),
    )
    return LLM(
        engine_config=ec, model_module=model, model_config=config,
        runner_options=CudaRunnerOptions(cuda_graphs=graphs),
    )  # fmt: skip


@pytest.mark.parametrize("name", list(CONFIGS))
def test_windowed_graph_decode_equals_eager(name: str) -> None:
    config = CONFIGS[name]()
    experts = "gpu" if config.is_moe else "torch"
    model = build_model(
        config, dtype=torch.bfloat16, device="cuda", attn_backend="cupy", expert_backend=experts
    )
    init_dummy_weights(model, seed=0, std=0.5)
    ps = prompts(16)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    graphed, eager = make_llm(model, config, True), make_llm(model, config, False)
    out_g = [o.token_ids for o in graphed.generate(ps, params)]
    out_e = [o.token_ids for o in eager.generate(ps, params)]
    assert graphed.engine.runner.counters.graph_steps > 0
    assert not graphed.engine.runner.counters.fallbacks
    same = sum(a == b for a, b in zip(out_g, out_e, strict=True))
    assert same >= 14, f"{same}/16 identical"  # a rare late bf16 flip is rounding
    assert all(a[:8] == b[:8] for a, b in zip(out_g, out_e, strict=True))
    for llm in (graphed, eager):
        pool = llm.engine.scheduler.block_pool
        pool.check_invariants()
        assert pool.usage == 0.0

"""Overlap scheduling on CUDA: greedy outputs of the overlapped engine equal the synchronous
one on a random-weight Llama (bf16, cupy attention), for a ragged batch whose requests finish
at different steps on stop tokens and lengths, through decode graphs (placeholders resolved
inside the graph) and through eager mixed prefill+decode steps (resolved before the forward).

GPU tests: marked `gpu`, skipped without CUDA and CuPy.
"""

from __future__ import annotations

import random

import pytest
import torch

import ext.cuda as cuda_ext
from runtime.sampling_params import SamplingParams
from tests.runtime.test_cuda_runner import VOCAB, small_config

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not cuda_ext.is_available(), reason="needs CUDA and CuPy"),
]


@pytest.fixture(scope="module")
def model():
    from models.loader import build_model
    from models.loader.dummy import init_dummy_weights

    m = build_model(small_config(), dtype=torch.bfloat16, device="cuda", attn_backend="cupy")
    init_dummy_weights(m, seed=0, std=0.5)  # large logit margins: greedy is robust to rounding
    return m


def make_engine(model, *, overlap: bool, graphs: bool = True, budget: int = 256):
    from runtime.config import CacheConfig, EngineConfig, ModelSpec, SchedulerConfig
    from runtime.cuda_runner import CudaRunnerOptions
    from runtime.engine import Engine

    ec = EngineConfig(
        model=ModelSpec(model="small", device="cuda", dtype="bfloat16"),
        cache=CacheConfig(block_size=16, num_blocks=512),
        scheduler=SchedulerConfig(max_num_seqs=32, max_model_len=512,
                                  max_num_batched_tokens=budget),
    )  # fmt: skip
    opts = CudaRunnerOptions(cuda_graphs=graphs, overlap=overlap)
    return Engine(ec, model_module=model, model_config=small_config(), runner_options=opts)


def run(engine, prompts, params) -> list[tuple[tuple[int, ...], str | None]]:
    got: dict[str, list] = {f"r{i}": [[], None] for i in range(len(prompts))}
    for i, (p, q) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"r{i}", p, q)
    while engine.has_unfinished_requests():
        for d in engine.step():
            assert got[d.request_id][1] is None, "a delta after the finish"
            got[d.request_id][0] += d.new_token_ids
            got[d.request_id][1] = d.finish_reason
    pool = engine.scheduler.block_pool
    pool.check_invariants()
    assert pool.usage == 0.0
    return [(tuple(t), f) for t, f in got.values()]


@pytest.mark.parametrize("graphs, budget", [(True, 256), (True, 64), (False, 96)])
def test_overlapped_greedy_equals_sync(model, graphs, budget) -> None:
    rnd = random.Random(budget)
    prompts = [[rnd.randrange(1, VOCAB) for _ in range(rnd.randint(3, 150))] for _ in range(24)]
    params = [
        SamplingParams(max_tokens=rnd.randint(1, 40), temperature=0.0, ignore_eos=True)
        for _ in prompts
    ]
    sync = run(make_engine(model, overlap=False, graphs=graphs, budget=budget), prompts, params)
    # Stop tokens greedy decoding reaches, at different steps per request.
    for i in range(0, len(params), 2):
        toks = sync[i][0]
        if len(toks) > 2:
            stop = toks[rnd.randrange(1, len(toks))]
            params[i] = SamplingParams(max_tokens=params[i].max_tokens, temperature=0.0,
                                       ignore_eos=True, stop_token_ids=(stop,))  # fmt: skip
    sync = run(make_engine(model, overlap=False, graphs=graphs, budget=budget), prompts, params)
    eng = make_engine(model, overlap=True, graphs=graphs, budget=budget)
    assert eng.overlap and eng.scheduler.async_mode
    over = run(eng, prompts, params)
    assert over == sync
    assert {f for _, f in sync} == {"stop", "length"}
    if graphs and budget == 256:
        assert eng.runner.counters.graph_steps > 0
    assert "host_sampler" not in eng.runner.counters.fallbacks

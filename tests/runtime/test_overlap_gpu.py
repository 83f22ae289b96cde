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

import tandem.ext.cuda as cuda_ext
from tandem.runtime.sampling_params import SamplingParams
from tests.runtime.test_cuda_runner import VOCAB, small_config

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not cuda_ext.is_available(), reason="needs CUDA and CuPy"),
]


@pytest.fixture(scope="module")
def model():
    from tandem.models.loader import build_model
    from tandem.models.loader.dummy import init_dummy_weights

    m = build_model(small_config(), dtype=torch.bfloat16, device="cuda", attn_backend="cupy")
    init_dummy_weights(m, seed=0, std=0.5)  # large logit margins: greedy is robust to rounding
    return m


def make_engine(model, *, overlap: bool, graphs: bool = True, budget: int = 256):
    from tandem.runtime.config import CacheConfig, EngineConfig, ModelSpec, SchedulerConfig
    from tandem.runtime.cuda_runner import CudaRunnerOptions
    from tandem.runtime.engine import Engine

    ec = EngineConfig(
        model=ModelSpec(model="small", device="cuda", dtype="bfloat16"),
        cache=CacheConfig(block_size=16, num_blocks=512),
        scheduler=SchedulerConfig(max_num_seqs=32, max_model_len=512,
                                  max_num_batched_tokens=budget),
    )  # fmt: skip
    opts = CudaRunnerOptions(cuda_graphs=graphs, overlap=overlap)
    return Engine(ec, model_module=model, model_config=small_config(), runner_options=opts)


def run(engine, prompts, params, logprobs: list | None = None):
    """-> per request (token ids, finish reason); per request's logprobs into `logprobs`."""
    got: dict[str, list] = {f"r{i}": [[], None, []] for i in range(len(prompts))}
    for i, (p, q) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"r{i}", p, q)
    while engine.has_unfinished_requests():
        for d in engine.step():
            assert got[d.request_id][1] is None, "a delta after the finish"
            got[d.request_id][0] += d.new_token_ids
            got[d.request_id][1] = d.finish_reason
            got[d.request_id][2] += d.logprobs
    pool = engine.scheduler.block_pool
    pool.check_invariants()
    assert pool.usage == 0.0
    if logprobs is not None:
        logprobs.extend(lp for _, _, lp in got.values())
    return [(tuple(t), f) for t, f, _ in got.values()]


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


@pytest.mark.parametrize("graphs", [True, False])
def test_overlapped_penalties_min_tokens_logprobs_equal_sync(model, graphs) -> None:
    # Penalties read the token in flight from the device under overlap (the host has not
    # applied it yet); min_tokens counts it; logprobs come back packed with the ids.
    rnd = random.Random(7)
    prompts = [[rnd.randrange(1, VOCAB) for _ in range(rnd.randint(3, 120))] for _ in range(16)]
    greedy = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True) for _ in prompts]
    plain = run(make_engine(model, overlap=False, graphs=graphs), prompts, greedy)
    params = []
    for i, (toks, _) in enumerate(plain):
        kind = i % 4
        if kind == 0:
            p = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                               repetition_penalty=1.4, frequency_penalty=0.4)  # fmt: skip
        elif kind == 1:
            p = SamplingParams(max_tokens=24, temperature=0.8, seed=i, ignore_eos=True,
                               presence_penalty=0.8, logprobs=True, top_logprobs=3)  # fmt: skip
        elif kind == 2:  # ban the tokens greedy decoding would stop on first
            p = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, min_tokens=8,
                               stop_token_ids=tuple(toks[1:3]))  # fmt: skip
        else:
            p = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=True,
                               top_logprobs=2, frequency_penalty=1.0)  # fmt: skip
        params.append(p)
    lp_sync: list = []
    sync = run(make_engine(model, overlap=False, graphs=graphs), prompts, params, lp_sync)
    eng = make_engine(model, overlap=True, graphs=graphs)
    lp_over: list = []
    over = run(eng, prompts, params, lp_over)
    assert over == sync
    assert sync != plain  # the parameters changed what was sampled
    for (toks, _), p in zip(sync, params, strict=True):
        if p.min_tokens:
            assert len(toks) >= p.min_tokens and not set(toks[: p.min_tokens]) & set(
                p.stop_token_ids
            )
    for (toks, _), a, b, p in zip(sync, lp_sync, lp_over, params, strict=True):
        assert len(a) == len(b) == (len(toks) if p.logprobs else 0)
        if not p.logprobs:
            continue
        for x, y, t in zip(a, b, toks, strict=True):
            assert x.token_id == y.token_id == t
            assert len(x.top) == len(y.top) == p.top_logprobs
            assert y.logprob == pytest.approx(x.logprob, rel=0.05, abs=0.05)
    assert "host_sampler" not in eng.runner.counters.fallbacks


@pytest.mark.parametrize("overlap, logprobs", [(True, False), (True, True), (False, False)])
def test_a_nan_row_fails_its_request_alone(model, overlap, logprobs) -> None:
    # NaN logits for one request's fourth token, injected on the device in front of the
    # sampler (no host sync): that request fails, the others equal a run without it, and
    # the decode graphs keep running (a later step read its clamped future slot).
    rnd = random.Random(5)
    prompts = [[rnd.randrange(1, VOCAB) for _ in range(rnd.randint(3, 60))] for _ in range(8)]
    params = [
        SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, logprobs=logprobs)
        for _ in prompts
    ]
    want = run(make_engine(model, overlap=overlap), prompts, params)
    eng = make_engine(model, overlap=overlap)
    sampler = eng.runner.sampler
    real = sampler.sample_async

    def nan_for_seed(logits, rows, last_ids=None):
        hit = [i for i, r in enumerate(rows) if r.params.seed == 666 and r.num_output_tokens == 3]
        if hit:
            logits = logits.clone()
            logits[hit[0], 11] = float("nan")
        return real(logits, rows, last_ids)

    sampler.sample_async = nan_for_seed
    bad = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, seed=666)
    got = run(eng, prompts + [[9, 8, 7]], params + [bad])
    assert got[:-1] == want
    assert got[-1][1] == "error" and len(got[-1][0]) == 3
    assert eng.runner.counters.graph_steps > 0

"""The CUDA runner's step logic on the CPU, with CUDA streams, events and pinned memory stubbed
out: the future buffer and its placeholders, device token counts that include the token in
flight, min_tokens counted from the schedule, logprobs packed with the ids. Overlapped and
synchronous engines on it equal the reference CPU runner, with preemptions (dropped tokens).
Timing (streams, the side-stream copy) is what the `gpu` tests cover; this covers the values.
"""

from __future__ import annotations

import contextlib
import random

import pytest
import torch

from tandem.models.config import ModelConfig
from tandem.models.loader import build_model
from tandem.models.loader.dummy import init_dummy_weights
from tandem.runtime.config import CacheConfig, EngineConfig, ModelSpec, SchedulerConfig
from tandem.runtime.engine import Engine
from tandem.runtime.sampling_params import SamplingParams

VOCAB = 256
CFG = ModelConfig(
    architecture="LlamaForCausalLM", vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    max_position_embeddings=512,
)  # fmt: skip


class _Event:
    def __init__(self, *args, **kwargs) -> None:
        pass

    def record(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class _Stream(_Event):
    def wait_event(self, event) -> None:
        pass


@pytest.fixture
def fake_cuda(monkeypatch):
    for name in ("empty", "zeros", "full"):
        real = getattr(torch, name)

        def unpinned(*args, _real=real, **kwargs):
            kwargs.pop("pin_memory", None)
            return _real(*args, **kwargs)

        monkeypatch.setattr(torch, name, unpinned)
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "Stream", _Stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, s: None)


@pytest.fixture(scope="module")
def model():
    m = build_model(CFG, dtype=torch.float32, device="cpu", attn_backend="torch")
    init_dummy_weights(m, seed=0, std=0.5)
    return m


def make_engine(model, *, cuda_runner: bool, overlap: bool, budget: int, num_blocks: int):
    from tandem.runtime.cuda_runner import CudaModelRunner, CudaRunnerOptions

    ec = EngineConfig(
        model=ModelSpec(model="small", device="cpu", dtype="float32"),
        cache=CacheConfig(block_size=16, num_blocks=num_blocks),
        scheduler=SchedulerConfig(max_num_seqs=8, max_model_len=128,
                                  max_num_batched_tokens=budget),
    )  # fmt: skip
    eng = Engine(ec, model_module=model, model_config=CFG, overlap=overlap)
    if cuda_runner:
        eng.runner = CudaModelRunner(
            model, CFG, eng.kv_cache, torch.device("cpu"), model.attn_backend,
            max_num_seqs=8, max_num_batched_tokens=budget, max_model_len=128,
            options=CudaRunnerOptions(cuda_graphs=False, overlap=overlap),
        )  # fmt: skip
    return eng


def run(eng, prompts, params):
    got = {f"r{i}": [[], None, []] for i in range(len(prompts))}
    for i, (p, q) in enumerate(zip(prompts, params, strict=True)):
        eng.add_request(f"r{i}", p, q)
    while eng.has_unfinished_requests():
        for d in eng.step():
            assert got[d.request_id][1] is None, "a delta after the finish"
            got[d.request_id][0] += d.new_token_ids
            got[d.request_id][1] = d.finish_reason
            got[d.request_id][2] += [(lp.token_id, [t for t, _ in lp.top]) for lp in d.logprobs]
    pool = eng.scheduler.block_pool
    pool.check_invariants()
    assert pool.usage == 0.0
    return [(tuple(t), f, lp) for t, f, lp in got.values()]


def workload():
    # Greedy throughout: a seeded request preempted while its step ran has drawn noise for a
    # token that is dropped, so its later samples depend on preemption timing (any runner).
    rnd = random.Random(3)
    prompts = [[rnd.randrange(1, VOCAB) for _ in range(rnd.randint(3, 90))] for _ in range(14)]
    params = []
    for i, prompt in enumerate(prompts):
        kw: dict = {"max_tokens": 20, "temperature": 0.0, "ignore_eos": True}
        kind = i % 4
        if kind == 0:
            kw.update(repetition_penalty=1.5, frequency_penalty=0.5)
        elif kind == 1:
            kw.update(presence_penalty=1.0, logprobs=True, top_logprobs=3)
        elif kind == 2:
            kw.update(min_tokens=10, stop_token_ids=(prompt[0], 5, 6, 7))
        else:
            kw.update(max_tokens=rnd.randint(1, 20), logprobs=True)
        params.append(SamplingParams(**kw))
    return prompts, params


@pytest.mark.parametrize("budget, num_blocks", [(200, 512), (64, 14), (128, 12)])
def test_cuda_runner_equals_the_reference_runner(fake_cuda, model, budget, num_blocks) -> None:
    prompts, params = workload()
    want = run(make_engine(model, cuda_runner=False, overlap=False, budget=512, num_blocks=512),
               prompts, params)  # fmt: skip
    for overlap in (False, True):
        eng = make_engine(
            model, cuda_runner=True, overlap=overlap, budget=budget, num_blocks=num_blocks
        )
        assert eng.overlap == overlap
        got = run(eng, prompts, params)
        assert got == want, f"overlap={overlap}"
        if num_blocks < 20:
            assert eng.scheduler.num_preemptions_total > 0
        assert eng.runner.counters.eager_steps > 0 and not eng.runner.counters.fallbacks
        stats = eng.stats()  # what /metrics exports
        assert stats.eager_steps == eng.runner.counters.eager_steps
        assert stats.runner_fallbacks == {}


@pytest.mark.parametrize("overlap", [False, True])
def test_a_nan_row_fails_its_request_alone(fake_cuda, model, overlap) -> None:
    # NaN logits for the seed-666 request, injected in front of the device sampler: that
    # request fails (its next step, already launched under overlap, read a clamped id), the
    # others equal a run without it.
    prompts, params = workload()
    want = run(make_engine(model, cuda_runner=True, overlap=overlap, budget=200, num_blocks=512),
               prompts, params)  # fmt: skip
    eng = make_engine(model, cuda_runner=True, overlap=overlap, budget=200, num_blocks=512)
    sampler = eng.runner.sampler
    real = sampler.sample_async
    calls = []

    def nan_for_seed(logits, rows, last_ids=None):
        logits = logits.clone()
        for i, r in enumerate(rows):
            if r.params.seed == 666 and r.num_output_tokens == 3:
                logits[i, 5] = float("nan")
                calls.append(r.num_output_tokens)
        return real(logits, rows, last_ids)

    sampler.sample_async = nan_for_seed
    bad = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, seed=666)
    got = run(eng, prompts + [[9, 8, 7]], params + [bad])
    assert calls == [3]
    assert got[:-1] == want
    tokens, finish, _ = got[-1]
    assert finish == "error" and len(tokens) == 3

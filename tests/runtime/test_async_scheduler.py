"""Scheduler async (overlap) mode: step N+1 is scheduled and run before step N is applied.

The fake model of test_scheduler runs each step at "launch" and keeps the token it sampled
per request (a future map), so a placeholder input it cannot resolve, a KV slot written
under another request's feet or a token applied twice changes the outputs. Results must equal
each request's run alone (and so sync mode); blocks are released exactly once.
"""

from __future__ import annotations

import random

import hypothesis.strategies as st
from hypothesis import HealthCheck, event, given, settings

from tandem.runtime.config import CacheConfig, SchedulerConfig
from tandem.runtime.request import RequestStatus
from tandem.runtime.scheduler import RequestTooLongError, Scheduler
from tandem.runtime.types import SchedulerOutput
from tests.runtime.test_scheduler import (
    assert_idle,
    make,
    next_token,
    reference_output,
    workloads,
)


def make_async(num_blocks: int = 64, block_size: int = 4, **kw) -> Scheduler:
    prefix = kw.pop("enable_prefix_caching", True)
    kw.setdefault("max_model_len", 4096)
    return Scheduler(
        SchedulerConfig(**kw),
        CacheConfig(block_size=block_size, enable_prefix_caching=prefix),
        num_blocks,
        async_mode=True,
    )


class FutureFakeModel:
    """Runs a step when launched; inputs past the known tokens come from its future map."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.pool = scheduler.block_pool
        self.kv: dict[int, tuple[int, ...]] = {}
        self.future: dict[str, int] = {}  # request id -> token its last launch sampled
        self.num_placeholders = 0

    def step(self, output: SchedulerOutput) -> list[int]:
        bs = self.pool.block_size
        sampled = []
        for seq in output.seqs:
            r = seq.request
            end = seq.start_pos + seq.num_tokens
            assert 0 not in r.block_ids and len(r.block_ids) * bs >= end
            context = list(r.token_ids[:end])
            if len(context) < end:  # one placeholder: the token the step in flight samples
                assert len(context) == end - 1 == seq.start_pos and seq.num_tokens == 1
                context.append(self.future[r.request_id])
                self.num_placeholders += 1
            for pos in range(seq.start_pos, end):
                block = r.block_ids[pos // bs]
                assert self.pool._ref_count[block] == 1, "writing a shared block"
                self.kv[block * bs + pos % bs] = tuple(context[: pos + 1])
            if seq.sample:
                for pos in range(end):
                    assert self.kv[r.block_ids[pos // bs] * bs + pos % bs] == tuple(
                        context[: pos + 1]
                    )
                t = next_token(context)
                self.future[r.request_id] = t
                sampled.append(t)
        return sampled


def run_async(s: Scheduler, model: FutureFakeModel, max_steps: int = 10_000) -> int:
    """schedule N+1 → run N+1 → update N, until idle; returns the number of steps."""
    pending = None
    steps = 0
    while s.has_unfinished_requests() or pending is not None:
        out = s.schedule()
        launched = (out, model.step(out)) if not out.is_empty else None
        if pending is not None:
            s.update(*pending)
        s.block_pool.check_invariants()
        pending = launched
        steps += 1
        assert steps < max_steps
    return steps


def test_decode_overlaps_with_placeholders_and_equals_reference():
    s = make_async(max_num_batched_tokens=16)
    reqs = [make("a", [1, 2, 3], max_tokens=6), make("b", list(range(20)), max_tokens=5)]
    for r in reqs:
        s.add_request(r)
    model = FutureFakeModel(s)
    run_async(s, model)
    assert model.num_placeholders > 0, "no step ran ahead of its inputs"
    for r in reqs:
        assert (r.output_token_ids, r.status) == reference_output(r, 10_000)
    assert_idle(s)


def test_stop_token_seen_one_step_late_drops_the_extra_token():
    s = make_async(max_model_len=64)
    r = make("r", [1, 2, 3, 4], max_tokens=6, stop_token_ids=(9,))
    s.add_request(r)
    o1 = s.schedule()  # prefill, samples token 1
    o2 = s.schedule()  # decodes token 1 (a placeholder) before o1 is applied
    assert o2.seqs[0].start_pos == 4 and o2.seqs[0].sample and r.num_tokens == 4
    assert s.update(o1, [9]) == [r]  # stop token: finished one step late
    assert r.status == RequestStatus.FINISHED_STOPPED and r.block_ids == []
    assert s.update(o2, [5]) == [] and r.output_token_ids == [9]  # the extra token is dropped
    assert s.schedule().is_empty
    assert_idle(s)


def test_length_limit_is_not_scheduled_past():
    s = make_async(max_model_len=64)
    r = make("r", [1, 2, 3], max_tokens=2)
    s.add_request(r)
    o1, o2 = s.schedule(), s.schedule()
    assert s.schedule().is_empty, "its last token is in flight: nothing to schedule"
    s.update(o1, [4])
    assert s.update(o2, [5]) == [r] and r.status == RequestStatus.FINISHED_LENGTH
    assert r.output_token_ids == [4, 5]
    assert_idle(s)


def test_abort_and_preemption_with_a_step_in_flight():
    # 4 usable blocks of 2: the prompts fill them, so a's placeholder preempts the newest, b.
    s = make_async(num_blocks=5, block_size=2, max_model_len=8)
    a, b = make("a", [1, 2, 3, 4], max_tokens=4), make("b", [4, 5, 6, 7], max_tokens=4)
    s.add_request(a)
    s.add_request(b)
    model = FutureFakeModel(s)
    o1 = s.schedule()
    model.step(o1)
    o2 = s.schedule()  # both decode their placeholder; a needs a third block: b is preempted
    model.step(o2)
    assert o2.preempted_ids == ("b",) and b.status == RequestStatus.PREEMPTED
    assert b.block_ids == [] and b.num_computed_tokens == 0
    s.update(o1, [model.future["a"], 7])  # b's in-flight token is dropped
    assert b.num_tokens == 4 and a.num_tokens == 5
    s.abort_request("a")  # aborted with o2 in flight
    assert s.update(o2, [8]) == [] and a.num_tokens == 5
    s.block_pool.check_invariants()
    run_async(s, model)
    assert (b.output_token_ids, b.status) == reference_output(b, 8)
    assert_idle(s)


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(), st.integers(0, 2**32))
def test_random_async_workloads_equal_reference(workload, seed):
    cfg, reqs = workload
    rnd = random.Random(seed)
    s = make_async(**cfg)
    model = FutureFakeModel(s)
    admitted, aborted = [], set()
    pending: tuple[SchedulerOutput, list[int]] | None = None
    step = 0
    while step < 2000:
        for arrive, _, req in reqs:
            if arrive == step:
                try:
                    s.add_request(req)
                    admitted.append(req)
                except RequestTooLongError:
                    pass
        for _, abort, req in reqs:  # between steps, with one in flight
            if abort == step and s.abort_request(req.request_id) is not None:
                aborted.add(req.request_id)
        if step > 12 and not s.has_unfinished_requests() and pending is None:
            break
        out = s.schedule()
        ids = [q.request.request_id for q in out.seqs]
        assert len(ids) == len(set(ids)) and len(ids) <= cfg["max_num_seqs"]
        assert out.num_batched_tokens == sum(q.num_tokens for q in out.seqs)
        assert out.num_batched_tokens <= cfg["max_num_batched_tokens"]
        for q in out.seqs:
            assert q.start_pos + q.num_tokens == q.request.num_computed_tokens
            assert q.start_pos + q.num_tokens <= cfg["max_model_len"]
        if pending is None and s.has_unfinished_requests() and not out.preempted_ids:
            assert not out.is_empty, "stalled"
        launched = (out, model.step(out)) if not out.is_empty else None
        if s.running and rnd.random() < 0.03:  # aborted while two steps are in flight
            victim = rnd.choice(s.running)
            s.abort_request(victim.request_id)
            aborted.add(victim.request_id)
        if pending is not None:
            for r in s.update(*pending):
                assert r.is_finished and r.block_ids == []
        s.block_pool.check_invariants()
        pending = launched
        step += 1
    assert pending is None and not s.has_unfinished_requests(), "did not finish"
    assert_idle(s)
    event(f"placeholders: {model.num_placeholders > 0}")
    event(f"preempted: {s.num_preemptions_total > 0}")
    for req in admitted:
        assert req.is_finished
        if req.request_id not in aborted:
            assert (req.output_token_ids, req.status) == reference_output(req, cfg["max_model_len"])


# ------------------------------------------------------------------ the engine, CPU runner


def _tiny_llm(tok, overlap: bool, **kw):
    import torch

    from tandem.models.loader import build_model
    from tandem.models.loader.dummy import init_dummy_weights
    from tandem.runtime.config import EngineConfig, ModelSpec
    from tandem.runtime.llm import LLM
    from tests.runtime.test_engine import tiny_config

    cfg = tiny_config(tok.vocab_size)
    model = build_model(cfg, dtype=torch.float32, device="cpu")
    init_dummy_weights(model, seed=0, std=0.5)
    ec = EngineConfig(
        model=ModelSpec(model="tiny", device="cpu", dtype="float32"),
        cache=CacheConfig(block_size=4, num_blocks=kw.get("num_blocks")),
        scheduler=SchedulerConfig(max_num_seqs=8, max_model_len=80,
                                  max_num_batched_tokens=kw.get("budget", 64)),
    )  # fmt: skip
    return LLM(engine_config=ec, model_module=model, model_config=cfg, tokenizer=tok,
               overlap=overlap)  # fmt: skip


def test_overlapped_engine_equals_sync_engine(byte_bpe):
    from tandem.runtime.sampling_params import SamplingParams

    rnd = random.Random(3)
    prompts = [[rnd.randrange(1, byte_bpe.vocab_size) for _ in range(rnd.randint(2, 40))]
               for _ in range(14)]  # fmt: skip
    params = [
        SamplingParams(max_tokens=rnd.randint(1, 30), temperature=0.0,
                       stop_token_ids=(rnd.randrange(1, byte_bpe.vocab_size),),
                       ignore_eos=rnd.random() < 0.5)
        for _ in prompts
    ]  # fmt: skip
    params[3] = SamplingParams(max_tokens=12, temperature=0.0, repetition_penalty=1.3)
    params[5] = SamplingParams(max_tokens=9, temperature=0.0, min_tokens=4)
    params[7] = SamplingParams(
        max_tokens=9, temperature=0.8, seed=11, logprobs=True, top_logprobs=2
    )

    def run(overlap: bool, num_blocks: int | None, params: list) -> list:
        llm = _tiny_llm(byte_bpe, overlap, num_blocks=num_blocks, budget=32)
        eng = llm.engine
        assert eng.overlap == overlap
        got: dict[str, list] = {f"r{i}": [[], None, "", 0] for i in range(len(prompts))}
        for i, (p, q) in enumerate(zip(prompts, params, strict=True)):  # ragged, all at once
            eng.add_request(f"r{i}", p, q)
        while eng.has_unfinished_requests():
            for d in eng.step():
                g = got[d.request_id]
                assert g[1] is None, "a delta after the finish"
                g[0] += d.new_token_ids
                g[1], g[2], g[3] = d.finish_reason, g[2] + d.new_text, g[3] + len(d.logprobs)
        assert eng.scheduler.block_pool.usage == 0.0
        eng.scheduler.block_pool.check_invariants()
        if num_blocks:
            assert eng.scheduler.num_preemptions_total > 0
        return [(tuple(g[0]), *g[1:]) for g in got.values()]

    # Stop tokens that greedy decoding does reach, at different steps per request.
    probe = run(False, None, params)
    for i in range(0, len(params), 2):
        toks = probe[i][0]
        if len(toks) > 2 and params[i].temperature == 0.0 and not params[i].has_penalties:
            params[i] = SamplingParams(
                max_tokens=params[i].max_tokens,
                temperature=0.0,
                stop_token_ids=(toks[rnd.randrange(1, len(toks))],),
            )
    results = [run(False, None, params), run(True, None, params), run(True, 22, params)]
    assert results[1] == results[0]
    assert results[2] == results[0]
    assert {r[1] for r in results[0]} == {"stop", "length"}

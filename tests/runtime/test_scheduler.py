"""Scheduler: token budget, chunked prefill, policies, prefix reuse, preemption, stop rules.

A fake model writes a simulated KV cache through the block tables and reads the whole
context back from it before sampling, so wrong block tables, overwritten shared blocks or a
bad prefix hit change the tokens; its next token is a deterministic function of the context.
"""

from __future__ import annotations

import random

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, event, given, settings

from tandem.runtime.config import CacheConfig, SchedulerConfig
from tandem.runtime.request import Request, RequestStatus
from tandem.runtime.sampling_params import SamplingParams
from tandem.runtime.scheduler import RequestTooLongError, Scheduler
from tandem.runtime.types import SchedulerOutput

VOCAB = 11


def next_token(context: list[int]) -> int:
    return (sum((i + 3) * t for i, t in enumerate(context)) * 2654435761 >> 7) % VOCAB


class FakeModel:
    def __init__(self, scheduler: Scheduler) -> None:
        self.pool = scheduler.block_pool
        self.kv: dict[int, tuple[int, ...]] = {}  # slot -> context whose last token it holds

    def step(self, output: SchedulerOutput) -> list[int]:
        bs = self.pool.block_size
        sampled = []
        for seq in output.seqs:
            r = seq.request
            end = seq.start_pos + seq.num_tokens
            assert 0 not in r.block_ids and len(r.block_ids) * bs >= end
            for pos in range(seq.start_pos, end):
                block = r.block_ids[pos // bs]
                assert self.pool._ref_count[block] == 1, "writing a shared block"
                self.kv[block * bs + pos % bs] = tuple(r.token_ids[: pos + 1])
            if seq.sample:
                for pos in range(end):
                    assert self.kv[r.block_ids[pos // bs] * bs + pos % bs] == tuple(
                        r.token_ids[: pos + 1]
                    )
                sampled.append(next_token(r.token_ids[:end]))
        return sampled


def reference_output(request: Request, max_model_len: int) -> tuple[list[int], RequestStatus]:
    """What the request generates alone, applying the stop rules independently."""
    p = request.params
    tokens = list(request.prompt_token_ids)
    while True:
        t = next_token(tokens)
        tokens.append(t)
        n = len(tokens) - request.num_prompt_tokens
        if n >= p.min_tokens and (
            (t in request.eos_token_ids and not p.ignore_eos) or t in p.stop_token_ids
        ):
            return tokens[request.num_prompt_tokens :], RequestStatus.FINISHED_STOPPED
        if (p.max_tokens is not None and n >= p.max_tokens) or len(tokens) >= max_model_len:
            return tokens[request.num_prompt_tokens :], RequestStatus.FINISHED_LENGTH


def make(
    rid: str, prompt: list[int], max_tokens: int | None = 4, eos_token_ids=(), **params
) -> Request:
    params = SamplingParams(max_tokens=max_tokens, **params)
    return Request(rid, list(prompt), params, eos_token_ids=eos_token_ids)


def make_scheduler(num_blocks: int = 64, block_size: int = 4, **kw) -> Scheduler:
    prefix = kw.pop("enable_prefix_caching", True)
    kw.setdefault("max_model_len", 4096)
    return Scheduler(
        SchedulerConfig(**kw),
        CacheConfig(block_size=block_size, enable_prefix_caching=prefix),
        num_blocks,
    )


def run(
    s: Scheduler, model: FakeModel | None = None, max_steps: int = 10_000
) -> list[SchedulerOutput]:
    model = model or FakeModel(s)
    outputs = []
    while s.has_unfinished_requests():
        out = s.schedule()
        assert not out.is_empty, "no progress"
        s.update(out, model.step(out))
        s.block_pool.check_invariants()
        outputs.append(out)
        assert len(outputs) < max_steps
    return outputs


def assert_idle(s: Scheduler) -> None:
    pool = s.block_pool
    pool.check_invariants()
    assert pool.num_free_blocks == pool.num_usable_blocks and pool.usage == 0.0
    assert s.num_running == 0 and s.num_waiting == 0


def test_long_prompt_is_chunked_and_samples_at_the_end():
    s = make_scheduler(max_num_batched_tokens=16)
    r = make("a", list(range(50)), max_tokens=2)
    s.add_request(r)
    outs = run(s)
    chunks = [(o.seqs[0].start_pos, o.seqs[0].num_tokens, o.seqs[0].sample) for o in outs]
    assert chunks == [
        (0, 16, False),
        (16, 16, False),
        (32, 16, False),
        (48, 2, True),
        (50, 1, True),
    ]
    assert r.output_token_ids == reference_output(r, 4096)[0]
    assert_idle(s)


def test_decodes_go_first_and_share_the_budget():
    s = make_scheduler(max_num_batched_tokens=10)
    a = make("a", [1, 2, 3], max_tokens=5)
    s.add_request(a)
    model = FakeModel(s)
    out = s.schedule()
    s.update(out, model.step(out))
    b = make("b", list(range(30)), max_tokens=2)
    s.add_request(b)
    out = s.schedule()
    assert [(q.request.request_id, q.num_tokens) for q in out.seqs] == [("a", 1), ("b", 9)]
    assert out.num_batched_tokens == 10
    s.update(out, model.step(out))
    run(s, model)
    assert_idle(s)


def test_fcfs_and_max_num_seqs():
    s = make_scheduler(max_num_seqs=2, max_num_batched_tokens=64)
    model = FakeModel(s)
    for k in range(4):
        s.add_request(make(f"r{k}", [k + 1] * 5, max_tokens=3))
    out = s.schedule()
    assert [q.request.request_id for q in out.seqs] == ["r0", "r1"]
    assert s.num_running == 2 and s.num_waiting == 2
    s.update(out, model.step(out))
    outs = run(s, model)
    assert all(len(o.seqs) <= 2 for o in outs)
    assert [q.request.request_id for q in outs[-1].seqs] == ["r2", "r3"]
    assert_idle(s)


def test_priority_policy_order():
    s = make_scheduler(max_num_seqs=1, policy="priority")
    for rid, prio, arrival in [
        ("low", 5, 0.0),
        ("high", 0, 3.0),
        ("mid_late", 1, 2.0),
        ("mid_early", 1, 1.0),
    ]:
        s.add_request(
            Request(
                rid, [1, 2, 3], SamplingParams(max_tokens=2), arrival_time=arrival, priority=prio
            )
        )
    order = []
    for out in run(s):
        rid = out.seqs[0].request.request_id
        if not order or order[-1] != rid:
            order.append(rid)
    assert order == ["high", "mid_early", "mid_late", "low"]


def test_prefix_hits_are_counted_and_reused():
    s = make_scheduler(block_size=4)
    model = FakeModel(s)
    shared = list(range(100, 112))  # 3 full blocks
    a = make("a", shared + [1, 2], max_tokens=2)
    s.add_request(a)
    run(s, model)
    b = make("b", shared + [3], max_tokens=2)
    s.add_request(b)
    out = s.schedule()
    assert (out.seqs[0].start_pos, out.seqs[0].num_tokens) == (12, 1)
    assert b.num_cached_tokens == 12 and s.prefix_cache_hits == 12
    assert s.prefix_cache_queries == 14 + 13
    s.update(out, model.step(out))  # the model reads the shared blocks' KV back
    run(s, model)
    assert b.output_token_ids == reference_output(b, 4096)[0]
    # An identical prompt still computes its last token (lookup stops at len - 1).
    c = make("c", shared, max_tokens=1)
    s.add_request(c)
    out = s.schedule()
    assert c.num_cached_tokens == 8 and out.seqs[0].num_tokens == 4
    s.update(out, model.step(out))
    assert_idle(s)


def test_concurrent_requests_share_a_prefix_chunk():
    s = make_scheduler(block_size=4, max_num_batched_tokens=8)
    model = FakeModel(s)
    reqs = [make(f"r{k}", list(range(10)) + [k], max_tokens=3) for k in range(3)]
    for r in reqs:
        s.add_request(r)
    run(s, model)
    assert [r.num_cached_tokens for r in reqs] == [0, 8, 8]
    for r in reqs:
        assert r.output_token_ids == reference_output(r, 4096)[0]
    assert_idle(s)


def test_rejections_state_the_numbers():
    s = make_scheduler(num_blocks=9, block_size=4, max_model_len=40)  # 8 usable blocks: 32 slots
    with pytest.raises(RequestTooLongError, match=r"40"):
        s.add_request(make("a", list(range(40))))
    with pytest.raises(RequestTooLongError, match=r"30.*11.*41.*40"):
        s.add_request(make("b", list(range(30)), max_tokens=11))
    with pytest.raises(
        RequestTooLongError, match=r"34.*prompt 30.*max_tokens 4.*9 KV blocks.*8 blocks"
    ):
        s.add_request(make("c", list(range(30)), max_tokens=4))
    with pytest.raises(RequestTooLongError, match=r"40 tokens.*max_model_len 40"):
        s.add_request(make("d", [1], max_tokens=None))  # may run to max_model_len
    s.add_request(make("e", list(range(30)), max_tokens=3))  # 33 tokens, 32 KV slots: fits
    assert s.num_waiting == 1
    with pytest.raises(ValueError):
        s.add_request(make("e", [1]))
    run(s)
    assert_idle(s)


def test_preemption_recomputes_to_the_same_tokens():
    # 8 usable blocks of 4; each request grows to 5 blocks, so two cannot finish side by side.
    s = make_scheduler(num_blocks=9, block_size=4, max_num_seqs=2, enable_prefix_caching=False)
    model = FakeModel(s)
    reqs = [make(f"r{k}", [k + 1] * 6, max_tokens=14) for k in range(3)]
    for r in reqs:
        s.add_request(r)
    admissions = []
    while s.has_unfinished_requests():
        out = s.schedule()
        admissions += [q.request.request_id for q in out.seqs if q.start_pos == 0]
        for rid in out.preempted_ids:
            victim = next(r for r in reqs if r.request_id == rid)
            assert victim.status == RequestStatus.PREEMPTED and victim.num_computed_tokens == 0
            assert victim.block_ids == [] and s.get_request(rid) is victim
            assert all(q.start_pos > 0 for q in out.seqs), "admitted while preempting"
        s.update(out, model.step(out))
        s.block_pool.check_invariants()
    assert s.num_preemptions_total == reqs[1].num_preemptions > 0  # the newest running one
    assert admissions[:4] == ["r0", "r1", "r1", "r2"]  # a preempted request resumes first
    for r in reqs:
        assert (r.output_token_ids, r.status) == reference_output(r, 4096)
    assert_idle(s)


def test_abort_waiting_and_running_frees_once():
    s = make_scheduler(max_num_seqs=1)
    a, b = make("a", [1] * 9, max_tokens=20), make("b", [2] * 9)
    s.add_request(a)
    s.add_request(b)
    out = s.schedule()
    assert a.block_ids and s.block_pool.usage > 0
    assert s.abort_request("b") is b and b.status == RequestStatus.FINISHED_ABORTED
    assert s.abort_request("a") is a and a.block_ids == []
    assert s.abort_request("a") is None and s.get_request("a") is None
    assert s.update(out, [5]) == [] and a.num_tokens == 9  # results of an aborted seq ignored
    assert_idle(s)


def test_engine_finish_between_schedule_and_update():
    s = make_scheduler()
    a, b = make("a", [1, 2, 3], max_tokens=8), make("b", [4, 5], max_tokens=8)
    s.add_request(a)
    s.add_request(b)
    out = s.schedule()
    s.finish_request("a", RequestStatus.FINISHED_STOPPED)  # e.g. a stop string matched
    s.update(out, [7, 7])
    assert a.num_tokens == 3 and b.num_tokens == 3 and a.status == RequestStatus.FINISHED_STOPPED
    with pytest.raises(ValueError):
        s.update(out, [7])
    s.abort_request("b")
    assert_idle(s)


@pytest.mark.parametrize(
    "kw, expect",
    [
        (dict(eos_token_ids=(9,)), (1, RequestStatus.FINISHED_STOPPED, None)),
        (dict(eos_token_ids=(9,), ignore_eos=True), (6, RequestStatus.FINISHED_LENGTH, None)),
        (dict(eos_token_ids=(9,), min_tokens=3), (3, RequestStatus.FINISHED_STOPPED, None)),
        (dict(stop_token_ids=(9,)), (1, RequestStatus.FINISHED_STOPPED, 9)),
        (dict(max_tokens=None), (8, RequestStatus.FINISHED_LENGTH, None)),  # max_model_len 12
    ],
)
def test_stop_conditions(kw, expect):
    s = make_scheduler(max_model_len=12)
    kw = {"max_tokens": 6, **kw}
    r = make("r", [1, 2, 3, 4], **kw)
    s.add_request(r)
    finished = []
    while s.has_unfinished_requests():
        out = s.schedule()
        finished += s.update(out, [9])  # the "model" always says 9
    assert finished == [r]
    assert (r.num_output_tokens, r.status, r.stop_reason) == expect
    assert_idle(s)


@st.composite
def workloads(draw):
    cfg = dict(
        num_blocks=draw(st.sampled_from([5, 6, 7, 8, 10, 12, 16, 30])),
        block_size=draw(st.sampled_from([1, 2, 2, 4, 4])),
        max_num_batched_tokens=draw(st.integers(1, 24)),
        max_num_seqs=draw(st.integers(1, 6)),
        max_model_len=32,
        policy=draw(st.sampled_from(["fcfs", "priority"])),
        enable_prefix_caching=draw(st.booleans()),
        long_prefill_token_threshold=draw(st.sampled_from([0, 0, 3])),
    )
    prefixes = [[1, 2, 3, 4, 5, 6, 7, 8], [3] * 6, []]
    reqs = []
    for k in range(draw(st.integers(1, 10))):
        prompt = draw(st.sampled_from(prefixes)) + draw(
            st.lists(st.integers(0, VOCAB - 1), max_size=12)
        )
        prompt = prompt or [0]
        params = dict(
            max_tokens=draw(st.integers(1, 12)) if draw(st.integers(0, 7)) != 5 else None,
            min_tokens=draw(st.integers(0, 2)),
            ignore_eos=draw(st.booleans()),
            stop_token_ids=tuple(draw(st.lists(st.integers(0, VOCAB - 1), max_size=1))),
        )
        if params["max_tokens"] is not None:
            params["min_tokens"] = min(params["min_tokens"], params["max_tokens"])
        arrive = draw(st.sampled_from([0, 0, 1, 2, 3, 5, 8, 12]))
        abort = draw(st.integers(0, 30)) if draw(st.integers(0, 7)) == 5 else None
        req = Request(
            f"r{k}",
            prompt,
            SamplingParams(**params),
            arrival_time=float(arrive),
            priority=draw(st.integers(0, 2)),
            eos_token_ids=(0,),
        )
        reqs.append((arrive, abort, req))
    return cfg, reqs


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(), st.integers(0, 2**32))
def test_random_workloads_run_to_completion(workload, seed):
    cfg, reqs = workload
    rnd = random.Random(seed)  # hypothesis' own Random favours 0.0, aborting far too often
    s = make_scheduler(**cfg)
    model = FakeModel(s)
    admitted, aborted = [], set()
    step = 0
    while step < 2000:
        for arrive, _, req in reqs:
            if arrive == step:
                try:
                    s.add_request(req)
                    admitted.append(req)
                except RequestTooLongError as e:
                    assert str(req.num_prompt_tokens) in str(e)
                    max_total = req.num_prompt_tokens + (
                        req.params.max_tokens or cfg["max_model_len"]
                    )
                    kv_slots = (cfg["num_blocks"] - 1) * cfg["block_size"]
                    assert max_total > cfg["max_model_len"] or max_total - 1 > kv_slots
        for _, abort, req in reqs:
            if abort == step and s.abort_request(req.request_id) is not None:
                aborted.add(req.request_id)
        if step > 12 and not s.has_unfinished_requests():
            break
        was_running = {r.request_id for r in s.running}
        out = s.schedule()
        ids = [q.request.request_id for q in out.seqs]
        assert len(ids) == len(set(ids)) and len(ids) <= cfg["max_num_seqs"]
        assert out.num_batched_tokens == sum(q.num_tokens for q in out.seqs)
        assert out.num_batched_tokens <= cfg["max_num_batched_tokens"]
        running_first = [rid in was_running for rid in ids]
        assert running_first == sorted(running_first, reverse=True), (
            "a new prefill went before a running seq"
        )
        if s.has_unfinished_requests() and not out.preempted_ids:
            assert not out.is_empty, "stalled"
        if out.preempted_ids:  # blocks are short: admit nothing new this step
            assert all(rid in was_running for rid in ids)
        for q in out.seqs:
            assert q.start_pos == q.request.num_computed_tokens
            assert q.sample == (q.start_pos + q.num_tokens == q.request.num_tokens)
        sampled = model.step(out)
        if s.running and rnd.random() < 0.02:  # aborted while its step is in flight
            victim = rnd.choice(s.running)
            s.abort_request(victim.request_id)
            aborted.add(victim.request_id)
        for r in s.update(out, sampled):
            assert r.is_finished and r.block_ids == []
        s.block_pool.check_invariants()
        step += 1
    assert not s.has_unfinished_requests(), "did not finish"
    assert_idle(s)
    event(f"preempted: {s.num_preemptions_total > 0}")
    event(f"prefix hits: {s.prefix_cache_hits > 0}")
    event(f"completed normally: {len(admitted) - len(aborted) > 0}")
    event(f"rejected: {len(reqs) - len(admitted)}")
    for req in admitted:
        assert req.is_finished
        if req.request_id not in aborted:
            assert (req.output_token_ids, req.status) == reference_output(req, cfg["max_model_len"])

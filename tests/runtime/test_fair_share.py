"""The scheduler's fair share of running slots: one client request's sequences (a group) cannot
keep more than its share while another group waits below its own."""

from __future__ import annotations

from tandem.runtime.config import CacheConfig, SchedulerConfig
from tandem.runtime.request import Request
from tandem.runtime.sampling_params import SamplingParams
from tandem.runtime.scheduler import Scheduler

PARAMS = SamplingParams(max_tokens=1000, ignore_eos=True)


def make(max_num_seqs: int = 8) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=4096, max_model_len=2048),
        CacheConfig(block_size=4),
        num_blocks=1000,
    )


def add(s: Scheduler, group: str, n: int) -> None:
    for i in range(n):
        s.add_request(Request(f"{group}-{i}", [1, 2, 3], PARAMS, group=group))


def step(s: Scheduler) -> dict[str, int]:
    out = s.schedule()
    s.update(out, [5 for q in out.seqs if q.sample])
    held: dict[str, int] = {}
    for r in s.running:
        held[r.group] = held.get(r.group, 0) + 1
    return held


def test_a_request_holding_every_slot_makes_room_for_a_newcomer() -> None:
    s = make(8)
    add(s, "big", 64)
    assert step(s) == {"big": 8}
    add(s, "small", 1)
    held = step(s)
    held = step(s) if "small" not in held else held
    # before: "small" waited until one of big's sequences finished (1000 tokens)
    assert held == {"big": 7, "small": 1}
    for _ in range(5):  # stable: no thrashing
        assert step(s) == {"big": 7, "small": 1}


def test_groups_converge_to_equal_shares_and_single_requests_are_untouched() -> None:
    s = make(8)
    add(s, "a", 64)
    step(s)
    add(s, "b", 64)
    for _ in range(10):
        held = step(s)
    assert held == {"a": 4, "b": 4}
    # requests of one sequence each: plain FCFS up to max_num_seqs, nobody preempted
    s = make(4)
    for i in range(6):
        add(s, f"r{i}", 1)
    for _ in range(3):
        held = step(s)
    assert held == {"r0": 1, "r1": 1, "r2": 1, "r3": 1}
    assert s.num_preemptions_total == 0

"""A model with windowed and full layers (GPT-OSS): the windowed layers' blocks come from a pool
of their own, released behind the window, while the full layers' blocks cover the whole
sequence. A fake model reads every query's whole context back through the main block table
and its window through the window table, so a released block still in use, a block reused
while read, or a wrong prefix hit changes the tokens. Then the same through the real engine
on a tiny GPT-OSS against transformers, and the KV sizing.
"""

from __future__ import annotations

import random

import pytest

from tandem.runtime.config import CacheConfig, SchedulerConfig
from tandem.runtime.kv_cache import NULL_BLOCK_ID
from tandem.runtime.request import Request, RequestStatus
from tandem.runtime.sampling_params import SamplingParams
from tandem.runtime.scheduler import Scheduler
from tandem.runtime.types import SchedulerOutput
from tests.runtime.test_async_scheduler import run_async

VOCAB = 13
WINDOW = 6
BS = 4


def next_token(context: list[int]) -> int:
    """Depends on the whole context (full layers) and on its last WINDOW tokens in order."""
    tail = context[-WINDOW:]
    mixed = sum((i + 3) * t for i, t in enumerate(tail)) * 2654435761 + 7 * sum(context)
    return (mixed >> 7) % VOCAB


def reference(prompt: list[int], max_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens))
    return tokens[len(prompt) :]


class MixedFakeModel:
    """Writes each token into a simulated full cache and window cache; every query reads its
    whole context from the first and its window from the second."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.s = scheduler
        self.full: dict[int, tuple[int, ...]] = {}
        self.win: dict[int, tuple[int, ...]] = {}
        self.future: dict[str, int] = {}
        self.max_window_held = 0
        self.max_full_held = 0

    def step(self, output: SchedulerOutput) -> list[int]:
        sampled = []
        for seq in output.seqs:
            r = seq.request
            end = seq.start_pos + seq.num_tokens
            context = list(r.token_ids[:end])
            if len(context) < end:  # async mode: the token the step in flight samples
                context.append(self.future[r.request_id])
            held = [b for b in r.window_block_ids if b != NULL_BLOCK_ID]
            self.max_window_held = max(self.max_window_held, len(held))
            self.max_full_held = max(self.max_full_held, len(r.block_ids))
            assert NULL_BLOCK_ID not in r.block_ids, "a full layer's block was released"
            for pos in range(seq.start_pos, end):
                for table, kv in ((r.block_ids, self.full), (r.window_block_ids, self.win)):
                    block = table[pos // BS]
                    assert block != NULL_BLOCK_ID, "writing a released block"
                    kv[block * BS + pos % BS] = tuple(context[: pos + 1])
            for pos in range(seq.start_pos, end):
                for key in range(pos + 1):
                    block = r.block_ids[key // BS]
                    assert self.full[block * BS + key % BS] == tuple(context[: key + 1])
                for key in range(max(0, pos - WINDOW + 1), pos + 1):
                    block = r.window_block_ids[key // BS]
                    assert block != NULL_BLOCK_ID, f"position {key} released while in use"
                    assert self.win[block * BS + key % BS] == tuple(context[: key + 1])
            if seq.sample:
                self.future[r.request_id] = next_token(context)
                sampled.append(self.future[r.request_id])
        self.s.window_pool.check_invariants()
        return sampled


def make_scheduler(num_blocks: int, window_blocks: int, prefix: bool, async_mode: bool):
    return Scheduler(
        SchedulerConfig(max_num_batched_tokens=10, max_model_len=200),
        CacheConfig(block_size=BS, enable_prefix_caching=prefix),
        num_blocks,
        async_mode=async_mode,
        window_group=(WINDOW, window_blocks),
    )


def drive(s: Scheduler, model: MixedFakeModel, async_mode: bool) -> None:
    if async_mode:
        run_async(s, model)
        return
    steps = 0
    while s.has_unfinished_requests():
        out = s.schedule()
        assert not out.is_empty, "no progress"
        s.update(out, model.step(out))
        s.block_pool.check_invariants()
        steps += 1
        assert steps < 2000


def assert_idle(s: Scheduler) -> None:
    """Every block of both pools free (cached ones count as free)."""
    for pool in (s.block_pool, s.window_pool):
        pool.check_invariants()
        assert pool.num_free_blocks == pool.num_usable_blocks
    assert s.num_running == 0


@pytest.mark.parametrize("async_mode", [False, True])
@pytest.mark.parametrize("prefix", [True, False])
@pytest.mark.parametrize("num_blocks,window_blocks", [(64, 32), (16, 32), (64, 6)])
def test_window_pool_stays_bounded(async_mode, prefix, num_blocks, window_blocks) -> None:
    """(16, 32): the main pool preempts; (64, 6): the window pool does."""
    s = make_scheduler(num_blocks, window_blocks, prefix, async_mode)
    shared = list(range(1, 21))
    requests = [
        Request("a", shared + [1, 2], SamplingParams(max_tokens=24)),
        Request("b", shared + [3], SamplingParams(max_tokens=25)),
        Request("c", [5, 6, 7], SamplingParams(max_tokens=40)),
    ]
    for r in requests:
        s.add_request(r)
    model = MixedFakeModel(s)
    drive(s, model, async_mode)
    for r in requests:
        assert r.output_token_ids == reference(r.prompt_token_ids, r.params.max_tokens)
    # a chunk of up to 10 tokens plus the window behind it: at most 5 blocks of 4 in the window
    # pool, whatever the length; the full layers hold the whole sequence (c: 43 tokens)
    assert model.max_window_held <= 5
    assert model.max_full_held >= 11
    assert (s.num_preemptions_total > 0) == (num_blocks == 16 or window_blocks == 6)
    if prefix and s.num_preemptions_total == 0:
        assert s.prefix_cache_hits > 0  # b reuses a's prompt
    assert_idle(s)


def test_prefix_hit_is_cut_to_what_the_window_pool_still_holds() -> None:
    """A prefix whose windowed blocks were evicted from the window pool is reused only up to
    where both pools hold it; the output is the reference either way."""
    s = make_scheduler(64, 10, True, False)
    prompt = list(range(1, 30))
    first = Request("a", prompt, SamplingParams(max_tokens=2))
    s.add_request(first)
    model = MixedFakeModel(s)
    drive(s, model, False)
    hashes = s.block_pool.prefix_hashes(prompt, 7)
    assert s.window_pool.get_window_blocks(hashes, 5) is not None  # a's last window blocks
    # other requests' windows evict the window pool's cached blocks, not the main pool's
    for i in range(3):
        s.add_request(Request(f"x{i}", [9 + i] * 25, SamplingParams(max_tokens=3)))
    drive(s, model, False)
    assert s.window_pool.get_window_blocks(hashes, 5) is None
    assert len(s.block_pool.get_computed_blocks(prompt, 28)) == 7
    again = Request("b", prompt, SamplingParams(max_tokens=5))
    s.add_request(again)
    drive(s, model, False)
    assert again.output_token_ids == reference(prompt, 5)
    assert again.num_cached_tokens < 7 * BS  # the full pool alone would have given 28
    assert_idle(s)


def test_soak_with_aborts_keeps_both_pools_consistent() -> None:
    rng = random.Random(7)
    for async_mode in (False, True):
        s = make_scheduler(24, 16, True, async_mode)
        model = MixedFakeModel(s)
        live: list[Request] = []
        pending = None
        for step in range(400):
            if rng.random() < 0.3 and len(live) < 6:
                prompt = [rng.randrange(1, VOCAB) for _ in range(rng.randrange(1, 30))]
                if rng.random() < 0.5 and live:
                    prompt = live[0].prompt_token_ids[:16] + prompt  # prefix hits
                r = Request(f"r{step}", prompt, SamplingParams(max_tokens=rng.randrange(1, 30)))
                s.add_request(r)
                live.append(r)
            if rng.random() < 0.05 and live:
                s.abort_request(live.pop(rng.randrange(len(live))).request_id)
            out = s.schedule()
            launched = (out, model.step(out)) if not out.is_empty else None
            if async_mode:
                if pending is not None:
                    s.update(*pending)
                pending = launched
            elif launched is not None:
                s.update(*launched)
            s.block_pool.check_invariants()
            live = [r for r in live if not r.status.finished]
        for r in list(live):
            s.abort_request(r.request_id)
        if pending is not None:
            s.update(*pending)
        assert_idle(s)
        assert all(r.status == RequestStatus.FINISHED_ABORTED for r in live)

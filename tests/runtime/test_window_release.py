"""A model whose every layer has a sliding window: the scheduler releases the blocks every window
has passed, so a long sequence holds a bounded number of blocks, and nothing it still reads is
released (a fake model reads each query's window back from a simulated cache, through the block
tables, so a released block still in use, or one reused while read, changes the tokens)."""

from __future__ import annotations

import pytest

from tandem.runtime.config import CacheConfig, SchedulerConfig
from tandem.runtime.kv_cache import NULL_BLOCK_ID
from tandem.runtime.request import Request
from tandem.runtime.sampling_params import SamplingParams
from tandem.runtime.scheduler import Scheduler
from tandem.runtime.types import SchedulerOutput
from tests.runtime.test_async_scheduler import run_async

VOCAB = 13
WINDOW = 6


def next_token(context: list[int]) -> int:
    """Depends on the last WINDOW tokens only, as a windowed model's output does."""
    tail = context[-WINDOW:]
    return (sum((i + 3) * t for i, t in enumerate(tail)) * 2654435761 >> 7) % VOCAB


class WindowedFakeModel:
    """Runs a step when launched (as the async scheduler's test model does: a token still in
    flight comes from its future map); every query reads its window back from the cache."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.pool = scheduler.block_pool
        self.kv: dict[int, tuple[int, ...]] = {}  # slot -> context whose last token it holds
        self.future: dict[str, int] = {}
        self.max_held = 0

    def step(self, output: SchedulerOutput) -> list[int]:
        bs = self.pool.block_size
        sampled = []
        for seq in output.seqs:
            r = seq.request
            end = seq.start_pos + seq.num_tokens
            context = list(r.token_ids[:end])
            if len(context) < end:  # async mode: the token the step in flight samples
                context.append(self.future[r.request_id])
            held = [b for b in r.block_ids if b != NULL_BLOCK_ID]
            self.max_held = max(self.max_held, len(held))
            for pos in range(seq.start_pos, end):
                block = r.block_ids[pos // bs]
                assert block != NULL_BLOCK_ID, "writing a released block"
                self.kv[block * bs + pos % bs] = tuple(context[: pos + 1])
            for pos in range(seq.start_pos, end):  # every query reads its window back
                for key in range(max(0, pos - WINDOW + 1), pos + 1):
                    block = r.block_ids[key // bs]
                    assert block != NULL_BLOCK_ID, f"position {key} released while in use"
                    assert self.kv[block * bs + key % bs] == tuple(context[: key + 1])
            if seq.sample:
                self.future[r.request_id] = next_token(context)
                sampled.append(self.future[r.request_id])
        return sampled


def reference(prompt: list[int], max_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens))
    return tokens[len(prompt) :]


@pytest.mark.parametrize("async_mode", [False, True])
@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.parametrize("num_blocks", [64, 6])  # 6: preemptions
def test_windowed_requests_hold_bounded_blocks(
    prefix_caching: bool, num_blocks: int, async_mode: bool
) -> None:
    s = Scheduler(
        SchedulerConfig(max_num_batched_tokens=10, max_model_len=200),
        CacheConfig(block_size=4, enable_prefix_caching=prefix_caching),
        num_blocks,
        window=WINDOW,
        async_mode=async_mode,
    )
    shared = list(range(1, 21))
    requests = [
        Request("a", shared + [1, 2], SamplingParams(max_tokens=40)),
        Request("b", shared + [3], SamplingParams(max_tokens=25)),
        Request("c", [5, 6, 7], SamplingParams(max_tokens=60)),
    ]
    for r in requests:
        s.add_request(r)
    model = WindowedFakeModel(s)
    if async_mode:  # schedule N+1, run it, then apply N
        run_async(s, model)
    else:
        steps = 0
        while s.has_unfinished_requests():
            out = s.schedule()
            assert not out.is_empty, "no progress"
            s.update(out, model.step(out))
            s.block_pool.check_invariants()
            steps += 1
            assert steps < 1000
    for r in requests:
        assert r.output_token_ids == reference(r.prompt_token_ids, r.params.max_tokens)
    # a chunk of up to 10 tokens plus the window behind it: at most 5 blocks of 4, whatever
    # the length (c reaches 63 tokens: 16 blocks without release)
    assert model.max_held <= 5
    assert (s.num_preemptions_total > 0) == (num_blocks == 6)
    pool = s.block_pool
    assert pool.num_free_blocks == pool.num_usable_blocks and s.num_running == 0


def test_release_before_is_idempotent_and_free_skips_released() -> None:
    s = Scheduler(SchedulerConfig(max_model_len=64), CacheConfig(block_size=4), 16, window=WINDOW)
    r = Request("a", list(range(1, 30)), SamplingParams(max_tokens=1))
    s.add_request(r)
    pool = s.block_pool
    out = s.schedule()
    assert out.seqs[0].num_tokens == 29 and len(r.block_ids) == 8
    free_before = pool.num_free_blocks
    assert pool.release_before(r, 17) == 4
    assert r.block_ids[:4] == [NULL_BLOCK_ID] * 4 and NULL_BLOCK_ID not in r.block_ids[4:]
    assert pool.release_before(r, 17) == 0 and pool.num_free_blocks == free_before + 4
    pool.check_invariants()
    s.finish_request("a", s.get_request("a").status.__class__.FINISHED_ABORTED)
    pool.check_invariants()
    assert pool.num_free_blocks == pool.num_usable_blocks

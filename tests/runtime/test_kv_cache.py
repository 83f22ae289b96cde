"""BlockPool: allocation, sharing, prefix caching, LRU eviction and invariants under random ops."""

from __future__ import annotations

import os
import subprocess
import sys

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tandem.runtime.kv_cache import BlockPool, hash_block
from tandem.runtime.request import Request
from tandem.runtime.sampling_params import SamplingParams


def make_request(request_id: str, token_ids: list[int]) -> Request:
    return Request(request_id, list(token_ids), SamplingParams(max_tokens=None))


def start(pool: BlockPool, request: Request, num_new_tokens: int | None = None) -> bool:
    """Look up the prefix cache and allocate, as the scheduler does."""
    computed = pool.get_computed_blocks(request.token_ids, request.num_tokens - 1)
    base = len(computed) * pool.block_size
    if num_new_tokens is None:
        num_new_tokens = request.num_tokens - base
    if not pool.allocate_for(request, num_new_tokens, computed):
        return False
    request.num_computed_tokens = base
    return True


def compute(pool: BlockPool, request: Request, num_tokens: int) -> None:
    request.num_computed_tokens += num_tokens
    pool.cache_full_blocks(request)


def test_block_zero_is_reserved_and_initial_state():
    pool = BlockPool(num_blocks=5, block_size=4)
    assert pool.num_free_blocks == 4
    assert pool.usage == 0.0
    request = make_request("a", list(range(16)))
    assert start(pool, request)
    assert sorted(request.block_ids) == [1, 2, 3, 4]
    assert pool.usage == 1.0 and pool.num_free_blocks == 0
    pool.check_invariants()


def test_allocate_fails_without_side_effects():
    pool = BlockPool(num_blocks=4, block_size=4)
    a = make_request("a", list(range(8)))
    assert start(pool, a)
    compute(pool, a, 8)
    b = make_request("b", list(range(20)))  # shares 2 cached blocks, needs 3 more; 1 free
    before = (pool.num_free_blocks, list(a.block_ids), pool.prefix_cache_queries)
    assert not start(pool, b)
    assert b.block_ids == [] and b.num_computed_tokens == 0
    assert (pool.num_free_blocks, list(a.block_ids), pool.prefix_cache_queries) == before
    pool.free(b)  # freeing a request that holds nothing is a no-op
    pool.check_invariants()


def test_growth_allocates_only_missing_blocks():
    pool = BlockPool(num_blocks=10, block_size=4)
    r = make_request("r", [1, 2, 3])
    assert start(pool, r) and len(r.block_ids) == 1
    compute(pool, r, 3)
    r.append_token(4)
    assert pool.allocate_for(r, 1) and len(r.block_ids) == 1
    compute(pool, r, 1)
    r.append_token(5)
    assert pool.allocate_for(r, 1) and len(r.block_ids) == 2
    assert pool.num_cached_blocks == 1  # the first block filled up
    pool.check_invariants()


def test_prefix_sharing_refcounts_and_counters():
    pool = BlockPool(num_blocks=10, block_size=4)
    prefix = list(range(100, 108))
    a = make_request("a", prefix + [1, 2])
    assert start(pool, a)
    compute(pool, a, 10)
    b = make_request("b", prefix + [3])
    assert pool.get_computed_blocks(b.token_ids, b.num_tokens - 1) == a.block_ids[:2]
    assert start(pool, b)
    assert b.num_computed_tokens == 8 and b.block_ids[:2] == a.block_ids[:2]
    assert pool.prefix_cache_hits == 8
    assert pool.prefix_cache_queries == 10 + 9
    pool.check_invariants()
    # The lookup never covers the last token: at least one is always computed.
    c = make_request("c", prefix)
    assert len(pool.get_computed_blocks(c.token_ids, c.num_tokens - 1)) == 1
    pool.free(a)
    pool.free(a)  # once only
    pool.check_invariants()
    assert pool.num_free_blocks == 9 - 3
    pool.free(b)
    pool.check_invariants()
    assert pool.num_free_blocks == 9 and pool.usage == 0.0
    assert pool.num_cached_blocks == 2


def test_lru_eviction_tail_first_and_hash_dropped():
    pool = BlockPool(num_blocks=5, block_size=2)
    a = make_request("a", [1, 2, 3, 4, 5, 6, 7, 8])
    assert start(pool, a)
    compute(pool, a, 8)
    assert pool.num_cached_blocks == 4
    blocks = list(a.block_ids)
    pool.free(a)
    # One free block is needed: the tail block of `a` is evicted, the prefix survives.
    b = make_request("b", [9, 9])
    assert start(pool, b)
    assert b.block_ids == [blocks[-1]]
    assert pool.num_cached_blocks == 3
    probe = [1, 2, 3, 4, 5, 6, 7, 8, 0]
    assert pool.get_computed_blocks(probe, 8) == blocks[:3]
    pool.check_invariants()


def test_uncached_free_blocks_are_used_before_evicting():
    pool = BlockPool(num_blocks=5, block_size=2)
    a = make_request("a", [1, 2])
    assert start(pool, a)
    compute(pool, a, 2)
    pool.free(a)
    b = make_request("b", [5, 6, 7, 8, 9, 10])
    assert start(pool, b)
    assert a.block_ids == [] and pool.num_cached_blocks == 1
    assert pool.get_computed_blocks([1, 2, 3], 2) != []


def test_duplicate_content_is_not_double_registered():
    pool = BlockPool(num_blocks=8, block_size=2)
    a, b = make_request("a", [1, 2, 3]), make_request("b", [1, 2, 4])
    assert start(pool, a) and start(pool, b)  # both miss: nothing cached yet
    compute(pool, a, 3)
    compute(pool, b, 3)
    assert pool.num_cached_blocks == 1
    pool.free(a)
    pool.free(b)
    pool.check_invariants()
    assert pool.num_free_blocks == 7


def test_prefix_caching_disabled():
    pool = BlockPool(num_blocks=8, block_size=2, enable_prefix_caching=False)
    a = make_request("a", [1, 2, 3, 4, 5])
    assert start(pool, a)
    compute(pool, a, 5)
    assert pool.get_computed_blocks([1, 2, 3, 4, 5], 4) == []
    assert pool.num_cached_blocks == 0 and pool.prefix_cache_queries == 0
    pool.free(a)
    pool.check_invariants()


def test_hash_is_stable_across_processes():
    code = "from runtime.kv_cache import hash_block as h; print(h(h(None, [1, 2]), [3, 4]).hex())"
    outs = set()
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        res = subprocess.run(
            [sys.executable, "-c", code],
            env=env,
            capture_output=True,
            text=True,
            check=True,
            cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
        )
        outs.add(res.stdout.strip())
    assert outs == {hash_block(hash_block(None, [1, 2]), [3, 4]).hex()}
    assert hash_block(None, [1, 2]) != hash_block(hash_block(None, [0, 0]), [1, 2])


PREFIXES = [[7] * 8, [1, 2, 3, 4, 5, 6, 7, 8], [9, 8, 7, 6]]


class PoolMachine(RuleBasedStateMachine):
    """Random allocate/share/compute/cache/free/evict sequences against a simulated KV store."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(num_blocks=12, block_size=2)
        self.live: dict[str, Request] = {}
        self.kv: dict[int, list[tuple | None]] = {}  # block -> context written in each slot
        self.next_id = 0

    def _write(self, request: Request, num_tokens: int) -> None:
        bs = self.pool.block_size
        for pos in range(request.num_computed_tokens, request.num_computed_tokens + num_tokens):
            block = request.block_ids[pos // bs]
            assert self.pool._ref_count[block] == 1, "writing into a shared block"
            # Real KV depends on the whole context, not just the token at the slot.
            self.kv.setdefault(block, [None] * bs)[pos % bs] = tuple(request.token_ids[: pos + 1])

    @rule(
        prefix=st.sampled_from(PREFIXES),
        tail=st.lists(st.integers(0, 3), max_size=6),
        chunk=st.integers(1, 12),
    )
    def start_request(self, prefix: list[int], tail: list[int], chunk: int) -> None:
        request = make_request(f"r{self.next_id}", prefix + tail)
        self.next_id += 1
        computed = self.pool.get_computed_blocks(request.token_ids, request.num_tokens - 1)
        bs = self.pool.block_size
        for i, block in enumerate(computed):  # a hit must hold exactly that prefix's KV
            expected = [tuple(request.token_ids[: p + 1]) for p in range(i * bs, (i + 1) * bs)]
            assert self.kv[block] == expected
        free_before = self.pool.num_free_blocks
        num_new = min(chunk, request.num_tokens - len(computed) * bs)
        if self.pool.allocate_for(request, num_new, computed):
            request.num_computed_tokens = len(computed) * bs
            self.live[request.request_id] = request
        else:
            assert request.block_ids == [] and self.pool.num_free_blocks == free_before

    @precondition(lambda self: self.live)
    @rule(data=st.data(), num=st.integers(1, 5))
    def compute_tokens(self, data: st.DataObject, num: int) -> None:
        request = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        covered = len(request.block_ids) * self.pool.block_size
        num = min(num, covered - request.num_computed_tokens)
        while request.num_tokens < request.num_computed_tokens + num:
            request.append_token(data.draw(st.integers(0, 3)))
        self._write(request, num)
        compute(self.pool, request, num)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), num=st.integers(1, 6))
    def grow(self, data: st.DataObject, num: int) -> None:
        request = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        held, free_before = list(request.block_ids), self.pool.num_free_blocks
        if not self.pool.allocate_for(request, num):
            assert request.block_ids == held and self.pool.num_free_blocks == free_before

    @precondition(lambda self: self.live)
    @rule(data=st.data(), twice=st.booleans())
    def free(self, data: st.DataObject, twice: bool) -> None:
        request = self.live.pop(data.draw(st.sampled_from(sorted(self.live))))
        self.pool.free(request)
        if twice:
            self.pool.free(request)
        assert request.block_ids == []

    @invariant()
    def consistent(self) -> None:
        self.pool.check_invariants()
        held = {b for r in self.live.values() for b in r.block_ids}
        assert self.pool.num_free_blocks == self.pool.num_usable_blocks - len(held)

    def teardown(self) -> None:
        for request in self.live.values():
            self.pool.free(request)
        self.pool.check_invariants()
        assert self.pool.num_free_blocks == self.pool.num_usable_blocks


PoolMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestPoolMachine = PoolMachine.TestCase

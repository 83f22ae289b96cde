"""ext/attention_ref.py against a naive per-token, per-head loop on random ragged batches."""

from __future__ import annotations

import math
import random

import pytest
import torch

from tandem.ext.attention_ref import paged_attention, plan_paged_attention, write_kv


def _naive(q, k_cache, v_cache, query_lens, seq_lens, block_tables, scale, window=None, sinks=None):
    block_size = k_cache.shape[1]
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.zeros(q.shape, dtype=torch.float64)
    row = 0
    for i, (q_len, s_len) in enumerate(zip(query_lens, seq_lens, strict=True)):
        for t in range(q_len):
            pos = s_len - q_len + t
            for h in range(num_heads):
                kvh = h // group
                keys, vals = [], []
                first = 0 if window is None else max(0, pos - window + 1)
                for j in range(first, pos + 1):
                    b = int(block_tables[i, j // block_size])
                    keys.append(k_cache[b, j % block_size, kvh].double())
                    vals.append(v_cache[b, j % block_size, kvh].double())
                scores = torch.stack(keys) @ q[row, h].double() * scale
                if sinks is not None:  # one more logit in the softmax, its value dropped
                    scores = torch.cat((scores, sinks[h].double().view(1)))
                    vals.append(torch.zeros_like(vals[0]))
                out[row, h] = torch.softmax(scores, 0) @ torch.stack(vals)
            row += 1
    return out


def _random_batch(
    rng: random.Random,
    query_lens,
    seq_lens,
    num_heads,
    num_kv_heads,
    head_dim,
    block_size,
    dtype=torch.float32,
):
    max_blocks = max(-(-s // block_size) for s in seq_lens)
    num_blocks = max_blocks * len(seq_lens) + 3
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    block_tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    for i, s in enumerate(seq_lens):
        for b in range(-(-s // block_size)):
            block_tables[i, b] = ids.pop()
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim).to(dtype)
    q = torch.randn(sum(query_lens), num_heads, head_dim).to(dtype)
    return q, k_cache, v_cache, block_tables


CASES = [
    # (query_lens, seq_lens)
    ([1, 1, 1, 1], [1, 7, 33, 16]),  # decode only
    ([5, 17, 3], [5, 17, 20]),  # prefill only, one with a cached prefix
    ([1, 6, 1, 9, 1], [12, 6, 4, 30, 1]),  # mixed
    ([2], [2]),
]


@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("block_size", [16, 4])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_paged_attention_matches_naive(group: int, block_size: int, case: int) -> None:
    torch.manual_seed(case * 31 + group + block_size)
    rng = random.Random(case)
    query_lens, seq_lens = CASES[case]
    num_kv_heads, head_dim = 2, 8
    q, kc, vc, bt = _random_batch(
        rng, query_lens, seq_lens, num_kv_heads * group, num_kv_heads, head_dim, block_size
    )
    scale = 1.0 / math.sqrt(head_dim)
    out = paged_attention(q, kc, vc, query_lens, seq_lens, bt, scale)
    ref = _naive(q, kc, vc, query_lens, seq_lens, bt, scale)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    # A precomputed plan gives the same answer.
    plan = plan_paged_attention(query_lens, seq_lens, bt, block_size)
    torch.testing.assert_close(
        paged_attention(q, kc, vc, query_lens, seq_lens, bt, scale, plan), out
    )


def test_paged_attention_random_ragged_bf16() -> None:
    rng = random.Random(7)
    torch.manual_seed(7)
    for _ in range(5):
        n = rng.randint(1, 6)
        seq_lens = [rng.randint(1, 40) for _ in range(n)]
        query_lens = [rng.choice([1, s, rng.randint(1, s)]) for s in seq_lens]
        q, kc, vc, bt = _random_batch(
            rng, query_lens, seq_lens, 6, 2, 16, rng.choice([4, 16]), dtype=torch.bfloat16
        )
        out = paged_attention(q, kc, vc, query_lens, seq_lens, bt, 0.25)
        assert out.dtype == torch.bfloat16
        ref = _naive(q, kc, vc, query_lens, seq_lens, bt, 0.25)
        torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)


def test_write_kv_places_tokens_at_slots() -> None:
    num_blocks, block_size, kvh, d = 5, 4, 2, 3
    k_cache = torch.zeros(num_blocks, block_size, kvh, d)
    v_cache = torch.zeros(num_blocks, block_size, kvh, d)
    k = torch.randn(3, kvh, d)
    v = torch.randn(3, kvh, d)
    slots = torch.tensor([3 * block_size + 1, 0, 4 * block_size + 3])
    write_kv(k_cache, v_cache, k, v, slots)
    torch.testing.assert_close(k_cache[3, 1], k[0])
    torch.testing.assert_close(k_cache[0, 0], k[1])
    torch.testing.assert_close(v_cache[4, 3], v[2])
    assert int((k_cache != 0).any(-1).any(-1).sum()) == 3


def test_plan_workspace_reused_across_layers() -> None:
    rng = random.Random(3)
    torch.manual_seed(3)
    query_lens, seq_lens = [1, 7, 1, 12], [20, 7, 3, 40]
    layers = [
        _random_batch(rng, query_lens, seq_lens, 4, 2, 8, 4, dtype=torch.bfloat16) for _ in range(3)
    ]
    bt = layers[0][3]
    plan = plan_paged_attention(query_lens, seq_lens, bt, 4)
    for q, kc, vc, _ in layers:  # same block tables' shape, different caches per "layer"
        shared = paged_attention(q, kc, vc, query_lens, seq_lens, bt, 0.3, plan)
        fresh = paged_attention(q, kc, vc, query_lens, seq_lens, bt, 0.3)
        torch.testing.assert_close(shared, fresh, rtol=0, atol=0)


@pytest.mark.parametrize("window", [1, 3, 8, 100])
@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_window_and_sinks_match_naive(window: int, sinks: bool, case: int) -> None:
    """A sliding window (a key is seen while q_pos - k_pos < window) and per-head sinks, on
    their own and together, through a shared plan of the step (as every layer uses it)."""
    torch.manual_seed(case + window)
    rng = random.Random(case)
    query_lens, seq_lens = CASES[case]
    q, kc, vc, bt = _random_batch(rng, query_lens, seq_lens, 6, 2, 8, 4)
    s = torch.randn(6) * 2 if sinks else None
    ref = _naive(q, kc, vc, query_lens, seq_lens, bt, 0.4, window=window, sinks=s)
    out = paged_attention(q, kc, vc, query_lens, seq_lens, bt, 0.4, window=window, sinks=s)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    plan = plan_paged_attention(query_lens, seq_lens, bt, 4)  # full, as the backend plans
    shared = paged_attention(q, kc, vc, query_lens, seq_lens, bt, 0.4, plan, window, s)
    torch.testing.assert_close(shared, out, rtol=0, atol=0)
    assert window in plan.windowed
    full = paged_attention(q, kc, vc, query_lens, seq_lens, bt, 0.4, plan, None, s)
    torch.testing.assert_close(
        full.double(), _naive(q, kc, vc, query_lens, seq_lens, bt, 0.4, sinks=s), atol=1e-5,
        rtol=1e-5,
    )  # fmt: skip


def test_window_never_reads_blocks_before_it() -> None:
    """Blocks wholly before every query's window may hold anything (freed, reused)."""
    rng = random.Random(2)
    torch.manual_seed(2)
    query_lens, seq_lens = [1, 5, 1], [30, 22, 9]
    q, kc, vc, bt = _random_batch(rng, query_lens, seq_lens, 4, 2, 8, 4)
    out = paged_attention(q, kc, vc, query_lens, seq_lens, bt, 0.3, window=6)
    for i, (q_len, s_len) in enumerate(zip(query_lens, seq_lens, strict=True)):
        first_block = max(0, s_len - q_len - 6 + 1) // 4
        for b in range(first_block):
            kc[int(bt[i, b])] = float("nan")
            vc[int(bt[i, b])] = float("nan")
    again = paged_attention(q, kc, vc, query_lens, seq_lens, bt, 0.3, window=6)
    torch.testing.assert_close(again, out, rtol=0, atol=0)

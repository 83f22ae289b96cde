"""CPU paged attention (ext/cpu/attention.*): parity with the torch reference on ragged batches
(decode rows, prefill chunks over a cached prefix, GQA, bf16 and fp32 caches), bitwise batch
invariance of each row, and validation."""

from __future__ import annotations

import pytest
import torch

from tandem.ext.attention_ref import paged_attention
from tandem.ext.cpu.attention import paged_attention_cpu


def _case(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    bs, nb = 16, 48
    k = torch.randn(nb, bs, kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(nb, bs, kv_heads, head_dim, generator=g).to(dtype)
    tables = torch.randperm(nb, generator=g).to(torch.int32)[:45].view(3, 15)
    return k, v, tables, g


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 16), (9, 3, 64), (8, 2, 80)])
def test_parity_with_reference(dtype, heads, kv_heads, head_dim) -> None:
    k, v, tables, g = _case(dtype, heads, kv_heads, head_dim, heads * head_dim)
    for query_lens, seq_lens in [([1, 1, 1], [1, 17, 200]), ([5, 1, 40], [30, 100, 40])]:
        q = torch.randn(sum(query_lens), heads, head_dim, generator=g).to(dtype)
        ref = paged_attention(q, k, v, query_lens, seq_lens, tables, head_dim**-0.5)
        out = paged_attention_cpu(q, k, v, query_lens, seq_lens, tables, head_dim**-0.5)
        assert out.dtype == dtype and out.shape == ref.shape
        tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)


def test_rows_do_not_depend_on_the_batch_or_the_chunking() -> None:
    k, v, tables, g = _case(torch.bfloat16, 9, 3, 64, 3)
    q = torch.randn(46, 9, 64, generator=g).to(torch.bfloat16)
    scale = 0.125
    batch = paged_attention_cpu(q, k, v, [5, 1, 40], [30, 200, 40], tables, scale)
    # The torch reference is not batch-invariant (decode rows share a padded SDPA): the
    # kernel must be, bitwise.
    assert torch.equal(paged_attention_cpu(q[6:], k, v, [40], [40], tables[2:], scale), batch[6:])
    chunk = paged_attention_cpu(q[16:], k, v, [30], [40], tables[2:], scale)  # prefix cached
    assert torch.equal(chunk, batch[16:])
    one = paged_attention_cpu(q[45:], k, v, [1], [40], tables[2:], scale)  # last row as decode
    assert torch.equal(one, batch[45:])
    alone = paged_attention_cpu(q[5:6], k, v, [1], [200], tables[1:2], scale)
    assert torch.equal(alone, batch[5:6])


def test_bad_lengths_are_refused() -> None:
    k, v, tables, g = _case(torch.float32, 4, 2, 16, 5)
    q = torch.randn(3, 4, 16)
    with pytest.raises(ValueError, match="sum"):
        paged_attention_cpu(q, k, v, [2], [2], tables[:1], 1.0)
    with pytest.raises(ValueError, match="range"):
        paged_attention_cpu(q, k, v, [3], [15 * 16 + 1], tables[:1], 1.0)  # past the table
    with pytest.raises(ValueError, match="range"):
        paged_attention_cpu(q, k, v, [3], [2], tables[:1], 1.0)  # KV shorter than the rows
    bad = tables.clone()
    bad[0, 0] = 999
    with pytest.raises(ValueError, match="block"):
        paged_attention_cpu(q, k, v, [3], [3], bad[:1], 1.0)
    with pytest.raises(ValueError, match="multiple"):
        paged_attention_cpu(torch.randn(3, 3, 16), k, v, [3], [3], tables[:1], 1.0)


def test_a_plan_made_once_serves_every_layer_alike() -> None:
    from tandem.ext.cpu.attention import plan_paged_attention_cpu

    k, v, tables, g = _case(torch.bfloat16, 9, 3, 64, 7)
    query_lens, seq_lens = [5, 1, 40], [30, 200, 40]
    plan = plan_paged_attention_cpu(query_lens, seq_lens, tables)
    for layer in range(3):  # other caches, same plan
        kl, vl = k.roll(layer, 0).contiguous(), v.roll(layer, 0).contiguous()
        q = torch.randn(46, 9, 64, generator=g).to(torch.bfloat16)
        own = paged_attention_cpu(q, kl, vl, query_lens, seq_lens, tables, 0.125)
        shared = paged_attention_cpu(q, kl, vl, query_lens, seq_lens, tables, 0.125, plan=plan)
        assert torch.equal(own, shared)
    with pytest.raises(ValueError, match="sum"):
        paged_attention_cpu(q[:45], k, v, query_lens, seq_lens, tables, 0.125, plan=plan)


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float32])
def test_new_kv_written_in_the_call_and_bf16_q_views_read_in_place(kv_dtype: torch.dtype) -> None:
    """new_kv: the same caches and output as write_kv then the call; a bf16 q that is a view of
    fused qkv rows gives the bits of its contiguous copy."""
    from tandem.ext.attention_ref import write_kv

    gen = torch.Generator().manual_seed(11)
    H, KVH, D, T = 6, 2, 16, 9
    qkv = torch.randn(T, (H + 2 * KVH) * D, generator=gen).bfloat16()
    q = qkv[:, : H * D].view(T, H, D)
    k = qkv[:, H * D : (H + KVH) * D].view(T, KVH, D)
    v = qkv[:, (H + KVH) * D :].view(T, KVH, D)
    tables = torch.tensor([[3, 1, 0], [2, 4, 5]], dtype=torch.int32)
    query_lens, seq_lens = [4, 5], [20, 5]
    slots = torch.tensor([3 * 16 + 0, 1 * 16 + 0, 1 * 16 + 2, 1 * 16 + 3, 32, 33, 34, 35, 36])
    caches = [torch.randn(6, 16, KVH, D, generator=gen).to(kv_dtype) for _ in range(2)]
    ref_k, ref_v = caches[0].clone(), caches[1].clone()
    write_kv(ref_k, ref_v, k, v, slots)
    expected = paged_attention_cpu(q.contiguous(), ref_k, ref_v, query_lens, seq_lens, tables, 0.25)
    got = paged_attention_cpu(
        q, caches[0], caches[1], query_lens, seq_lens, tables, 0.25, new_kv=(k, v, slots)
    )
    assert torch.equal(caches[0], ref_k) and torch.equal(caches[1], ref_v)
    assert got.dtype == torch.bfloat16 and torch.equal(got, expected)
    with pytest.raises(ValueError, match="slot"):
        paged_attention_cpu(
            q, caches[0], caches[1], query_lens, seq_lens, tables, 0.25,
            new_kv=(k, v, slots + 1000),
        )  # fmt: skip

"""Pure-torch paged attention: the KV-cache write and attention over a paged KV cache.

This is the reference the CUDA kernels are checked against and the production path on CPU.
It owns no model or request logic: it sees only tensors, host-side length lists and block
tables. Layout: per layer K and V caches `[num_blocks, block_size, num_kv_heads, head_dim]`,
`slot = block_id * block_size + offset`.

Work is planned once per step (`plan_paged_attention`) and the plan is reused by every layer:
decode sequences (one query token) are batched into one masked SDPA call; each prefill
sequence gets one SDPA call with a causal mask offset by its cached prefix.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


def rotate_neox(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, neox style (halves rotated): x `[T, heads, head_dim]` with cos/sin
    `[T, 1, head_dim]` -> `x * cos + rotate_half(x) * sin`, in x's dtype."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store `k`/`v` `[num_tokens, num_kv_heads, head_dim]` at `slot_mapping` `[num_tokens]`."""
    num_kv_heads, head_dim = k_cache.shape[-2], k_cache.shape[-1]
    slots = slot_mapping.to(torch.int64)
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, v.to(v_cache.dtype))


@dataclass
class _PrefillSeq:
    token_start: int  # first row of this sequence in the flattened batch
    query_len: int
    seq_len: int
    blocks: torch.Tensor  # [num_blocks_used] int64
    mask: torch.Tensor  # [query_len, seq_len] bool: True where a query may attend


@dataclass
class PagedAttentionPlan:
    """Per-step gather indices and masks, shared by all layers of one forward."""

    num_tokens: int
    block_size: int
    decode_rows: torch.Tensor | None  # [num_decode] int64 rows of the batch; None: no decode
    decode_rows_are_all: bool  # every row of the batch is a decode row, in order
    decode_blocks: torch.Tensor | None  # [num_decode, max_blocks_used] int64
    decode_len: int  # max seq_len over the decode sequences
    decode_mask: torch.Tensor | None  # [num_decode, 1, 1, decode_len] bool
    prefills: list[_PrefillSeq]
    # Gather buffers reused by every layer of the step: fresh multi-MB allocations per layer
    # page-fault on each call and cost more than the attention itself on CPU.
    workspace: dict[str, torch.Tensor] = field(default_factory=dict)


def plan_paged_attention(
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: torch.Tensor,
    block_size: int,
) -> PagedAttentionPlan:
    """Build the gather indices and masks for one ragged batch (see `paged_attention`)."""
    device = block_tables.device
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    decode_seqs = [i for i, n in enumerate(query_lens) if n == 1]
    prefill_seqs = [i for i, n in enumerate(query_lens) if n > 1]

    decode_rows = decode_blocks = decode_mask = None
    decode_len = 0
    if decode_seqs:
        decode_len = max(seq_lens[i] for i in decode_seqs)
        nb = -(-decode_len // block_size)
        seq_idx = torch.tensor(decode_seqs, dtype=torch.int64, device=device)
        decode_rows = torch.tensor(
            [starts[i] for i in decode_seqs], dtype=torch.int64, device=device
        )
        decode_blocks = block_tables.index_select(0, seq_idx)[:, :nb].to(torch.int64)
        lens = torch.tensor([seq_lens[i] for i in decode_seqs], device=device)
        # [num_decode, 1, 1, decode_len]: key j is visible iff j < seq_len
        decode_mask = (torch.arange(decode_len, device=device)[None, :] < lens[:, None])[
            :, None, None
        ]

    prefills = []
    for i in prefill_seqs:
        q_len, s_len = query_lens[i], seq_lens[i]
        nb = -(-s_len // block_size)
        blocks = block_tables[i, :nb].to(torch.int64)
        q_pos = torch.arange(s_len - q_len, s_len, device=device)
        mask = torch.arange(s_len, device=device)[None, :] <= q_pos[:, None]  # [q_len, s_len]
        prefills.append(_PrefillSeq(starts[i], q_len, s_len, blocks, mask))

    return PagedAttentionPlan(
        num_tokens=starts[-1],
        block_size=block_size,
        decode_rows=decode_rows,
        decode_rows_are_all=len(decode_seqs) == len(query_lens),
        decode_blocks=decode_blocks,
        decode_len=decode_len,
        decode_mask=decode_mask,
        prefills=prefills,
    )


def _buffer(
    workspace: dict[str, torch.Tensor], key: str, numel: int, like: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    buf = workspace.get(key)
    if buf is None or buf.numel() < numel or buf.dtype != dtype or buf.device != like.device:
        buf = torch.empty(numel, dtype=dtype, device=like.device)
        workspace[key] = buf
    return buf[:numel]


def _gather(
    cache: torch.Tensor,
    blocks: torch.Tensor,
    length: int,
    workspace: dict[str, torch.Tensor],
    key: str,
) -> torch.Tensor:
    """`blocks` `[..., nb]` -> float32 view `[..., length, num_kv_heads, head_dim]`."""
    _, block_size, kvh, d = cache.shape
    flat = blocks.reshape(-1)
    shape = (flat.numel(), block_size, kvh, d)
    numel = flat.numel() * block_size * kvh * d
    raw = _buffer(workspace, key, numel, cache, cache.dtype).view(shape)
    torch.index_select(cache, 0, flat, out=raw)
    if cache.dtype != torch.float32:
        f32 = _buffer(workspace, key + ".f32", numel, cache, torch.float32).view(shape)
        raw = f32.copy_(raw)
    return raw.view(*blocks.shape[:-1], -1, kvh, d)[..., :length, :, :]


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: torch.Tensor,
    scale: float,
    plan: PagedAttentionPlan | None = None,
) -> torch.Tensor:
    """Causal attention of a flattened ragged batch over a paged KV cache.

    q `[num_tokens, num_heads, head_dim]`; sequence i's query rows sit at positions
    `seq_lens[i] - query_lens[i] .. seq_lens[i] - 1` and attend to KV positions `0..own`,
    whose K/V are already in the cache. `block_tables` `[num_seqs, max_blocks]` int32.
    GQA when num_heads is a multiple of num_kv_heads. Computes in float32; returns
    `[num_tokens, num_heads, head_dim]` in q.dtype.
    """
    if plan is None:
        plan = plan_paged_attention(query_lens, seq_lens, block_tables, k_cache.shape[1])
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    gqa = num_heads != num_kv_heads
    group = num_heads // num_kv_heads
    qf = q.float()
    ws = plan.workspace

    if plan.decode_rows is not None:
        dq = qf if plan.decode_rows_are_all else qf.index_select(0, plan.decode_rows)
        # One query token: heads sharing a KV head form its "query length" (head h -> h // group).
        dq = dq.view(-1, num_kv_heads, group, head_dim)  # [B, KVH, G, D]
        dk = _gather(k_cache, plan.decode_blocks, plan.decode_len, ws, "k")  # [B, L, KVH, D]
        dv = _gather(v_cache, plan.decode_blocks, plan.decode_len, ws, "v")
        dout = F.scaled_dot_product_attention(
            dq, dk.transpose(1, 2), dv.transpose(1, 2), attn_mask=plan.decode_mask, scale=scale
        ).reshape(-1, num_heads, head_dim)  # [B, H, D]
        if plan.decode_rows_are_all:
            return dout.to(q.dtype)
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)
    if plan.decode_rows is not None:
        out.index_copy_(0, plan.decode_rows, dout.to(q.dtype))

    for p in plan.prefills:
        pq = qf[p.token_start : p.token_start + p.query_len].transpose(0, 1)  # [H, q_len, D]
        pk = _gather(k_cache, p.blocks, p.seq_len, ws, "k").transpose(0, 1)  # [KVH, s_len, D]
        pv = _gather(v_cache, p.blocks, p.seq_len, ws, "v").transpose(0, 1)
        pout = F.scaled_dot_product_attention(
            pq, pk, pv, attn_mask=p.mask, scale=scale, enable_gqa=gqa
        )  # [H, q_len, D]
        out[p.token_start : p.token_start + p.query_len] = pout.transpose(0, 1).to(q.dtype)
    return out

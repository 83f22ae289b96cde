"""Pure-torch paged attention: the KV-cache write and attention over a paged KV cache.

This is the reference the CUDA kernels are checked against and the production path on CPU.
It owns no model or request logic: it sees only tensors, host-side length lists and block
tables. Layout: per layer K and V caches `[num_blocks, block_size, num_kv_heads, head_dim]`,
`slot = block_id * block_size + offset`.

Work is planned once per step (`plan_paged_attention`) and the plan is reused by every layer:
decode sequences (one query token) are batched into one masked SDPA call; each prefill
sequence gets one SDPA call with a causal mask offset by its cached prefix. A sliding-window
layer (a key is seen while `q_pos - k_pos < window`, transformers' rule) gets a plan of its own
that gathers only the blocks its window covers; learned per-head sinks (GPT-OSS) add one logit
per head to every softmax's denominator.
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
    key_len: int  # keys gathered: positions first_block * block_size .. seq_len - 1
    blocks: torch.Tensor  # [num_blocks_used] int64, from the first block the window reaches
    mask: torch.Tensor  # [query_len, key_len] bool: True where a query may attend


@dataclass
class PagedAttentionPlan:
    """Per-step gather indices and masks, shared by all layers of one forward."""

    num_tokens: int
    block_size: int
    decode_rows: torch.Tensor | None  # [num_decode] int64 rows of the batch; None: no decode
    decode_rows_are_all: bool  # every row of the batch is a decode row, in order
    decode_blocks: torch.Tensor | None  # [num_decode, max_blocks_used] int64
    decode_len: int  # keys gathered per decode sequence (max over them)
    decode_mask: torch.Tensor | None  # [num_decode, 1, 1, decode_len] bool
    prefills: list[_PrefillSeq]
    window: int | None = None
    # The inputs, to plan the windowed variants of this step on first use.
    query_lens: list[int] = field(default_factory=list)
    seq_lens: list[int] = field(default_factory=list)
    block_tables: torch.Tensor | None = None
    windowed: dict[int, PagedAttentionPlan] = field(default_factory=dict)
    # Gather buffers reused by every layer of the step: fresh multi-MB allocations per layer
    # page-fault on each call and cost more than the attention itself on CPU.
    workspace: dict[str, torch.Tensor] = field(default_factory=dict)

    def for_window(self, window: int | None) -> PagedAttentionPlan:
        """This step's plan for layers of sliding window `window` (None: full attention),
        planned once and shared by every such layer (and the workspace with them)."""
        if window == self.window:
            return self
        plan = self.windowed.get(window or 0)
        if plan is None:
            assert self.block_tables is not None
            plan = plan_paged_attention(
                self.query_lens, self.seq_lens, self.block_tables, self.block_size, window
            )
            plan.workspace = self.workspace
            self.windowed[window or 0] = plan
        return plan


def plan_paged_attention(
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: torch.Tensor,
    block_size: int,
    window: int | None = None,
) -> PagedAttentionPlan:
    """Build the gather indices and masks for one ragged batch (see `paged_attention`). With
    a `window`, each sequence gathers only from the first block its oldest query's window
    reaches: blocks before it are never read (they may be freed and reused)."""
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    device = block_tables.device
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    decode_seqs = [i for i, n in enumerate(query_lens) if n == 1]
    prefill_seqs = [i for i, n in enumerate(query_lens) if n > 1]

    def first_block(q_len: int, s_len: int) -> int:
        """The first block any of the sequence's queries may read."""
        if window is None:
            return 0
        return max(0, s_len - q_len - window + 1) // block_size

    decode_rows = decode_blocks = decode_mask = None
    decode_len = 0
    if decode_seqs:
        firsts = [first_block(1, seq_lens[i]) for i in decode_seqs]
        counts = [
            -(-seq_lens[i] // block_size) - f for i, f in zip(decode_seqs, firsts, strict=True)
        ]
        nb = max(counts)
        decode_len = (
            nb * block_size if window is not None else max(seq_lens[i] for i in decode_seqs)
        )
        seq_idx = torch.tensor(decode_seqs, dtype=torch.int64, device=device)
        decode_rows = torch.tensor(
            [starts[i] for i in decode_seqs], dtype=torch.int64, device=device
        )
        first = torch.tensor(firsts, dtype=torch.int64, device=device)
        # [num_decode, nb] block-table columns from each sequence's first block (clamped
        # columns pad the shorter ones; their keys are masked out below)
        cols = (first[:, None] + torch.arange(nb, device=device)[None, :]).clamp(
            max=block_tables.shape[1] - 1
        )
        decode_blocks = block_tables.index_select(0, seq_idx).to(torch.int64).gather(1, cols)
        lens = torch.tensor([seq_lens[i] for i in decode_seqs], device=device)
        # absolute position of gathered key j: first * block_size + j; seen iff in the window
        key_pos = first[:, None] * block_size + torch.arange(decode_len, device=device)[None, :]
        visible = key_pos < lens[:, None]
        if window is not None:
            visible &= key_pos > lens[:, None] - 1 - window
        decode_mask = visible[:, None, None]  # [num_decode, 1, 1, decode_len]

    prefills = []
    for i in prefill_seqs:
        q_len, s_len = query_lens[i], seq_lens[i]
        first = first_block(q_len, s_len)
        nb = -(-s_len // block_size)
        blocks = block_tables[i, first:nb].to(torch.int64)
        q_pos = torch.arange(s_len - q_len, s_len, device=device)
        k_pos = torch.arange(first * block_size, s_len, device=device)
        mask = k_pos[None, :] <= q_pos[:, None]  # [q_len, key_len]
        if window is not None:
            mask &= k_pos[None, :] > q_pos[:, None] - window
        prefills.append(_PrefillSeq(starts[i], q_len, s_len - first * block_size, blocks, mask))

    return PagedAttentionPlan(
        num_tokens=starts[-1],
        block_size=block_size,
        decode_rows=decode_rows,
        decode_rows_are_all=len(decode_seqs) == len(query_lens),
        decode_blocks=decode_blocks,
        decode_len=decode_len,
        decode_mask=decode_mask,
        prefills=prefills,
        window=window,
        query_lens=list(query_lens),
        seq_lens=list(seq_lens),
        block_tables=block_tables,
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


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    sinks: torch.Tensor | None,
    gqa: bool,
) -> torch.Tensor:
    """Masked attention, float32: q `[..., Hq, Lq, D]`, k/v `[..., Hk, Lk, D]` (Hq a multiple
    of Hk with `gqa`), mask bool broadcast to `[..., Hq, Lq, Lk]`. `sinks` (broadcast to
    `[..., Hq, Lq, 1]`) is one extra logit per head that joins the softmax and is dropped
    after it (transformers' GPT-OSS attention)."""
    if sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
    group = q.shape[-3] // k.shape[-3]
    if group > 1:
        k = k.repeat_interleave(group, dim=-3)
        v = v.repeat_interleave(group, dim=-3)
    scores = (q @ k.transpose(-1, -2)) * scale  # [..., Hq, Lq, Lk]
    scores = scores.masked_fill(~mask, float("-inf"))
    logits = torch.cat((scores, sinks.float().expand(*scores.shape[:-1], 1)), dim=-1)
    probs = torch.softmax(logits, dim=-1)[..., :-1]
    return probs @ v


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: torch.Tensor,
    scale: float,
    plan: PagedAttentionPlan | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of a flattened ragged batch over a paged KV cache.

    q `[num_tokens, num_heads, head_dim]`; sequence i's query rows sit at positions
    `seq_lens[i] - query_lens[i] .. seq_lens[i] - 1` and attend to KV positions `0..own`
    (with a sliding `window`: only those with `own - pos < window`), whose K/V are already in
    the cache. `block_tables` `[num_seqs, max_blocks]` int32. `sinks` `[num_heads]`: a learned
    logit per head in every softmax's denominator (GPT-OSS). GQA when num_heads is a multiple
    of num_kv_heads. Computes in float32; returns `[num_tokens, num_heads, head_dim]` in q.dtype.
    """
    if plan is None:
        plan = plan_paged_attention(query_lens, seq_lens, block_tables, k_cache.shape[1], window)
    else:
        plan = plan.for_window(window)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if sinks is not None and tuple(sinks.shape) != (num_heads,):
        raise ValueError(f"sinks must be [{num_heads}], got {tuple(sinks.shape)}")
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
        dsinks = None if sinks is None else sinks.view(1, num_kv_heads, group, 1)
        dout = _attend(
            dq, dk.transpose(1, 2), dv.transpose(1, 2), plan.decode_mask, scale, dsinks, False
        ).reshape(-1, num_heads, head_dim)  # [B, H, D]
        if plan.decode_rows_are_all:
            return dout.to(q.dtype)
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)
    if plan.decode_rows is not None:
        out.index_copy_(0, plan.decode_rows, dout.to(q.dtype))

    psinks = None if sinks is None else sinks.view(num_heads, 1, 1)
    for p in plan.prefills:
        pq = qf[p.token_start : p.token_start + p.query_len].transpose(0, 1)  # [H, q_len, D]
        pk = _gather(k_cache, p.blocks, p.key_len, ws, "k").transpose(0, 1)  # [KVH, L, D]
        pv = _gather(v_cache, p.blocks, p.key_len, ws, "v").transpose(0, 1)
        pout = _attend(pq, pk, pv, p.mask, scale, psinks, gqa)  # [H, q_len, D]
        out[p.token_start : p.token_start + p.query_len] = pout.transpose(0, 1).to(q.dtype)
    return out

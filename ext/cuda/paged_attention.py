"""Public entry points of the CUDA paged-attention kernels, for attention backends.

Every call goes through a `torch.ops.tandem.*` custom op (ext/cuda/ops.py), so torch.compile
traces through it and CUDA graphs capture it: no call reads a device value on the host.
The pure-torch reference with the same contract is ext/attention_ref.py.
"""

from __future__ import annotations

import torch

import tandem.ext.cuda.ops  # noqa: F401  (registers torch.ops.tandem.*)


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store k/v `[T, num_kv_heads, head_dim]` into caches `[num_blocks, block_size,
    num_kv_heads, head_dim]` at `slot_mapping` `[T]` int64; a negative slot skips its token."""
    torch.ops.tandem.write_kv(k_cache, v_cache, k, v, slot_mapping)


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    max_seq_len: int | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention: q `[num_seqs, H, D]`, one token per sequence at position
    `seq_lens[i] - 1`, over `seq_lens[i]` cached tokens (int32); block_tables `[num_seqs,
    max_blocks]` int32. `max_seq_len` (host int, >= every seq_len) sizes the split-K grid;
    default block_tables.shape[1] * block_size. `window`: only the last `window` tokens are
    read (the blocks before them may be released); `sinks` `[H]`: a learned logit per head in
    each softmax's denominator (GPT-OSS). Returns out `[num_seqs, H, D]`."""
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    torch.ops.tandem.paged_decode(
        out,
        q,
        k_cache,
        v_cache,
        seq_lens,
        block_tables,
        float(scale),
        int(max_seq_len or 0),
        int(window or 0),
        sinks,
    )
    return out


def paged_extend(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_query_len: int,
    scale: float,
    out: torch.Tensor | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Extend (prefill-chunk) attention of a ragged batch: q `[T, H, D]`, sequence i owns rows
    `query_start_loc[i]:query_start_loc[i+1]` (int32 `[num_seqs + 1]`), the last tokens of its
    `seq_lens[i]`, whose K/V are already in the cache; causal over prefix and chunk, within
    `window` positions when given; `sinks` as in `paged_decode`."""
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    torch.ops.tandem.paged_extend(
        out,
        q,
        k_cache,
        v_cache,
        query_start_loc,
        seq_lens,
        block_tables,
        int(max_query_len),
        float(scale),
        int(window or 0),
        sinks,
    )
    return out


def paged_attention_cuda(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_query_len: int,
    scale: float,
    out: torch.Tensor | None = None,
    max_seq_len: int | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Backend entry: a decode-only batch (`max_query_len <= 1`, one token per sequence) goes
    to the split-K decode kernel, anything else to the extend kernel. Shapes as in
    `paged_extend`; returns `[T, H, D]` in q.dtype."""
    if max_query_len <= 1 and q.shape[0] == seq_lens.shape[0]:
        return paged_decode(
            q, k_cache, v_cache, seq_lens, block_tables, scale, out, max_seq_len, window, sinks
        )
    return paged_extend(
        q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, max_query_len, scale, out,
        window, sinks,
    )  # fmt: skip

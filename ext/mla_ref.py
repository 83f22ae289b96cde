"""Pure-torch multi-head latent attention (DeepSeek MLA, absorbed form) over a paged latent
cache: the reference the CUDA kernel (ext/cuda/mla.py) is checked against.

A cache row is `[c (L) | k_pe (R)]` per token; every query head attends to the one latent
"head": softmax(scale * (q_latent . c + q_rope . k_pe)) @ c. Float32 math, one sequence at a
time, nothing clever. It owns no model logic (projections, W_UK/W_UV absorption, the KV write).
"""

from __future__ import annotations

import torch


def gather_latent(
    latent_cache: torch.Tensor, block_table: torch.Tensor, length: int
) -> torch.Tensor:
    """The first `length` rows of one sequence: `[length, L + R]` in the cache dtype."""
    block_size = latent_cache.shape[1]
    num_blocks = -(-length // block_size)
    blocks = block_table[:num_blocks].to(torch.int64)
    return latent_cache.index_select(0, blocks).reshape(-1, latent_cache.shape[2])[:length]


def mla_attention_ref(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    latent_cache: torch.Tensor,
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q_latent `[T, H, L]`, q_rope `[T, H, R]`, latent_cache `[num_blocks, block_size, L + R]`
    holding every sequence's rows (this step's included). Sequence i owns query rows
    `sum(query_lens[:i]) ...` at positions `seq_lens[i] - query_lens[i] .. seq_lens[i] - 1`;
    each attends to cache positions `0 ..` its own. `block_tables` `[num_seqs, max_blocks]`.
    Returns `[T, H, L]` in q_latent's dtype; a sequence with seq_len 0 gets zeros."""
    num_tokens, num_heads, num_latent = q_latent.shape
    if q_rope.shape[:2] != (num_tokens, num_heads):
        raise ValueError(f"q_rope {tuple(q_rope.shape)} does not match q_latent")
    if latent_cache.shape[2] != num_latent + q_rope.shape[2]:
        raise ValueError(
            f"cache rows of {latent_cache.shape[2]} != L {num_latent} + R {q_rope.shape[2]}"
        )
    if sum(query_lens) != num_tokens:
        raise ValueError(f"query_lens sum to {sum(query_lens)}, q has {num_tokens} rows")
    out = torch.zeros(
        num_tokens, num_heads, num_latent, dtype=torch.float32, device=q_latent.device
    )
    start = 0
    for i, (n, s) in enumerate(zip(query_lens, seq_lens, strict=True)):
        if n == 0 or s == 0:
            start += n
            continue
        rows = gather_latent(latent_cache, block_tables[i], s).float()  # [s, L + R]
        c, k_pe = rows[:, :num_latent], rows[:, num_latent:]
        ql = q_latent[start : start + n].float()  # [n, H, L]
        qr = q_rope[start : start + n].float()  # [n, H, R]
        scores = torch.einsum("nhl,sl->nhs", ql, c) + torch.einsum("nhr,sr->nhs", qr, k_pe)
        q_pos = torch.arange(s - n, s, device=rows.device)
        visible = torch.arange(s, device=rows.device)[None, :] <= q_pos[:, None]  # [n, s]
        scores = (scores * scale).masked_fill(~visible[:, None, :], float("-inf"))
        out[start : start + n] = torch.einsum("nhs,sl->nhl", scores.softmax(-1), c)
        start += n
    return out.to(q_latent.dtype)

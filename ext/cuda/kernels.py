"""Validated launchers of the paged-attention and KV-write kernels (eager, no autograd).

Each `launch_*` checks shapes, dtypes, strides and devices, then launches on torch's current
CUDA stream. They are the implementations behind the `torch.ops.tandem.*` custom ops
(ext/cuda/ops.py); call those, or the wrappers in ext/cuda/paged_attention.py, from models.
Layout: caches `[num_blocks, block_size, num_kv_heads, head_dim]`, slot = block * bs + offset.
"""

from __future__ import annotations

import math
from functools import cache

import torch

from tandem.ext.cuda._loader import f32, i32, i64, launch, ptr

HEAD_DIMS = (64, 128)
_DT = {torch.float16: 0, torch.bfloat16: 1}
_LOG2E = 1.4426950408889634

# Decode split-K planning
_DECODE_THREADS = 128
# tokens; one CTA iteration. At batch 1 a graph planned for max_model_len splits a short context
# into few partitions, each a serial chain of iterations: 128 made the 8B decode kernel 9.4 us a
# layer at 384 tokens of context (tools/bench_gpu.py --profile)
_MIN_PART_LEN = 64
_PART_ALIGN = 64  # partitions start on a multiple of one CTA iteration's tokens
_CTAS_PER_SM = 4


@cache
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int, int]:
    _check(
        k_cache.dim() == 4,
        f"k_cache must be [num_blocks, block_size, kv_heads, head_dim], got {tuple(k_cache.shape)}",
    )
    _check(k_cache.shape == v_cache.shape, "k_cache and v_cache shapes differ")
    _check(
        k_cache.dtype == v_cache.dtype and k_cache.dtype in _DT,
        f"cache dtype must be fp16 or bf16, got {k_cache.dtype}",
    )
    _check(
        k_cache.is_cuda and v_cache.device == k_cache.device, "caches must be on one CUDA device"
    )
    _check(k_cache.is_contiguous() and v_cache.is_contiguous(), "caches must be contiguous")
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    _check(
        block_size > 0 and block_size & (block_size - 1) == 0,
        f"block_size must be a power of 2, got {block_size}",
    )
    return num_blocks, block_size, num_kv_heads, head_dim


def _check_rows(x: torch.Tensor, name: str, device: torch.device, dtype: torch.dtype) -> None:
    """x `[T, heads, head_dim]`: last dim contiguous, rows 16-byte aligned."""
    _check(x.dim() == 3, f"{name} must be 3-D [tokens, heads, head_dim], got {tuple(x.shape)}")
    _check(x.device == device, f"{name} is on {x.device}, expected {device}")
    _check(x.dtype == dtype, f"{name} dtype {x.dtype} != cache dtype {dtype}")
    _check(x.stride(2) == 1, f"{name} must be contiguous in head_dim")
    _check(
        x.data_ptr() % 16 == 0 and x.stride(0) % 8 == 0 and x.stride(1) % 8 == 0,
        f"{name} rows must be 16-byte aligned (strides {x.stride()})",
    )


def _check_int(
    x: torch.Tensor, name: str, dtype: torch.dtype, device: torch.device, dim: int
) -> None:
    _check(x.dtype == dtype, f"{name} must be {dtype}, got {x.dtype}")
    _check(x.device == device, f"{name} is on {x.device}, expected {device}")
    _check(x.dim() == dim, f"{name} must be {dim}-D, got {tuple(x.shape)}")
    _check(x.stride(-1) == 1, f"{name} must be contiguous in its last dim")


def launch_write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    _, _, num_kv_heads, head_dim = _check_cache(k_cache, v_cache)
    _check_rows(k, "k", k_cache.device, k_cache.dtype)
    _check_rows(v, "v", k_cache.device, k_cache.dtype)
    _check(
        k.shape == v.shape and k.shape[1:] == (num_kv_heads, head_dim),
        f"k/v shape {tuple(k.shape)} does not match the cache",
    )
    _check_int(slot_mapping, "slot_mapping", torch.int64, k_cache.device, 1)
    num_tokens = k.shape[0]
    _check(slot_mapping.shape[0] == num_tokens, "slot_mapping length != number of tokens")
    _check(head_dim % 8 == 0, "head_dim must be a multiple of 8")
    total = num_tokens * num_kv_heads * (head_dim // 8)
    if total == 0:
        return
    threads = 256
    launch(
        "write_kv.cu",
        "write_kv_kernel",
        k_cache.device,
        (math.ceil(total / threads), 1, 1),
        (threads, 1, 1),
        (
            ptr(k_cache),
            ptr(v_cache),
            ptr(k),
            ptr(v),
            ptr(slot_mapping),
            i32(num_tokens),
            i32(num_kv_heads),
            i32(head_dim),
            i64(k.stride(0)),
            i64(k.stride(1)),
            i64(v.stride(0)),
            i64(v.stride(1)),
        ),
    )


def _check_attention(q, k_cache, v_cache, seq_lens, block_tables, out):
    _, block_size, num_kv_heads, head_dim = _check_cache(k_cache, v_cache)
    _check(head_dim in HEAD_DIMS, f"head_dim {head_dim} not in {HEAD_DIMS}")
    _check_rows(q, "q", k_cache.device, k_cache.dtype)
    num_heads = q.shape[1]
    _check(q.shape[2] == head_dim, f"q head_dim {q.shape[2]} != cache head_dim {head_dim}")
    _check(
        num_heads % num_kv_heads == 0,
        f"num_heads {num_heads} not a multiple of num_kv_heads {num_kv_heads}",
    )
    _check_int(seq_lens, "seq_lens", torch.int32, k_cache.device, 1)
    _check_int(block_tables, "block_tables", torch.int32, k_cache.device, 2)
    _check(block_tables.shape[0] == seq_lens.shape[0], "block_tables rows != number of sequences")
    _check(
        out.shape == q.shape and out.dtype == q.dtype and out.device == q.device,
        "out must match q in shape, dtype, device",
    )
    _check(out.is_contiguous(), "out must be contiguous")
    return block_size, num_kv_heads, head_dim, num_heads


def _check_window_sinks(window: int, sinks: torch.Tensor | None, q: torch.Tensor):
    """`window` >= 0 (0: full attention); sinks `[H]` on q's device -> float32 contiguous."""
    _check(window >= 0, f"window must be >= 0 (0: none), got {window}")
    if sinks is None:
        return None
    _check(
        tuple(sinks.shape) == (q.shape[1],),
        f"sinks must be [{q.shape[1]}], got {tuple(sinks.shape)}",
    )
    _check(sinks.device == q.device, f"sinks is on {sinks.device}, expected {q.device}")
    return sinks.to(torch.float32).contiguous()


def decode_head_chunk(group: int) -> int:
    """Query heads per decode CTA (a template instantiation): the group rounded up to 1/2/4/8."""
    for gp in (1, 2, 4):
        if group <= gp:
            return gp
    return 8


def decode_span(max_seq_len: int, window: int, table_tokens: int) -> int:
    """Tokens a decode query may read, for the split-K plan: `max_seq_len` (<= 0: the block
    table's `table_tokens`), at most the `window` (> 0) of a sliding-window layer."""
    span = max_seq_len if max_seq_len > 0 else table_tokens
    return min(span, window) if window > 0 else span


def plan_decode(
    num_seqs: int, num_kv_heads: int, group: int, max_seq_len: int, num_sms: int
) -> tuple[int, int]:
    """Split-K plan: (part_len, num_parts) so the grid fills about `_CTAS_PER_SM` CTAs per SM.

    Depends only on host integers (no device values), so a CUDA graph captured with an upper
    bound `max_seq_len` stays valid for any shorter contexts.
    """
    max_seq_len = max(1, max_seq_len)
    chunks = math.ceil(group / decode_head_chunk(group))
    base = num_seqs * num_kv_heads * chunks
    target = _CTAS_PER_SM * num_sms
    if base >= target or max_seq_len <= _MIN_PART_LEN:
        return max_seq_len, 1
    want = math.ceil(target / base)
    part_len = max(_MIN_PART_LEN, math.ceil(max_seq_len / want))
    part_len = math.ceil(part_len / _PART_ALIGN) * _PART_ALIGN
    return part_len, math.ceil(max_seq_len / part_len)


def launch_paged_decode(
    out: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_seq_len: int,
    window: int = 0,
    sinks: torch.Tensor | None = None,
) -> None:
    """One query token per sequence: q `[num_seqs, H, D]` -> out `[num_seqs, H, D]`.

    `max_seq_len` must be >= every seq_lens value (it sizes the split-K grid);
    <= 0 means block_tables.shape[1] * block_size. `window` > 0: the query sees only its last
    `window` tokens (the grid is planned for them alone); `sinks` `[H]`: a logit per head in
    each softmax's denominator.
    """
    block_size, num_kv_heads, head_dim, num_heads = _check_attention(
        q, k_cache, v_cache, seq_lens, block_tables, out
    )
    num_seqs = q.shape[0]
    _check(seq_lens.shape[0] == num_seqs, "decode needs one query token per sequence")
    if num_seqs == 0:
        return
    sinks = _check_window_sinks(window, sinks, q)
    max_seq_len = decode_span(max_seq_len, window, block_tables.shape[1] * block_size)
    group = num_heads // num_kv_heads
    gp = decode_head_chunk(group)
    chunks = math.ceil(group / gp)
    device = q.device
    index = device.index if device.index is not None else torch.cuda.current_device()
    part_len, num_parts = plan_decode(num_seqs, num_kv_heads, group, max_seq_len, _num_sms(index))
    if num_parts > 1:
        part_out = torch.empty(
            num_seqs, num_heads, num_parts, head_dim, dtype=torch.float32, device=device
        )
        part_lse = torch.empty(num_seqs, num_heads, num_parts, dtype=torch.float32, device=device)
    else:
        part_out = part_lse = None
    dt = _DT[q.dtype]
    launch(
        "paged_decode.cu",
        f"paged_decode_kernel<{dt},{head_dim},{gp}>",
        device,
        (num_kv_heads * chunks, num_seqs, num_parts),
        (_DECODE_THREADS, 1, 1),
        (
            ptr(out),
            ptr(part_out),
            ptr(part_lse),
            ptr(q),
            ptr(k_cache),
            ptr(v_cache),
            ptr(seq_lens),
            ptr(block_tables),
            ptr(sinks),
            i32(num_heads),
            i32(num_kv_heads),
            i32(group),
            i32(q.stride(0)),
            i32(q.stride(1)),
            i32(block_tables.stride(0)),
            i32(block_size.bit_length() - 1),
            i32(part_len),
            i32(num_parts),
            i32(window),
            f32(scale * _LOG2E),
        ),
        pdl=True,
    )
    if num_parts > 1:
        launch(
            "paged_decode.cu",
            f"paged_decode_reduce_kernel<{dt},{head_dim}>",
            device,
            (num_heads, num_seqs, 1),
            (head_dim, 1, 1),
            (
                ptr(out),
                ptr(part_out),
                ptr(part_lse),
                ptr(seq_lens),
                ptr(sinks),
                i32(num_heads),
                i32(part_len),
                i32(num_parts),
                i32(window),
            ),
            pdl=True,
        )


_EXTEND_ROWS = 64


def launch_paged_extend(
    out: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_query_len: int,
    scale: float,
    window: int = 0,
    sinks: torch.Tensor | None = None,
) -> None:
    """Ragged causal attention of q `[T, H, D]` (sequence i owns rows
    `query_start_loc[i]:query_start_loc[i+1]`, the last tokens of its `seq_lens[i]`) over the
    paged cache. `max_query_len` must be >= every query length (it sizes the grid). `window`
    > 0: a row sees only its last `window` positions; `sinks` `[H]` as in decode."""
    block_size, num_kv_heads, head_dim, num_heads = _check_attention(
        q, k_cache, v_cache, seq_lens, block_tables, out
    )
    _check_int(query_start_loc, "query_start_loc", torch.int32, q.device, 1)
    num_seqs = seq_lens.shape[0]
    _check(
        query_start_loc.shape[0] == num_seqs + 1, "query_start_loc must have num_seqs + 1 entries"
    )
    sinks = _check_window_sinks(window, sinks, q)
    if num_seqs == 0 or q.shape[0] == 0 or max_query_len <= 0:
        return
    group = num_heads // num_kv_heads
    tiles = math.ceil(max_query_len * group / _EXTEND_ROWS)
    launch(
        "paged_extend.cu",
        f"paged_extend_kernel<{_DT[q.dtype]},{head_dim}>",
        q.device,
        (tiles, num_seqs, num_kv_heads),
        (128, 1, 1),
        (
            ptr(out),
            ptr(q),
            ptr(k_cache),
            ptr(v_cache),
            ptr(query_start_loc),
            ptr(seq_lens),
            ptr(block_tables),
            ptr(sinks),
            i32(num_heads),
            i32(num_kv_heads),
            i32(group),
            i32(q.stride(0)),
            i32(q.stride(1)),
            i32(block_tables.stride(0)),
            i32(block_size.bit_length() - 1),
            i32(window),
            f32(scale * _LOG2E),
        ),
    )

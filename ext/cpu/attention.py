"""`paged_attention_cpu`: the Python face of the C++ paged attention (ext/cpu/attention.*).

Same contract and result (to rounding) as ext/attention_ref.py::paged_attention, but each query
row is computed alone in one fixed order over exactly its own keys, so its output is bitwise the
same whatever else is in the batch and however its prompt was chunked. Validates every tensor
before its address reaches C++. Knows nothing about models.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .build import load_extension


@dataclass(frozen=True)
class PagedAttentionPlan:
    """What `paged_attention_cpu` derives from a step's sequences, shared by every layer."""

    meta: torch.Tensor  # [3, num_seqs] int64: first query row, query length, sequence length
    tables: torch.Tensor  # [num_seqs, max_blocks] int32, contiguous
    num_tokens: int


def plan_paged_attention_cpu(
    query_lens: list[int], seq_lens: list[int], block_tables: torch.Tensor
) -> PagedAttentionPlan:
    num_seqs = len(query_lens)
    if len(seq_lens) != num_seqs or block_tables.dim() != 2 or block_tables.shape[0] < num_seqs:
        raise ValueError("query_lens, seq_lens and block_tables disagree on the sequences")
    tables = block_tables[:num_seqs].to(device="cpu", dtype=torch.int32).contiguous()
    starts = [0]
    for n in query_lens[:-1]:
        starts.append(starts[-1] + n)
    meta = torch.tensor([starts, list(query_lens), list(seq_lens)], dtype=torch.int64)
    return PagedAttentionPlan(meta, tables, sum(query_lens))


def paged_attention_cpu(
    q: torch.Tensor,  # [T, H, D] any float dtype, CPU
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D] bf16 or fp32, CPU
    v_cache: torch.Tensor,
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32, CPU
    scale: float,
    plan: PagedAttentionPlan | None = None,
    new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Causal attention of a flattened ragged batch; returns `[T, H, D]` in q.dtype. `plan`:
    `plan_paged_attention_cpu` of the same three arguments, made once per step. `new_kv`:
    (k, v `[T, KVH, D]`, slot_mapping `[T]`), this step's keys and values, written into the
    caches first (attention_ref.write_kv in the same call)."""
    if q.dim() != 3 or q.device.type != "cpu" or not q.dtype.is_floating_point:
        raise ValueError("q must be a [T, H, D] floating-point CPU tensor")
    T, H, D = q.shape
    if k_cache.shape != v_cache.shape or k_cache.dim() != 4 or k_cache.shape[-1] != D:
        raise ValueError(f"k/v caches must be [blocks, block_size, kv_heads, {D}] and alike")
    if k_cache.dtype not in (torch.bfloat16, torch.float32) or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"KV caches must be bf16 or float32, got {k_cache.dtype}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("KV caches must be contiguous")
    if k_cache.device.type != "cpu" or v_cache.device.type != "cpu":
        raise ValueError("KV caches must be on the CPU")
    num_blocks, block_size, kvh, _ = k_cache.shape
    if H % kvh:
        raise ValueError(f"num_heads {H} is not a multiple of num_kv_heads {kvh}")
    if plan is None:
        plan = plan_paged_attention_cpu(query_lens, seq_lens, block_tables)
    if plan.num_tokens != T:
        raise ValueError(f"query_lens sum to {plan.num_tokens}, q has {T} rows")
    meta, tables, num_seqs = plan.meta, plan.tables, plan.meta.shape[1]
    k_new = v_new = slots = None
    if new_kv is not None:
        k_new, v_new, slots = _check_new_kv(new_kv, T, kvh, D, k_cache.dtype)
    # bf16 q with unit-stride heads is read in place (e.g. a view of the fused qkv rows)
    q_bf16 = q.dtype == torch.bfloat16 and q.stride(2) == 1 and q.stride(1) == D
    qx = q if q_bf16 else q.float().contiguous()
    out = torch.empty(T, H, D, dtype=torch.bfloat16 if q_bf16 else torch.float32)
    if T:
        load_extension().paged_attention(
            qx.data_ptr(), out.data_ptr(), T, k_cache.data_ptr(), v_cache.data_ptr(),
            k_cache.dtype == torch.bfloat16, num_blocks, block_size, H, kvh, D, num_seqs,
            meta[0].data_ptr(), meta[1].data_ptr(), meta[2].data_ptr(), tables.data_ptr(),
            tables.shape[1], float(scale), q_bf16, qx.stride(0), q_bf16,
            0 if k_new is None else k_new.data_ptr(), 0 if v_new is None else v_new.data_ptr(),
            0 if k_new is None else k_new.stride(0), 0 if v_new is None else v_new.stride(0),
            0 if slots is None else slots.data_ptr(),
        )  # fmt: skip
    return out if out.dtype == q.dtype else out.to(q.dtype)


def _check_new_kv(
    new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    T: int,
    kvh: int,
    D: int,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """k, v as [T, KVH, D] rows in the caches' dtype (unit-stride heads), slots int64 [T]."""
    k, v, slots = new_kv
    rows = []
    for t in (k, v):
        if t.shape != (T, kvh, D) or t.device.type != "cpu":
            raise ValueError(f"new keys/values must be [{T}, {kvh}, {D}] CPU tensors")
        t = t.to(dtype)
        if t.stride(2) != 1 or t.stride(1) != D:
            t = t.contiguous()
        rows.append(t)
    if slots.shape != (T,) or slots.device.type != "cpu":
        raise ValueError(f"slot_mapping must be [{T}] on the CPU")
    return rows[0], rows[1], slots.to(torch.int64).contiguous()

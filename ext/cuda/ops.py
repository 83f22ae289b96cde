"""The kernels as torch custom ops (`torch.ops.tandem.*`), so torch.compile traces through them.

Each op writes into tensors it is given (`mutates_args`) and returns nothing; the fake
(meta) implementations therefore have nothing to compute. Registration needs no CUDA, so this
module imports on any machine; running an op needs CuPy and a CUDA device.
"""

from __future__ import annotations

import torch

from tandem.ext.cuda import kernels


@torch.library.custom_op("tandem::write_kv", mutates_args=("k_cache", "v_cache"))
def write_kv_op(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    kernels.launch_write_kv(k_cache, v_cache, k, v, slot_mapping)


@write_kv_op.register_fake
def _(k_cache, v_cache, k, v, slot_mapping) -> None:
    return None


@torch.library.custom_op("tandem::paged_decode", mutates_args=("out",))
def paged_decode_op(
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
    kernels.launch_paged_decode(
        out, q, k_cache, v_cache, seq_lens, block_tables, scale, max_seq_len, window, sinks
    )


@paged_decode_op.register_fake
def _(
    out, q, k_cache, v_cache, seq_lens, block_tables, scale, max_seq_len, window=0, sinks=None
) -> None:
    return None


@torch.library.custom_op("tandem::paged_extend", mutates_args=("out",))
def paged_extend_op(
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
    kernels.launch_paged_extend(
        out,
        q,
        k_cache,
        v_cache,
        query_start_loc,
        seq_lens,
        block_tables,
        max_query_len,
        scale,
        window,
        sinks,
    )


@paged_extend_op.register_fake
def _(
    out,
    q,
    k_cache,
    v_cache,
    query_start_loc,
    seq_lens,
    block_tables,
    max_query_len,
    scale,
    window=0,
    sinks=None,
) -> None:
    return None

"""The attention backend interface every model layer calls, and its pure-torch implementation.

A backend owns how K/V are stored into the paged cache and how attention over that cache is
computed; it knows nothing about models or requests. `torch` (ext/attention_ref.py) runs on
any device; `cpu` runs ext/cpu's batch-invariant C++ kernel on the CPU; `cupy`
(models/cupy_backend.py) runs ext/cuda's kernels on CUDA.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol, runtime_checkable

import torch

from tandem.ext.attention_ref import (
    PagedAttentionPlan,
    paged_attention,
    plan_paged_attention,
    write_kv,
)
from tandem.ext.mla_ref import mla_attention_ref
from tandem.models.batch import ForwardBatch

log = logging.getLogger(__name__)


@runtime_checkable
class AttentionBackend(Protocol):
    """Contract: `prepare` once per step, then `forward` once per layer of that step."""

    name: str

    def prepare(self, batch: ForwardBatch) -> None:
        """Per-step hook: may compute metadata shared by all layers into `batch.attn_metadata`."""
        ...

    def forward(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        batch: ForwardBatch,
        scale: float,
        window: int | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Write k/v `[T, KVH, D]` into `batch.kv_cache` layer `layer_idx` at
        `batch.slot_mapping`, then attend q `[T, H, D]` causally; returns `[T, H, D]`.
        `window`: this layer's sliding window (a key is seen while `q_pos - k_pos < window`;
        keys before it are never read); `sinks` `[H]`: a learned logit per head joining every
        softmax's denominator (GPT-OSS). None: full attention, no sinks."""
        ...

    def mla(
        self,
        q_latent: torch.Tensor,
        q_rope: torch.Tensor,
        latent_cache: torch.Tensor,
        batch: ForwardBatch,
        scale: float,
    ) -> torch.Tensor:
        """Multi-head latent attention over a paged latent cache (DeepSeek, absorbed form).

        q_latent `[T, H, L]`: q_nope already absorbed through W_UK into the latent space;
        q_rope `[T, H, R]`: rope applied; latent_cache `[num_blocks, block_size, L + R]`: this
        layer's cache with this step's rows ALREADY written at `batch.slot_mapping` (a row is
        [normed c_kv (L) | roped k_pe (R)]). Returns `[T, H, L]` in q_latent's dtype:
        softmax(scale * (q_latent . c + q_rope . k_pe)) @ c over each token's causal context
        (by position, as `ForwardBatch` lays it out), accumulated in float32. The caller applies
        W_UV and o_proj."""
        ...


class TorchAttentionBackend:
    """Reference backend: `ext.attention_ref` on whatever device the tensors live on."""

    name = "torch"

    def prepare(self, batch: ForwardBatch) -> None:
        batch.attn_metadata = plan_paged_attention(
            batch.query_lens_cpu, batch.seq_lens_cpu, batch.block_tables, batch.kv_cache.block_size
        )

    def forward(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        batch: ForwardBatch,
        scale: float,
        window: int | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        k_cache = batch.kv_cache.k[layer_idx]
        v_cache = batch.kv_cache.v[layer_idx]
        block_tables, slot_mapping = batch.kv_tables(window)
        write_kv(k_cache, v_cache, k, v, slot_mapping)
        if block_tables is batch.block_tables:
            plan = batch.attn_metadata
        else:  # the window pool's tables (GPT-OSS's windowed layers): a plan of their own
            plan = batch.window_attn_metadata
            if not isinstance(plan, PagedAttentionPlan):
                plan = plan_paged_attention(
                    batch.query_lens_cpu, batch.seq_lens_cpu, block_tables, k_cache.shape[1],
                    window,
                )  # fmt: skip
                batch.window_attn_metadata = plan
        if not isinstance(plan, PagedAttentionPlan):
            plan = None  # prepared by another backend or not at all: plan per call
        return paged_attention(
            q,
            k_cache,
            v_cache,
            batch.query_lens_cpu,
            batch.seq_lens_cpu,
            block_tables,
            scale,
            plan,
            window=window,
            sinks=sinks,
        )

    def mla(
        self,
        q_latent: torch.Tensor,
        q_rope: torch.Tensor,
        latent_cache: torch.Tensor,
        batch: ForwardBatch,
        scale: float,
    ) -> torch.Tensor:
        """See `AttentionBackend.mla`: ext.mla_ref, one sequence at a time from the host-side
        lengths (`query_lens_cpu`, `seq_lens_cpu`)."""
        if q_latent.is_cuda and torch.cuda.is_current_stream_capturing():
            # its loop bakes this step's host-side lengths in: a captured graph would replay them
            raise RuntimeError("the torch MLA reference cannot be captured in a CUDA graph")
        return mla_attention_ref(
            q_latent, q_rope, latent_cache, batch.query_lens_cpu, batch.seq_lens_cpu,
            batch.block_tables, scale,
        )  # fmt: skip


class CpuAttentionBackend:
    """The CPU's C++ kernel (ext/cpu/attention.*): each query row is computed alone over its own
    keys, so a sequence's output does not depend on the batch or on how its prompt was chunked."""

    name = "cpu"

    def __init__(self) -> None:
        from tandem.ext.cpu.attention import paged_attention_cpu, plan_paged_attention_cpu

        self._attend = paged_attention_cpu
        self._plan = plan_paged_attention_cpu

    def prepare(self, batch: ForwardBatch) -> None:
        batch.attn_metadata = self._plan(
            batch.query_lens_cpu, batch.seq_lens_cpu, batch.block_tables
        )  # once a step, not once a layer

    def forward(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        batch: ForwardBatch,
        scale: float,
        window: int | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if window is not None or sinks is not None:
            raise ValueError("the cpu attention backend has no sliding window nor sinks")
        k_cache = batch.kv_cache.k[layer_idx]
        v_cache = batch.kv_cache.v[layer_idx]
        return self._attend(
            q, k_cache, v_cache, batch.query_lens_cpu, batch.seq_lens_cpu, batch.block_tables,
            scale, plan=batch.attn_metadata, new_kv=(k, v, batch.slot_mapping),
        )  # fmt: skip


def cpu_backend_supports(dtype: torch.dtype) -> bool:
    """Whether the "cpu" backend serves this KV dtype here (the C++ extension builds)."""
    if dtype not in (torch.bfloat16, torch.float32):
        return False
    try:
        from tandem.ext.cpu import load_extension

        load_extension()
        return True
    except Exception as exc:  # no compiler or headers: the torch reference serves instead
        log.warning(
            "CPU attention kernel unavailable (%s: %s); using torch", type(exc).__name__, exc
        )
        return False


def _cupy_backend() -> AttentionBackend:
    # Imported on use: the kernels' module needs no CUDA to import, but keep the torch-only
    # path free of it.
    from tandem.models.cupy_backend import CupyAttentionBackend

    return CupyAttentionBackend()


_ATTENTION_BACKENDS: dict[str, Callable[[], AttentionBackend]] = {
    "torch": TorchAttentionBackend,
    "cpu": CpuAttentionBackend,
    "cupy": _cupy_backend,
}


def register_attention_backend(name: str, factory: Callable[[], AttentionBackend]) -> None:
    """Make `get_attention_backend(name)` return `factory()` (used by the GPU kernels)."""
    _ATTENTION_BACKENDS[name] = factory


def get_attention_backend(name: str) -> AttentionBackend:
    if name not in _ATTENTION_BACKENDS:
        raise ValueError(
            f"unknown attention backend {name!r}; available: {', '.join(sorted(_ATTENTION_BACKENDS))}"
        )
    return _ATTENTION_BACKENDS[name]()

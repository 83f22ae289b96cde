"""The `cupy` attention backend: ext/cuda's paged-attention kernels behind the backend interface.

Owns nothing but the call: the KV write and the attention go through `torch.ops.tandem.*`
custom ops, so torch.compile traces through them and CUDA graphs capture them. Every value the
launch planning needs is a host integer of `ForwardBatch` (`max_query_len`, `max_seq_len`);
no device value is read on the host. The torch backend (models/attention_backend.py) is the
reference it is tested against.
"""

from __future__ import annotations

import torch

from tandem.ext.cuda import is_available, paged_attention_cuda, paged_extend, write_kv
from tandem.ext.cuda.kernels import HEAD_DIMS
from tandem.ext.cuda.mla import LATENT_DIMS, ROPE_DIMS, mla_attention_cuda
from tandem.models.batch import ForwardBatch

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)


def cupy_backend_supports(head_dim: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the kernels can serve a model of this head_dim and dtype on this device."""
    return (
        device.type == "cuda"
        and head_dim in HEAD_DIMS
        and dtype in SUPPORTED_DTYPES
        and is_available()
    )


def cupy_backend_supports_mla(
    kv_lora_rank: int, rope_dim: int, num_heads: int, dtype: torch.dtype, device: torch.device
) -> bool:
    """Whether the MLA kernel can serve a DeepSeek-family model of these dims on this device."""
    return (
        device.type == "cuda"
        and kv_lora_rank in LATENT_DIMS
        and rope_dim in ROPE_DIMS
        and num_heads % 16 == 0
        and dtype in SUPPORTED_DTYPES
        and is_available()
    )


class CupyAttentionBackend:
    """Decode-only batches (one token per sequence) take the split-K decode kernel, every other
    batch the extend kernel. `batch.max_seq_len` may be an upper bound of the real lengths (a
    CUDA graph captured once serves any shorter context). `batch_invariant` (the
    `--deterministic` mode): every batch takes the extend kernel, whose rows each sum over key
    tiles at fixed positions, so a row's output does not depend on the batch or the chunking
    (the decode kernel's split-K plan varies with the batch size)."""

    name = "cupy"
    batch_invariant = False

    def prepare(self, batch: ForwardBatch) -> None:
        # The kernels plan from host ints alone; mark the step as prepared so the model does
        # not call us again.
        batch.attn_metadata = self.name

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
        # q [T, H, D], k/v [T, KVH, D] in the cache dtype, cuda
        _, slot_mapping = batch.kv_tables(window)
        write_kv(batch.kv_cache.k[layer_idx], batch.kv_cache.v[layer_idx], k, v, slot_mapping)
        return self.attend(layer_idx, q, batch, scale, window, sinks)

    def attend(
        self,
        layer_idx: int,
        q: torch.Tensor,
        batch: ForwardBatch,
        scale: float,
        window: int | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of q `[T, H, D]` over a cache that already holds this step's k/v (written
        by the caller, e.g. the fused qkv + rotary + KV-write decode kernel); `window` and
        `sinks` as in `AttentionBackend.forward` (the kernels read only the window's blocks)."""
        block_tables, _ = batch.kv_tables(window)
        if self.batch_invariant:
            return paged_extend(
                q,
                batch.kv_cache.k[layer_idx],
                batch.kv_cache.v[layer_idx],
                batch.query_start_loc,
                batch.seq_lens,
                block_tables,
                max(batch.max_query_len, 1),
                scale,
                window=window,
                sinks=sinks,
            )
        return paged_attention_cuda(
            q,
            batch.kv_cache.k[layer_idx],
            batch.kv_cache.v[layer_idx],
            batch.query_start_loc,
            batch.seq_lens,
            block_tables,
            batch.max_query_len,
            scale,
            max_seq_len=batch.max_seq_len or None,
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
        """Multi-head latent attention (see `AttentionBackend.mla`): q_latent `[T, H, L]`,
        q_rope `[T, H, R]` over latent_cache `[num_blocks, block_size, L + R]` that already
        holds this step's rows. One kernel (ext/cuda/mla.py) for every batch: a decode-only
        batch is one CTA row per sequence, split over the context; an extend row attends to
        its prefix up to its own position. Plans from `batch.max_seq_len` (an upper bound in
        a CUDA graph), never from device values."""
        # [T, H, L] and [T, H, R] in the cache dtype, cuda
        max_seq_len = batch.max_seq_len or batch.block_tables.shape[1] * latent_cache.shape[1]
        return mla_attention_cuda(
            q_latent,
            q_rope,
            latent_cache,
            batch.query_start_loc,
            batch.seq_lens,
            batch.block_tables,
            scale,
            max_seq_len=max_seq_len,
        )

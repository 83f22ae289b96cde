"""The `cupy` attention backend: ext/cuda's paged-attention kernels behind the backend interface.

Owns nothing but the call: the KV write and the attention go through `torch.ops.tandem.*`
custom ops, so torch.compile traces through them and CUDA graphs capture them. Every value the
launch planning needs is a host integer of `ForwardBatch` (`max_query_len`, `max_seq_len`);
no device value is read on the host. The torch backend (models/attention_backend.py) is the
reference it is tested against.
"""

from __future__ import annotations

import torch

from ext.cuda import is_available, paged_attention_cuda, write_kv
from ext.cuda.kernels import HEAD_DIMS
from models.batch import ForwardBatch

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)


def cupy_backend_supports(head_dim: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the kernels can serve a model of this head_dim and dtype on this device."""
    return (
        device.type == "cuda"
        and head_dim in HEAD_DIMS
        and dtype in SUPPORTED_DTYPES
        and is_available()
    )


class CupyAttentionBackend:
    """Decode-only batches (one token per sequence) take the split-K decode kernel, every other
    batch the extend kernel. `batch.max_seq_len` may be an upper bound of the real lengths (a
    CUDA graph captured once serves any shorter context)."""

    name = "cupy"

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
    ) -> torch.Tensor:
        # q [T, H, D], k/v [T, KVH, D] in the cache dtype, cuda
        write_kv(batch.kv_cache.k[layer_idx], batch.kv_cache.v[layer_idx], k, v, batch.slot_mapping)
        return self.attend(layer_idx, q, batch, scale)

    def attend(
        self, layer_idx: int, q: torch.Tensor, batch: ForwardBatch, scale: float
    ) -> torch.Tensor:
        """Attention of q `[T, H, D]` over a cache that already holds this step's k/v (written
        by the caller, e.g. the fused qkv + rotary + KV-write decode kernel)."""
        return paged_attention_cuda(
            q,
            batch.kv_cache.k[layer_idx],
            batch.kv_cache.v[layer_idx],
            batch.query_start_loc,
            batch.seq_lens,
            batch.block_tables,
            batch.max_query_len,
            scale,
            max_seq_len=batch.max_seq_len or None,
        )

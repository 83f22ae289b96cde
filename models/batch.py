"""The per-step input every model forward takes: one flattened, ragged batch.

`ForwardBatch` is built by the runtime's model runner and read by attention backends and
models. It carries no request objects: only tensors and a few host-side integers, so the
model layer knows nothing about scheduling (ARCHITECTURE.md, "The model forward contract").
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from tandem.models.config import ModelConfig


def zeros_on_demand(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str
) -> torch.Tensor:
    """torch.zeros, except that on the CPU the zeros are an anonymous mapping's untouched
    pages: memory becomes resident as blocks are first written, not at allocation (a 1 GiB
    CPU KV budget costs nothing until it holds tokens)."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = math.prod(shape) * itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    # the tensor holds a reference to the mapping: unmapped when the last view is freed
    raw = torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8)
    return raw.view(dtype).view(shape)


@dataclass
class KVCache:
    """Paged KV storage: per layer a K and a V tensor `[num_blocks, block_size, num_kv_heads, head_dim]`,
    or, for multi-head latent attention (DeepSeek), one `latent` tensor
    `[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]` (k and v empty).
    `window_layers`: the windowed layers of a model that also has full ones (GPT-OSS); their
    tensors hold `num_window_blocks` blocks of their own block-id space (the window pool).

    `slot = block_id * block_size + offset`. Allocated once by the runner; addresses never move
    (CUDA graphs capture them).
    """

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    block_size: int
    latent: list[torch.Tensor] = field(default_factory=list)
    window_layers: tuple[int, ...] = ()

    @classmethod
    def for_model(
        cls,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
        tp_size: int = 1,
        num_window_blocks: int = 0,
    ) -> KVCache:
        """The layout `config` needs: latent rows for MLA models, K and V otherwise (under
        tensor parallelism this rank's KV heads, at least one). `num_window_blocks` > 0: the
        layers of `config.window_group_layers` get that many blocks instead."""
        if config.is_mla:
            shape = (num_blocks, block_size, config.latent_dim)
            latent = [
                zeros_on_demand(shape, dtype, device) for _ in range(config.num_hidden_layers)
            ]
            return cls(k=[], v=[], block_size=block_size, latent=latent)
        window_layers = config.window_group_layers if num_window_blocks > 0 else ()
        kvh = max(config.num_key_value_heads // tp_size, 1)
        k, v = [], []
        for layer in range(config.num_hidden_layers):
            n = num_window_blocks if layer in window_layers else num_blocks
            shape = (n, block_size, kvh, config.head_dim)
            k.append(zeros_on_demand(shape, dtype, device))
            v.append(zeros_on_demand(shape, dtype, device))
        return cls(k=k, v=v, block_size=block_size, window_layers=window_layers)

    @staticmethod
    def bytes_per_block_for(
        config: ModelConfig,
        block_size: int,
        dtype: torch.dtype,
        tp_size: int = 1,
        num_layers: int | None = None,
    ) -> int:
        """Bytes one block takes over all layers (or `num_layers` of them) in the layout
        `for_model` allocates."""
        layers = config.num_hidden_layers if num_layers is None else num_layers
        if config.is_mla:
            itemsize = torch.empty((), dtype=dtype).element_size()
            return layers * block_size * config.latent_dim * itemsize
        return KVCache.bytes_per_block(
            layers, block_size, max(config.num_key_value_heads // tp_size, 1),
            config.head_dim, dtype,
        )  # fmt: skip

    @property
    def tensors(self) -> list[torch.Tensor]:
        """Every storage tensor (K, V and latent)."""
        return self.k + self.v + self.latent

    @classmethod
    def allocate(
        cls,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> KVCache:
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        k = [zeros_on_demand(shape, dtype, device) for _ in range(num_layers)]
        v = [zeros_on_demand(shape, dtype, device) for _ in range(num_layers)]
        return cls(k=k, v=v, block_size=block_size)

    @property
    def num_blocks(self) -> int:
        """Blocks of the main pool (what every layer outside `window_layers` holds)."""
        tensors = self.k or self.latent
        for layer, t in enumerate(tensors):
            if layer not in self.window_layers:
                return t.shape[0]
        return 0

    @staticmethod
    def bytes_per_block(
        num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * block_size * num_kv_heads * head_dim * itemsize


@dataclass
class ForwardBatch:
    """Metadata of one flattened batch of `num_tokens` tokens from `num_seqs` sequences.

    Sequence i owns tokens `query_start_loc[i]:query_start_loc[i+1]` of `input_ids`; they sit
    at positions `seq_lens[i] - query_lens[i] .. seq_lens[i] - 1` of that sequence, and each
    attends causally to the sequence's whole paged KV up to and including itself.
    Device tensors are on the model's device; `*_cpu` lists are host copies of the same values
    (the torch backend and the runner use them to avoid device syncs).
    """

    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32: KV length after this step's tokens are written
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32, padded with 0
    slot_mapping: torch.Tensor  # [num_tokens] int64: KV slot each new token writes
    logits_indices: torch.Tensor  # [num_logits] int64: rows of the hidden states to return
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    kv_cache: KVCache
    max_query_len: int = 0
    max_seq_len: int = 0
    # Backend-specific, prepared once per step by `AttentionBackend.prepare` (e.g. split-K plan).
    attn_metadata: object | None = None
    # The windowed layers' own block tables and KV slots where the cache has `window_layers`
    # (same shapes as block_tables / slot_mapping, ids of the window pool); None: one pool.
    window_block_tables: torch.Tensor | None = None
    window_slot_mapping: torch.Tensor | None = None
    window_attn_metadata: object | None = None
    extras: dict = field(default_factory=dict)

    def kv_tables(self, window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(block_tables, slot_mapping) of a layer with sliding `window` (None: full)."""
        if window is not None and self.window_block_tables is not None:
            assert self.window_slot_mapping is not None
            return self.window_block_tables, self.window_slot_mapping
        return self.block_tables, self.slot_mapping

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(sum(self.query_lens_cpu))

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len <= 1

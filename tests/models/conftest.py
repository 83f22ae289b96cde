"""A mini model runner for model tests: owns a paged KVCache with shuffled block ids, tracks
each sequence's block table and computed-token count, and builds the `ForwardBatch` of a step
from (sequence id, tokens to run) pairs. Exposed to tests through the `paged_runner` fixture.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch

from tandem.models.batch import ForwardBatch, KVCache
from tandem.models.config import ModelConfig


class PagedRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        config: ModelConfig,
        *,
        block_size: int,
        num_blocks: int = 64,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
        device: str = "cpu",
    ) -> None:
        self.model = model
        self.device = device
        self.block_size = block_size
        self.kv_cache = KVCache.for_model(config, num_blocks, block_size, dtype, device)
        self.free_blocks = list(range(num_blocks))
        random.Random(seed).shuffle(self.free_blocks)  # non-contiguous, unordered block ids
        self.block_tables: dict[int, list[int]] = {}
        self.num_computed: dict[int, int] = {}

    def build_batch(
        self, work: list[tuple[int, list[int]]]
    ) -> tuple[torch.Tensor, torch.Tensor, ForwardBatch]:
        """work: (seq_id, new tokens) per sequence -> input_ids, positions, ForwardBatch.

        Every token gets a logits row (logits_indices covers the whole batch).
        """
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        for seq_id, tokens in work:
            start = self.num_computed.get(seq_id, 0)
            end = start + len(tokens)
            table = self.block_tables.setdefault(seq_id, [])
            while len(table) * self.block_size < end:
                table.append(self.free_blocks.pop())
            for pos in range(start, end):
                slots.append(
                    table[pos // self.block_size] * self.block_size + pos % self.block_size
                )
            input_ids += tokens
            positions += range(start, end)
            query_lens.append(len(tokens))
            seq_lens.append(end)
            tables.append(list(table))
            self.num_computed[seq_id] = end
        max_blocks = max(len(t) for t in tables)
        block_tables = torch.zeros(len(tables), max_blocks, dtype=torch.int32)
        for i, t in enumerate(tables):
            block_tables[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
        qsl = torch.zeros(len(work) + 1, dtype=torch.int32)
        qsl[1:] = torch.cumsum(torch.tensor(query_lens), 0)
        dev = self.device
        batch = ForwardBatch(
            query_start_loc=qsl.to(dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=block_tables.to(dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            logits_indices=torch.arange(len(input_ids), dtype=torch.int64, device=dev),
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
            kv_cache=self.kv_cache,
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
        )
        ids = torch.tensor(input_ids, dtype=torch.int64, device=dev)
        return ids, torch.tensor(positions, dtype=torch.int64, device=dev), batch

    @torch.no_grad()
    def step(self, work: list[tuple[int, list[int]]]) -> dict[int, torch.Tensor]:
        """Run one mixed step; returns per sequence its logits `[len(tokens), vocab]` float32."""
        ids, positions, batch = self.build_batch(work)
        logits = self.model.compute_logits(self.model(ids, positions, batch))
        out: dict[int, torch.Tensor] = {}
        row = 0
        for seq_id, tokens in work:
            out[seq_id] = logits[row : row + len(tokens)]
            row += len(tokens)
        return out


@pytest.fixture
def paged_runner() -> Callable[..., PagedRunner]:
    return PagedRunner

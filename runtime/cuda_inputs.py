"""Input staging for the CUDA runner: one step's `SchedulerOutput` into pinned host buffers,
copied non-blocking into static device buffers on the runner's stream.

Owns the host and device input buffers and the padding of a decode batch to its graph bucket.
Does not run the model or decide buckets (the caller passes `bucket`), and reads no token
in flight: such an input is written as the placeholder the caller's `placeholder` returns.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from tandem.models.batch import ForwardBatch, KVCache
from tandem.runtime.types import SchedulerOutput


@dataclass
class StepBuffers:
    """Host (pinned) or device buffers of one step's inputs, sized for the largest step."""

    input_ids: torch.Tensor  # [max_tokens] int64
    positions: torch.Tensor  # [max_tokens] int64
    slot_mapping: torch.Tensor  # [max_tokens] int64
    logits_indices: torch.Tensor  # [max_seqs] int64
    query_start_loc: torch.Tensor  # [max_seqs + 1] int32
    seq_lens: torch.Tensor  # [max_seqs] int32
    block_tables: torch.Tensor  # [max_seqs, max_blocks] int32
    # the window pool's (a cache with window_layers), else None
    window_block_tables: torch.Tensor | None = None  # [max_seqs, max_blocks] int32
    window_slot_mapping: torch.Tensor | None = None  # [max_tokens] int64

    @classmethod
    def allocate(
        cls,
        max_tokens: int,
        max_seqs: int,
        max_blocks: int,
        device: torch.device | None,
        windowed: bool = False,
    ) -> StepBuffers:
        kw = {"device": device} if device is not None else {"pin_memory": True}
        window = {}
        if windowed:
            window = dict(
                window_block_tables=torch.zeros(max_seqs, max_blocks, dtype=torch.int32, **kw),
                window_slot_mapping=torch.full((max_tokens,), -1, dtype=torch.int64, **kw),
            )
        return cls(
            **window,
            input_ids=torch.zeros(max_tokens, dtype=torch.int64, **kw),
            positions=torch.zeros(max_tokens, dtype=torch.int64, **kw),
            slot_mapping=torch.full((max_tokens,), -1, dtype=torch.int64, **kw),
            logits_indices=torch.zeros(max_seqs, dtype=torch.int64, **kw),
            query_start_loc=torch.zeros(max_seqs + 1, dtype=torch.int32, **kw),
            seq_lens=torch.zeros(max_seqs, dtype=torch.int32, **kw),
            block_tables=torch.zeros(max_seqs, max_blocks, dtype=torch.int32, **kw),
        )


@dataclass
class PreparedStep:
    """One step's inputs, already enqueued to the device."""

    num_tokens: int  # padded to the graph bucket when `graph_bs` is set
    num_seqs: int
    num_logits: int
    graph_bs: int | None
    max_query_len: int
    max_seq_len: int
    query_lens: list[int]
    seq_lens: list[int]
    has_placeholders: bool = False

    @property
    def is_decode(self) -> bool:
        """One token per sequence and every sequence samples: what a decode graph runs."""
        return self.max_query_len == 1 and self.num_logits == self.num_seqs


class InputStager:
    def __init__(
        self,
        device: torch.device,
        block_size: int,
        max_tokens: int,
        max_seqs: int,
        max_blocks: int,
        windowed: bool = False,
    ) -> None:
        """`windowed`: also stage the window pool's tables (`Request.window_block_ids`)."""
        self.block_size = block_size
        self.windowed = windowed
        self._host = [
            StepBuffers.allocate(max_tokens, max_seqs, max_blocks, None, windowed) for _ in (0, 1)
        ]
        # Recorded after each host buffer's copies: the host refills a buffer only once its
        # copies ran (it waits only if the device is two steps behind, e.g. prefill chunks
        # that sample nothing, so nobody waited for their step).
        self._copied = [torch.cuda.Event(), torch.cuda.Event()]
        self._turn = 0
        self.dev = StepBuffers.allocate(max_tokens, max_seqs, max_blocks, device, windowed)

    def prepare(
        self,
        sched: SchedulerOutput,
        placeholder: Callable[[str], int],
        bucket: Callable[[int], int | None],
    ) -> PreparedStep:
        """Fill the next pinned buffers from `sched` and enqueue their copies on the current
        stream. A decode input not yet known on the host is `placeholder(request_id)`; a
        decode batch is padded to `bucket(num_seqs)` when that is not None."""
        turn = self._turn
        self._turn ^= 1
        if not self._copied[turn].query():
            self._copied[turn].synchronize()
        h = self._host[turn]
        bs = self.block_size
        ids_h, pos_h, slot_h = h.input_ids.numpy(), h.positions.numpy(), h.slot_mapping.numpy()
        qsl_h, sl_h, bt_h = h.query_start_loc.numpy(), h.seq_lens.numpy(), h.block_tables.numpy()
        li_h = h.logits_indices.numpy()
        if self.windowed:
            assert h.window_slot_mapping is not None and h.window_block_tables is not None
            wslot_h, wbt_h = h.window_slot_mapping.numpy(), h.window_block_tables.numpy()
        query_lens: list[int] = []
        seq_lens: list[int] = []
        t = 0
        num_logits = 0
        has_placeholders = False
        for i, s in enumerate(sched.seqs):
            req = s.request
            start, end, n = s.start_pos, s.start_pos + s.num_tokens, s.num_tokens
            nb = -(-end // bs)
            block_ids = req.block_ids
            if n == 1:  # decode: scalar writes beat numpy temporaries
                if start < len(req.token_ids):
                    ids_h[t] = req.token_ids[start]
                else:  # overlap: the token the step in flight samples, read on the device
                    ids_h[t] = placeholder(req.request_id)
                    has_placeholders = True
                pos_h[t] = start
                slot_h[t] = block_ids[start // bs] * bs + start % bs
                bt_h[i, :nb] = block_ids[:nb]
                if self.windowed:
                    wids = req.window_block_ids
                    wslot_h[t] = wids[start // bs] * bs + start % bs
                    wbt_h[i, :nb] = wids[:nb]
            else:
                assert end <= len(req.token_ids), "a placeholder in a multi-token chunk"
                ids_h[t : t + n] = req.token_ids[start:end]
                pos = np.arange(start, end, dtype=np.int64)
                pos_h[t : t + n] = pos
                blocks = np.asarray(block_ids[:nb], dtype=np.int64)
                slot_h[t : t + n] = blocks[pos // bs] * bs + pos % bs
                bt_h[i, :nb] = blocks
                if self.windowed:
                    wblocks = np.asarray(req.window_block_ids[:nb], dtype=np.int64)
                    wslot_h[t : t + n] = wblocks[pos // bs] * bs + pos % bs
                    wbt_h[i, :nb] = wblocks
            qsl_h[i] = t
            sl_h[i] = end
            t += n
            query_lens.append(n)
            seq_lens.append(end)
            if s.sample:
                li_h[num_logits] = t - 1
                num_logits += 1
        num_seqs = len(sched.seqs)
        qsl_h[num_seqs] = t
        max_query_len = max(query_lens)
        graph_bs = None
        if max_query_len == 1 and num_logits == num_seqs:
            graph_bs = bucket(num_seqs)
        rows, tokens = num_seqs, t
        if graph_bs is not None:
            # Pad to the bucket with inert rows: no KV write (slot -1), no KV read (len 0).
            ids_h[t:graph_bs] = 0
            pos_h[t:graph_bs] = 0
            slot_h[t:graph_bs] = -1
            if self.windowed:
                wslot_h[t:graph_bs] = -1
            sl_h[num_seqs:graph_bs] = 0
            qsl_h[num_seqs + 1 : graph_bs + 1] = np.arange(t + 1, graph_bs + 1)
            rows = tokens = graph_bs
        d = self.dev
        d.input_ids[:tokens].copy_(h.input_ids[:tokens], non_blocking=True)
        d.positions[:tokens].copy_(h.positions[:tokens], non_blocking=True)
        d.slot_mapping[:tokens].copy_(h.slot_mapping[:tokens], non_blocking=True)
        d.query_start_loc[: rows + 1].copy_(h.query_start_loc[: rows + 1], non_blocking=True)
        d.seq_lens[:rows].copy_(h.seq_lens[:rows], non_blocking=True)
        # Graph buckets read rows of the full-width table; eager steps a narrow copy.
        d.block_tables[:num_seqs].copy_(h.block_tables[:num_seqs], non_blocking=True)
        if self.windowed:
            assert d.window_slot_mapping is not None and d.window_block_tables is not None
            d.window_slot_mapping[:tokens].copy_(h.window_slot_mapping[:tokens], non_blocking=True)
            d.window_block_tables[:num_seqs].copy_(
                h.window_block_tables[:num_seqs], non_blocking=True
            )
        if graph_bs is None:
            d.logits_indices[:num_logits].copy_(h.logits_indices[:num_logits], non_blocking=True)
        self._copied[turn].record()
        return PreparedStep(
            num_tokens=tokens,
            num_seqs=num_seqs,
            num_logits=num_logits,
            graph_bs=graph_bs,
            max_query_len=max_query_len,
            max_seq_len=max(seq_lens),
            query_lens=query_lens,
            seq_lens=seq_lens,
            has_placeholders=has_placeholders,
        )

    def eager_batch(self, p: PreparedStep, kv_cache: KVCache) -> ForwardBatch:
        """The `ForwardBatch` of a step that runs without a graph."""
        d = self.dev
        return ForwardBatch(
            query_start_loc=d.query_start_loc[: p.num_seqs + 1],
            seq_lens=d.seq_lens[: p.num_seqs],
            block_tables=d.block_tables[: p.num_seqs],
            slot_mapping=d.slot_mapping[: p.num_tokens],
            logits_indices=d.logits_indices[: p.num_logits],
            query_lens_cpu=p.query_lens,
            seq_lens_cpu=p.seq_lens,
            kv_cache=kv_cache,
            max_query_len=p.max_query_len,
            max_seq_len=p.max_seq_len,
            window_block_tables=(
                None if d.window_block_tables is None else d.window_block_tables[: p.num_seqs]
            ),
            window_slot_mapping=(
                None if d.window_slot_mapping is None else d.window_slot_mapping[: p.num_tokens]
            ),
        )

    def last_input_ids(self, p: PreparedStep) -> torch.Tensor:
        """`[num_logits]` int64, device: each sampling sequence's last input id, placeholders
        resolved once the forward is enqueued (the token in flight, for the sampler)."""
        d = self.dev
        if p.graph_bs is not None:  # one token per row, every row samples
            return d.input_ids[: p.num_logits]
        return d.input_ids.index_select(0, d.logits_indices[: p.num_logits])

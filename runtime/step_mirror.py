"""The CUDA runner's tensor-parallel link: rank 0 mirrors each step's staged device inputs
(`runtime.cuda_inputs.StepBuffers`) into every other rank's own buffers with two broadcasts
(a fixed-size header, then one packed int64 payload), enqueued on the runner's stream, so
rank 0 never waits on the host; the other ranks then run the same graph replay or eager
forward. Knows nothing of scheduling, sampling or the model.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from tandem.runtime.cuda_inputs import PreparedStep, StepBuffers

STOP, STEP = 0, 1
_FIXED = 8  # cmd, tokens, seqs, logits, graph bs (0: eager), max query len, max seq len, width


class StepMirror:
    """One rank's end of the link. `max_seqs` and `block_size` must equal on every rank."""

    def __init__(
        self, group: Any, rank: int, max_seqs: int, block_size: int, device: torch.device
    ) -> None:
        self.group = group
        self.rank = rank
        self.max_seqs = max_seqs
        self.block_size = block_size
        self.device = device
        self.header_len = _FIXED + 2 * max_seqs
        pin = device.type == "cuda"
        # two host headers: one may still be waiting for its copy while the next is filled
        self._host = [
            torch.zeros(self.header_len, dtype=torch.int64, pin_memory=pin) for _ in (0, 1)
        ]
        self._copied = [torch.cuda.Event() if pin else None for _ in (0, 1)]
        self._turn = 0
        self._header = torch.zeros(self.header_len, dtype=torch.int64, device=device)
        self.num_sent = 0

    # -- layout -------------------------------------------------------------------------------

    def _parts(self, head: list[int], d: StepBuffers) -> list[torch.Tensor]:
        """The device buffer slices a step with header `head` reads, in payload order."""
        _, tokens, seqs, logits, graph_bs, _, _, width = head[:_FIXED]
        rows = graph_bs or seqs
        parts = [
            d.input_ids[:tokens],
            d.positions[:tokens],
            d.slot_mapping[:tokens],
            d.query_start_loc[: rows + 1],
            d.seq_lens[:rows],
            d.block_tables[:seqs, :width],
        ]
        if not graph_bs:
            parts.append(d.logits_indices[:logits])
        if d.window_slot_mapping is not None and d.window_block_tables is not None:
            parts += [d.window_slot_mapping[:tokens], d.window_block_tables[:seqs, :width]]
        return parts

    def header(self, p: PreparedStep) -> list[int]:
        width = -(-p.max_seq_len // self.block_size)
        pad = [0] * (self.max_seqs - p.num_seqs)
        return [
            STEP, p.num_tokens, p.num_seqs, p.num_logits, p.graph_bs or 0, p.max_query_len,
            p.max_seq_len, width, *p.query_lens, *pad, *p.seq_lens, *pad,
        ]  # fmt: skip

    # -- rank 0 -------------------------------------------------------------------------------

    def send(self, p: PreparedStep, d: StepBuffers) -> None:
        """Enqueue the step's header and inputs (placeholders already resolved) on the current
        stream; returns without waiting for the device."""
        head = self.header(p)
        turn = self._turn
        self._turn ^= 1
        event = self._copied[turn]
        if event is not None and not event.query():
            event.synchronize()
        host = self._host[turn]
        host.copy_(torch.tensor(head, dtype=torch.int64))
        self._header.copy_(host, non_blocking=True)
        if event is not None:
            event.record()
        dist.broadcast(self._header, 0, group=self.group)
        payload = torch.cat([t.reshape(-1).long() for t in self._parts(head, d)])
        dist.broadcast(payload, 0, group=self.group)
        self.num_sent += 1

    def stop_header(self) -> torch.Tensor:
        """The header that ends the other ranks' loops (rank 0, at close)."""
        return torch.zeros(self.header_len, dtype=torch.int64, device=self.device)

    # -- other ranks --------------------------------------------------------------------------

    def receive(self, d: StepBuffers) -> PreparedStep | None:
        """Wait for rank 0's next step and write its inputs into `d` (on the current
        stream) -> the step, or None on STOP."""
        dist.broadcast(self._header, 0, group=self.group)
        head = self._header.tolist()
        if head[0] == STOP:
            return None
        _, tokens, seqs, logits, graph_bs, max_q, max_len, _ = head[:_FIXED]
        parts = self._parts(head, d)
        payload = torch.empty(sum(t.numel() for t in parts), dtype=torch.int64, device=self.device)
        dist.broadcast(payload, 0, group=self.group)
        for dst, src in zip(parts, payload.split([t.numel() for t in parts]), strict=True):
            dst.copy_(src.view(dst.shape))
        lens = head[_FIXED:]
        return PreparedStep(
            num_tokens=tokens,
            num_seqs=seqs,
            num_logits=logits,
            graph_bs=graph_bs or None,
            max_query_len=max_q,
            max_seq_len=max_len,
            query_lens=lens[:seqs],
            seq_lens=lens[self.max_seqs : self.max_seqs + seqs],
        )

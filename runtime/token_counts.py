"""Per-request token state on the device for repetition, presence and frequency penalties.

Owns two `[num_slots, vocab]` device tensors (allocated at first use): the count of each
output token (int32) and whether a token occurs in the prompt (bool). A request holds one row
(slot) while it lives; slots are reused least-recently-used first, and a request whose slot
was taken is rebuilt from its host token list when it samples again. The host tracks how many
output tokens each row has counted, so no value is ever read back: the tokens the host knows
are staged as indices, and the one token still in flight (overlap) is added on the device from
that step's resolved input id. Knows nothing of sampling parameters or logits.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class _Slot:
    index: int
    counted: int = 0  # output tokens this row has counted on the device


@dataclass
class CountsPlan:
    """What one step does to the counts, as host lists (staged by the caller).

    `reset_slots` are zeroed first; `prompt_flat` (slot * vocab + token) set in the prompt
    mask; `count_flat` (slot * vocab + token, repeats allowed) each add one; `inflight_rows`
    (batch rows) add one at (their slot, that row's device input id)."""

    slots: list[int]  # per penalised row, in the order given
    reset_slots: list[int]
    prompt_flat: list[int]
    count_flat: list[int]
    inflight_rows: list[int]
    inflight_slots: list[int]


class TokenCounts:
    def __init__(self, device: torch.device, num_slots: int) -> None:
        self.device = device
        self.num_slots = num_slots
        self.vocab = 0
        self.counts: torch.Tensor | None = None  # [num_slots, vocab] int32, device
        self.in_prompt: torch.Tensor | None = None  # [num_slots, vocab] bool, device
        self._slots: OrderedDict[str, _Slot] = OrderedDict()  # least recently used first
        self._free = list(range(num_slots - 1, -1, -1))

    @staticmethod
    def bytes_needed(num_slots: int, vocab: int) -> int:
        return num_slots * vocab * 5

    def _ensure(self, vocab: int) -> None:
        if self.counts is not None:
            assert vocab == self.vocab, (vocab, self.vocab)
            return
        self.vocab = vocab
        shape = (self.num_slots, vocab)
        self.counts = torch.zeros(shape, dtype=torch.int32, device=self.device)
        self.in_prompt = torch.zeros(shape, dtype=torch.bool, device=self.device)

    def release(self, request_id: str) -> None:
        slot = self._slots.pop(request_id, None)
        if slot is not None:
            self._free.append(slot.index)

    def plan(
        self,
        vocab: int,
        keys: Sequence[str | None],
        token_ids: Sequence[Sequence[int]],
        num_prompt_tokens: Sequence[int],
        num_output_tokens: Sequence[int],
        rows: Sequence[int],
    ) -> CountsPlan:
        """Bring the rows of `keys` (request ids; None: a row for this call only) up to date:
        each must count the first `num_output_tokens[i]` output tokens. The host knows those
        in `token_ids[i]` after its prompt; one more than that is the token in flight, the
        step's input at batch row `rows[i]`. Host work is O(new tokens), O(prompt) on reset."""
        self._ensure(vocab)
        assert len(keys) <= self.num_slots, (len(keys), self.num_slots)
        for key in keys:  # touched first: what eviction takes is never in this batch
            if key is not None and key in self._slots:
                self._slots.move_to_end(key)
        plan = CountsPlan([], [], [], [], [], [])
        temporary: list[int] = []
        for key, toks, n_prompt, n_out, row in zip(
            keys, token_ids, num_prompt_tokens, num_output_tokens, rows, strict=True
        ):
            slot = self._slots.get(key) if key is not None else None
            if slot is None:
                slot = _Slot(self._take_slot(), counted=-1)
                if key is None:
                    temporary.append(slot.index)
                else:
                    self._slots[key] = slot
            s = slot.index
            if slot.counted < 0 or slot.counted > n_out:  # new, or out of step: rebuild
                plan.reset_slots.append(s)
                base = s * vocab
                plan.prompt_flat.extend(base + t for t in toks[:n_prompt] if 0 <= t < vocab)
                slot.counted = 0
            known = len(toks) - n_prompt
            if slot.counted < n_out:
                base = s * vocab
                new = toks[n_prompt + slot.counted : n_prompt + min(n_out, known)]
                plan.count_flat.extend(base + t for t in new)
                if n_out > known:  # the last one is in flight: this step's input id
                    assert n_out == known + 1, ("tokens in flight", key, n_out, known)
                    plan.inflight_rows.append(row)
                    plan.inflight_slots.append(s)
                slot.counted = n_out
            plan.slots.append(s)
        self._free.extend(temporary)  # stream order keeps the reuse safe
        return plan

    def _take_slot(self) -> int:
        if self._free:
            return self._free.pop()
        _, slot = self._slots.popitem(last=False)
        return slot.index

    def apply(
        self,
        plan: CountsPlan,
        reset_slots: torch.Tensor,
        prompt_flat: torch.Tensor,
        count_flat: torch.Tensor,
        inflight_rows: torch.Tensor,
        inflight_slots: torch.Tensor,
        last_ids: torch.Tensor | None,
    ) -> None:
        """Enqueue the plan's updates; the tensors are its lists staged on the device (int64).
        last_ids `[n]` int64: each batch row's last input id (the token in flight)."""
        assert self.counts is not None and self.in_prompt is not None
        counts, in_prompt = self.counts, self.in_prompt
        if plan.reset_slots:
            counts.index_fill_(0, reset_slots, 0)
            in_prompt.index_fill_(0, reset_slots, False)
        if plan.prompt_flat:
            in_prompt.view(-1).index_fill_(0, prompt_flat, True)
        if plan.count_flat:  # scatter_add: repeats add up, and no sort (nor sync) on CUDA
            ones = torch.ones(count_flat.shape, dtype=torch.int32, device=self.device)
            counts.view(-1).scatter_add_(0, count_flat, ones)
        if plan.inflight_rows:
            assert last_ids is not None, "a token in flight needs the step's input ids"
            flat = inflight_slots * self.vocab + last_ids.index_select(0, inflight_rows)
            ones = torch.ones(flat.shape, dtype=torch.int32, device=self.device)
            counts.view(-1).scatter_add_(0, flat, ones)

    def rows(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """slots `[p]` int64 -> (counts `[p, vocab]` int32, seen `[p, vocab]` bool), where seen
        is prompt or output membership (the repetition penalty's set)."""
        assert self.counts is not None and self.in_prompt is not None
        counts = self.counts.index_select(0, slots)
        seen = self.in_prompt.index_select(0, slots) | (counts > 0)
        return counts, seen

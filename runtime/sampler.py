"""Batched token sampling: penalties, temperature, top-k, top-p, min-p, per-request seeds.

Vectorized over the batch; the only per-row work is drawing noise for rows that carry their
own seed (each seeded request owns a `torch.Generator`, so its samples do not depend on what
else is in the batch). Sampling uses the exponential race: argmax(p / E) with E ~ Exp(1) draws
a token with probability p, which lets seeded and unseeded rows share one code path.

A row whose own work fails (its logits are NaN or +inf, or every token is banned, or its
per-row processing raises) gets the id `FAILED_ROW` and the others sample as usual: the engine
then fails that request alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tandem.runtime.sampling_params import SamplingParams
from tandem.runtime.types import SamplerOutput, TokenLogprob

if TYPE_CHECKING:
    from tandem.runtime.grammar import GrammarMatcher

FAILED_ROW = -1  # the id of a row that could not be sampled


@dataclass
class SampleRow:
    """What the sampler needs of one sequence."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None
    eos_token_ids: tuple[int, ...] = ()
    grammar: GrammarMatcher | None = None  # constrained: only tokens it allows are sampled


def _edits_logits(row: SampleRow) -> bool:
    """Whether a logits processor changes this row (penalties, min_tokens, bias, grammar)."""
    p = row.params
    return (
        p.has_penalties
        or len(row.output_token_ids) < p.min_tokens
        or bool(p.logit_bias)
        or row.grammar is not None
    )


class Sampler:
    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, rows: list[SampleRow]) -> SamplerOutput:
        # logits: [N, V] float32 on self.device, one row per entry of `rows`
        n, vocab = logits.shape
        assert n == len(rows), (n, len(rows))
        try:
            return self._sample(logits, rows)
        except Exception:
            if n == 1:
                raise
        # Something in the batched work failed: sample each row alone, so that only the rows
        # that fail by themselves fail.
        outs = []
        for i, row in enumerate(rows):
            try:
                outs.append(self._sample(logits[i : i + 1], [row]))
            except Exception:
                outs.append(None)
        ids = [FAILED_ROW if o is None else o.token_ids[0] for o in outs]
        logprobs = None
        if any(r.params.logprobs for r in rows):
            logprobs = [
                TokenLogprob(FAILED_ROW, float("nan"))
                if o is None or o.logprobs is None
                else o.logprobs[0]
                for o in outs
            ]
        return SamplerOutput(token_ids=ids, logprobs=logprobs)

    def _sample(self, logits: torch.Tensor, rows: list[SampleRow]) -> SamplerOutput:
        n, vocab = logits.shape
        raw_logits = logits
        failed: set[int] = set()
        if any(_edits_logits(r) for r in rows):  # else the processors below are no-ops
            logits = logits.clone()
            self._apply_penalties(logits, rows, failed)
            self._apply_min_tokens(logits, rows)
            self._apply_logit_bias(logits, rows)
            self._apply_grammar(logits, rows)
        # NaN or +inf anywhere, or no token left (every one -inf): nothing this row could
        # sample is meaningful. max propagates NaN, so one pass over the row tells all three.
        greedy_all = all(r.params.greedy for r in rows)
        if greedy_all:
            row_max, token_ids = logits.max(dim=-1)
        else:
            row_max = logits.amax(dim=-1)
        bad = ~torch.isfinite(row_max)

        greedy = torch.tensor([r.params.greedy for r in rows], device=self.device)
        temps = torch.tensor(
            [1.0 if r.params.greedy else r.params.temperature for r in rows],
            dtype=torch.float32,
            device=self.device,
        )
        if not greedy_all:
            scaled = logits / temps.unsqueeze(1)
            self._apply_top_k_top_p_min_p(scaled, rows)
            probs = torch.softmax(scaled, dim=-1)
            noise = self._exponential_noise(rows, vocab, failed)
            sampled = (probs / noise).argmax(dim=-1)
            token_ids = torch.where(greedy, logits.argmax(dim=-1), sampled)

        ids = token_ids.tolist()
        for i in failed.union(bad.nonzero().flatten().tolist()):
            ids[i] = FAILED_ROW
        logprobs = None
        if any(r.params.logprobs for r in rows):
            logprobs = self._logprobs(raw_logits, ids, rows)
        return SamplerOutput(token_ids=ids, logprobs=logprobs)

    # -- logits processors (in place) ------------------------------------------------------

    def _apply_penalties(
        self, logits: torch.Tensor, rows: list[SampleRow], failed: set[int]
    ) -> None:
        for i, r in enumerate(rows):
            if r.params.has_penalties:
                try:
                    self._penalize_row(logits, i, r)
                except Exception:
                    failed.add(i)

    def _penalize_row(self, logits: torch.Tensor, i: int, r: SampleRow) -> None:
        # rows with penalties are few; each is vectorized over the vocabulary
        p, row, vocab = r.params, logits[i], logits.shape[1]
        out_ids = torch.tensor(r.output_token_ids, dtype=torch.long, device=self.device)
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(
                r.prompt_token_ids + r.output_token_ids, dtype=torch.long, device=self.device
            ).unique()
            vals = row[seen]
            row[seen] = torch.where(
                vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty
            )
        if out_ids.numel() and (p.presence_penalty or p.frequency_penalty):
            counts = torch.zeros(vocab, dtype=torch.float32, device=self.device)
            counts.index_add_(0, out_ids, torch.ones_like(out_ids, dtype=torch.float32))
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()

    def _apply_min_tokens(self, logits: torch.Tensor, rows: list[SampleRow]) -> None:
        for i, r in enumerate(rows):
            p = r.params
            if len(r.output_token_ids) < p.min_tokens:
                banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(r.eos_token_ids))
                banned = [t for t in banned if 0 <= t < logits.shape[1]]
                if banned:
                    logits[i, banned] = float("-inf")

    def _apply_logit_bias(self, logits: torch.Tensor, rows: list[SampleRow]) -> None:
        for i, r in enumerate(rows):
            if r.params.logit_bias:
                ids, biases = zip(*r.params.logit_bias, strict=True)
                logits[i, list(ids)] += torch.tensor(biases, device=self.device)

    def _apply_grammar(self, logits: torch.Tensor, rows: list[SampleRow]) -> None:
        """One bitmask for the constrained rows; the other rows are not touched."""
        idx = [i for i, r in enumerate(rows) if r.grammar is not None]
        if not idx:
            return
        # imported only here: llguidance is needed only where a grammar is in use
        from tandem.runtime.grammar import apply_bitmask, fill_bitmask

        matchers = [rows[i].grammar for i in idx]
        bitmask = torch.empty(len(idx), matchers[0].mask_words, dtype=torch.int32)
        fill_bitmask(matchers, bitmask)  # type: ignore[arg-type]
        rows_t = None
        if len(idx) != len(rows):
            rows_t = torch.tensor(idx, dtype=torch.int64, device=self.device)
        apply_bitmask(logits, rows_t, bitmask.to(self.device))

    def _apply_top_k_top_p_min_p(self, logits: torch.Tensor, rows: list[SampleRow]) -> None:
        vocab = logits.shape[1]
        top_k = [r.params.top_k if 0 < r.params.top_k < vocab else vocab for r in rows]
        top_p = [r.params.top_p for r in rows]
        min_p = [r.params.min_p for r in rows]
        if any(k < vocab for k in top_k) or any(p < 1.0 for p in top_p):
            sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
            ranks = torch.arange(vocab, device=self.device).unsqueeze(0)
            k_t = torch.tensor(top_k, device=self.device).unsqueeze(1)
            mask = ranks >= k_t
            p_t = torch.tensor(top_p, dtype=torch.float32, device=self.device).unsqueeze(1)
            probs = torch.softmax(sorted_logits.masked_fill(mask, float("-inf")), dim=-1)
            # keep the smallest prefix whose mass reaches top_p (the first token always stays)
            mass_before = probs.cumsum(dim=-1) - probs
            mask |= mass_before >= p_t
            sorted_logits.masked_fill_(mask, float("-inf"))
            logits.scatter_(1, sorted_idx, sorted_logits)
        if any(m > 0.0 for m in min_p):
            probs = torch.softmax(logits, dim=-1)
            m_t = torch.tensor(min_p, dtype=torch.float32, device=self.device).unsqueeze(1)
            threshold = probs.max(dim=-1, keepdim=True).values * m_t
            logits.masked_fill_(probs < threshold, float("-inf"))

    def _exponential_noise(
        self, rows: list[SampleRow], vocab: int, failed: set[int] | None = None
    ) -> torch.Tensor:
        """`failed`: where a row's own generator raises, its index is added (None: raise)."""
        noise = torch.empty(len(rows), vocab, dtype=torch.float32, device=self.device)
        noise.exponential_()
        for i, r in enumerate(rows):
            if r.generator is not None:
                try:
                    noise[i].exponential_(generator=r.generator)
                except Exception:
                    if failed is None:
                        raise
                    failed.add(i)
        return noise.clamp_(min=1e-10)

    def _logprobs(
        self, raw_logits: torch.Tensor, ids: list[int], rows: list[SampleRow]
    ) -> list[TokenLogprob]:
        logp = torch.log_softmax(raw_logits.float(), dim=-1)
        index = torch.tensor(ids, device=self.device).clamp_(min=0).unsqueeze(1)
        chosen = logp.gather(1, index).squeeze(1)
        k_max = min(max(r.params.num_logprobs for r in rows), logp.shape[1])
        top_vals = top_ids = None
        if k_max > 0:
            top_vals, top_ids = logp.topk(k_max, dim=-1)
            top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
        chosen_l = chosen.tolist()
        out = []
        for i, r in enumerate(rows):
            k = r.params.num_logprobs
            top = tuple(zip(top_ids[i][:k], top_vals[i][:k], strict=True)) if k else ()
            out.append(TokenLogprob(token_id=ids[i], logprob=chosen_l[i], top=top))
        return out

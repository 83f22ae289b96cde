"""Sampling on the device without host syncs: the CUDA runner's sampler.

Same semantics as the reference `runtime.sampler.Sampler` (penalties, min_tokens bans, greedy,
temperature, top-k, top-p, min-p, seeds through the exponential race, logprobs), but every
per-row value reaches the device through a pinned host buffer and one non-blocking copy, and
nothing is read back: `sample_async` returns device tensors (the sampled ids, and with
logprobs one packed float64 tensor the caller copies back in one go). A row whose logits hold
NaN or +inf, or whose every token is banned, gets `FAILED_ROW` as its id, as in the reference:
the flag is folded into the ids the caller copies back anyway, from the row maxima that the
greedy argmax computes in the same pass. Penalties read
per-request token counts kept on the device (`runtime.token_counts`), so a row's history
includes the token still in flight under overlap scheduling. Plain torch: it runs on the CPU
too, which is how its parity with the reference is tested.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from tandem.runtime.sampler import FAILED_ROW, Sampler, SampleRow
from tandem.runtime.sampling_params import MAX_TOP_LOGPROBS, SamplingParams
from tandem.runtime.token_counts import TokenCounts
from tandem.runtime.types import SamplerOutput, TokenLogprob

if TYPE_CHECKING:
    from tandem.runtime.grammar import GrammarMatcher

# rows of the float32 parameter block staged each call
_TEMP, _TOP_K, _TOP_P, _MIN_P, _GREEDY, _REP, _PRES, _FREQ = range(8)
_NUM_PARAMS = 8
_RING = 2  # staging buffers in flight: one step's copy may still be pending
PACK_WIDTH = 2 + 2 * MAX_TOP_LOGPROBS  # widest packed row: id, logprob, top ids, top logprobs


@dataclass
class GpuRow:
    """What the device sampler needs of one sequence. Unlike `SampleRow` it does not copy the
    output list: `token_ids` is the request's own list (prompt, then the outputs the host has
    applied), and `num_output_tokens` counts the outputs before the token sampled now, which
    under overlap is one more than the host has applied (that one is still in flight)."""

    params: SamplingParams
    token_ids: Sequence[int]
    num_prompt_tokens: int
    num_output_tokens: int
    generator: torch.Generator | None = None
    eos_token_ids: tuple[int, ...] = ()
    request_id: str | None = None  # keys the device token counts; None: built for this call
    grammar: GrammarMatcher | None = None  # has taken every token before the one sampled now

    @classmethod
    def from_sample_row(cls, row: SampleRow, request_id: str | None = None) -> GpuRow:
        return cls(
            params=row.params,
            token_ids=row.prompt_token_ids + row.output_token_ids,
            num_prompt_tokens=len(row.prompt_token_ids),
            num_output_tokens=len(row.output_token_ids),
            generator=row.generator,
            eos_token_ids=row.eos_token_ids,
            request_id=request_id,
            grammar=row.grammar,
        )


@dataclass
class DeviceSample:
    """A sampled step, still on the device. Copy `host_source` back (one copy) and pass the
    host copy to `output`. `token_ids` holds `FAILED_ROW` for the rows that failed: clamp it
    before it feeds a forward."""

    token_ids: torch.Tensor  # [n] int64, device
    packed: torch.Tensor | None = None  # [n, 2 + 2k] float64, device: id, logprob, k ids, k lps
    num_top: tuple[int, ...] = ()  # per row: top entries its request asked for

    @property
    def host_source(self) -> torch.Tensor:
        return self.token_ids if self.packed is None else self.packed

    def output(self, host: torch.Tensor) -> SamplerOutput:
        """host: a CPU copy of `host_source` -> the step's ids (and logprobs)."""
        if self.packed is None:
            return SamplerOutput(token_ids=host.tolist())
        rows = host.tolist()
        k = (len(rows[0]) - 2) // 2 if rows else 0
        ids, logprobs = [], []
        for row, n_top in zip(rows, self.num_top, strict=True):
            token = int(row[0])
            tops = zip(row[2 : 2 + n_top], row[2 + k : 2 + k + n_top], strict=True)
            top = tuple((int(t), lp) for t, lp in tops)
            ids.append(token)
            logprobs.append(TokenLogprob(token_id=token, logprob=row[1], top=top))
        return SamplerOutput(token_ids=ids, logprobs=logprobs)


class _Staging:
    """Pinned host buffers (a ring of `_RING`) and their device twins for one call's values: a
    float32 parameter block and one int64 arena holding every index list. An event per ring
    turn keeps the host from refilling a buffer whose copy has not run yet."""

    def __init__(self, device: torch.device, max_rows: int) -> None:
        self.device = device
        self._cuda = device.type == "cuda"
        self._params_host = [
            self._host_buf((_NUM_PARAMS, max_rows), torch.float32) for _ in range(_RING)
        ]
        cap = 8 * max_rows + 4096
        self._ints_host = [self._host_buf((cap,), torch.int64) for _ in range(_RING)]
        self.params = torch.empty(_NUM_PARAMS, max_rows, dtype=torch.float32, device=device)
        self._ints = torch.empty(cap, dtype=torch.int64, device=device)
        self._retired: list[torch.Tensor] = []  # outgrown device arenas (a copy may read one)
        self._events = [torch.cuda.Event() if self._cuda else None for _ in range(_RING)]
        self._turn = 0
        self._lists: list[list[int]] = []

    def _host_buf(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, pin_memory=self._cuda)

    def begin(self) -> np.ndarray:
        """Start a call -> the host parameter block `[8, max_rows]` float32 to fill."""
        ev = self._events[self._turn]
        if ev is not None and not ev.query():
            ev.synchronize()  # only when the device runs two calls behind the host
        self._lists = []
        return self._params_host[self._turn].numpy()

    def add(self, values: list[int]) -> int:
        """Queue an index list -> its handle for `ints`."""
        self._lists.append(values)
        return len(self._lists) - 1

    def commit(self, num_rows: int) -> list[torch.Tensor]:
        """Enqueue the copies on the current stream -> each queued list as a device tensor."""
        turn = self._turn
        self._turn = (turn + 1) % _RING
        sizes = [len(v) for v in self._lists]
        total = sum(sizes)
        if total > self._ints_host[turn].numel():
            cap = 1 << (total - 1).bit_length()
            self._ints_host[turn] = self._host_buf((cap,), torch.int64)
            if cap > self._ints.numel():
                self._retired.append(self._ints)
                self._ints = torch.empty(cap, dtype=torch.int64, device=self.device)
        host = self._ints_host[turn]
        if total:
            host.numpy()[:total] = np.fromiter(
                (x for v in self._lists for x in v), dtype=np.int64, count=total
            )
        self.params[:, :num_rows].copy_(
            self._params_host[turn][:, :num_rows], non_blocking=self._cuda
        )
        if total:
            self._ints[:total].copy_(host[:total], non_blocking=self._cuda)
        ev = self._events[turn]
        if ev is not None:
            ev.record()
        out, off = [], 0
        for n in sizes:
            out.append(self._ints[off : off + n])
            off += n
        return out


class CudaSampler(Sampler):
    def __init__(self, device: torch.device | str, max_num_seqs: int) -> None:
        super().__init__(device)
        self.max_num_seqs = max_num_seqs
        self._staging = _Staging(self.device, max_num_seqs)
        self.counts = TokenCounts(self.device, max_num_seqs)
        self._masks = _MaskStaging(self.device, max_num_seqs)

    def release(self, request_id: str) -> None:
        """Forget a request's device token counts (it finished or was aborted)."""
        self.counts.release(request_id)

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, rows: list[SampleRow]) -> SamplerOutput:
        """The reference interface, synchronously (tests and one-off use): reads back."""
        sample = self.sample_async(logits, [GpuRow.from_sample_row(r) for r in rows])
        return sample.output(sample.host_source.cpu())

    def sample_async(
        self,
        logits: torch.Tensor,
        rows: Sequence[GpuRow],
        last_ids: torch.Tensor | None = None,
    ) -> DeviceSample:
        """logits `[N, V]` float32 on the device, N == len(rows) -> the sampled step on the
        device, enqueued on the current stream; nothing is read back. last_ids `[N]` int64 on
        the device: each row's last input id, needed where a row's previous token is still in
        flight (`GpuRow.num_output_tokens` ahead of its token list) and it has penalties."""
        n, vocab = logits.shape
        assert n == len(rows) <= self.max_num_seqs, (n, len(rows))
        params = [r.params for r in rows]
        greedy = [p.greedy for p in params]
        pen = [i for i, p in enumerate(params) if p.has_penalties]
        bans = _min_tokens_bans(rows, vocab)  # flat indices row * vocab + token
        num_top = tuple(p.num_logprobs for p in params)
        want_logprobs = any(p.logprobs for p in params)
        biased = [i for i, p in enumerate(params) if p.logit_bias]
        constrained = [i for i, r in enumerate(rows) if r.grammar is not None]
        if constrained:  # the host builds the masks now, while the forward runs on the device
            grammar_mask = self._masks.stage(constrained, [rows[i].grammar for i in constrained], n)
        plain = not pen and not bans and not biased and not constrained
        if all(greedy) and plain:  # the plain greedy step: nothing to stage
            ids = _flag_failed(*logits.max(dim=-1))
            packed = _pack_logprobs(logits, ids, max(num_top)) if want_logprobs else None
            return DeviceSample(ids, packed, num_top if want_logprobs else ())

        hp = self._staging.begin()
        top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        hp[_TEMP, :n] = [1.0 if g else p.temperature for g, p in zip(greedy, params, strict=True)]
        hp[_TOP_K, :n] = top_k
        hp[_TOP_P, :n] = [p.top_p for p in params]
        hp[_MIN_P, :n] = [p.min_p for p in params]
        hp[_GREEDY, :n] = greedy
        hp[_REP, :n] = [p.repetition_penalty for p in params]
        hp[_PRES, :n] = [p.presence_penalty for p in params]
        hp[_FREQ, :n] = [p.frequency_penalty for p in params]
        st = self._staging
        plan = None
        if pen:
            pr = [rows[i] for i in pen]
            plan = self.counts.plan(
                vocab,
                [r.request_id for r in pr],
                [r.token_ids for r in pr],
                [r.num_prompt_tokens for r in pr],
                [r.num_output_tokens for r in pr],
                pen,
            )
            h_pen = st.add(pen)
            h_slots = st.add(plan.slots)
            h_plan = [
                st.add(v)
                for v in (
                    plan.reset_slots,
                    plan.prompt_flat,
                    plan.count_flat,
                    plan.inflight_rows,
                    plan.inflight_slots,
                )
            ]
        h_ban = st.add(bans) if bans else None
        h_bias = None
        if biased:
            flat = [i * vocab + t for i in biased for t, _ in params[i].logit_bias]
            # float32 bias bits ride in the int64 arena (no second staging buffer)
            bits = np.array([b for i in biased for _, b in params[i].logit_bias], np.float32)
            h_bias = (st.add(flat), st.add(bits.view(np.int32).astype(np.int64).tolist()))
        dev = st.commit(n)
        dp = st.params[:, :n]  # [8, n] float32, device

        raw = logits
        logits = logits.clone()
        if plan is not None:
            self.counts.apply(plan, *(dev[h] for h in h_plan), last_ids)
            pen_t = dev[h_pen]
            counts, seen = self.counts.rows(dev[h_slots])
            sub = logits.index_select(0, pen_t)
            rep = dp[_REP].index_select(0, pen_t).unsqueeze(1)
            sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
            freq = dp[_FREQ].index_select(0, pen_t).unsqueeze(1)
            pres = dp[_PRES].index_select(0, pen_t).unsqueeze(1)
            sub -= freq * counts.float() + pres * (counts > 0).float()
            logits.index_copy_(0, pen_t, sub)
        if h_ban is not None:
            logits.view(-1).index_fill_(0, dev[h_ban], float("-inf"))
        if h_bias is not None:
            bias = dev[h_bias[1]].to(torch.int32).view(torch.float32)
            logits.view(-1).index_add_(0, dev[h_bias[0]], bias)
        if constrained:
            from tandem.runtime.grammar import apply_bitmask

            apply_bitmask(logits, *grammar_mask)

        best, best_ids = logits.max(dim=-1)  # [n] each: NaN where a row holds NaN
        if all(greedy):
            ids = best_ids
        else:
            temp_t, k_t, p_t, m_t = (dp[i].unsqueeze(1) for i in (_TEMP, _TOP_K, _TOP_P, _MIN_P))
            scaled = logits / temp_t
            if any(k < vocab for k in top_k) or any(p.top_p < 1.0 for p in params):
                sorted_logits, sorted_idx = scaled.sort(dim=-1, descending=True)
                ranks = torch.arange(vocab, device=logits.device, dtype=torch.float32)
                mask = ranks.unsqueeze(0) >= k_t
                probs = torch.softmax(sorted_logits.masked_fill(mask, float("-inf")), dim=-1)
                # keep the smallest prefix whose mass reaches top_p (the first token always stays)
                mask |= (probs.cumsum(dim=-1) - probs) >= p_t
                sorted_logits.masked_fill_(mask, float("-inf"))
                scaled = scaled.scatter(1, sorted_idx, sorted_logits)
            if any(p.min_p > 0.0 for p in params):
                probs = torch.softmax(scaled, dim=-1)
                threshold = probs.max(dim=-1, keepdim=True).values * m_t
                scaled = scaled.masked_fill(probs < threshold, float("-inf"))
            probs = torch.softmax(scaled, dim=-1)
            noise = self._exponential_noise(rows, vocab)
            sampled = (probs / noise).argmax(dim=-1)
            ids = torch.where(dp[_GREEDY] > 0.5, best_ids, sampled)
        ids = _flag_failed(best, ids)
        if not want_logprobs:
            return DeviceSample(ids)
        return DeviceSample(ids, _pack_logprobs(raw, ids, max(num_top)), num_top)


class _MaskStaging:
    """Grammar bitmasks: filled on the host into pinned rows, copied to the device on the
    current stream. An event keeps a refill from racing the previous copy."""

    def __init__(self, device: torch.device, max_rows: int) -> None:
        self.device = device
        self.max_rows = max_rows
        self._cuda = device.type == "cuda"
        self._host: torch.Tensor | None = None
        self._rows_host = torch.empty(max_rows, dtype=torch.int64, pin_memory=self._cuda)
        self._event = torch.cuda.Event() if self._cuda else None

    def stage(
        self, rows: list[int], matchers: list[GrammarMatcher], num_rows: int
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """-> (row indices `[k]` int64, None when all `num_rows` rows are constrained; bitmask
        `[k, words]` int32), both on the device."""
        from tandem.runtime.grammar import fill_bitmask

        k, words = len(rows), matchers[0].mask_words
        if self._host is None or self._host.shape[1] != words:
            self._host = torch.empty(self.max_rows, words, dtype=torch.int32, pin_memory=self._cuda)
        if self._event is not None:
            self._event.synchronize()  # the last copy out of these buffers has run
        host = self._host[:k]
        fill_bitmask(matchers, host)
        rows_d = None
        if rows != list(range(num_rows)):
            self._rows_host[:k] = torch.tensor(rows, dtype=torch.int64)
            rows_d = self._rows_host[:k].to(self.device, non_blocking=self._cuda)
        mask_d = host.to(self.device, non_blocking=self._cuda)
        if self._event is not None:
            self._event.record()
        return rows_d, mask_d


def _min_tokens_bans(rows: Sequence[GpuRow], vocab: int) -> list[int]:
    """Flat logits indices (row * vocab + token) banned because the row has not reached its
    min_tokens: its stop token ids, and its EOS ids unless it ignores EOS."""
    bans: list[int] = []
    for i, r in enumerate(rows):
        p = r.params
        if r.num_output_tokens < p.min_tokens:
            banned = p.stop_token_ids + (() if p.ignore_eos else tuple(r.eos_token_ids))
            bans.extend(i * vocab + t for t in banned if 0 <= t < vocab)
    return bans


def _flag_failed(best: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """best `[n]` float32: each row's largest processed logit; ids `[n]` int64 -> ids with
    `FAILED_ROW` where that is not finite: NaN or +inf in the row (max propagates NaN), or
    every token banned (-inf)."""
    return torch.where(torch.isfinite(best), ids, FAILED_ROW)


def _pack_logprobs(raw: torch.Tensor, ids: torch.Tensor, k: int) -> torch.Tensor:
    """raw logits `[n, V]`, ids `[n]` int64 -> `[n, 2 + 2k]` float64: the id, its logprob, the
    k best ids, their logprobs (raw log-softmax, as the reference sampler returns them)."""
    logp = torch.log_softmax(raw.float(), dim=-1)
    packed = torch.empty(raw.shape[0], 2 + 2 * k, dtype=torch.float64, device=raw.device)
    packed[:, 0] = ids
    packed[:, 1] = logp.gather(1, ids.clamp(min=0).unsqueeze(1)).squeeze(1)
    if k:
        vals, top = logp.topk(k, dim=-1)
        packed[:, 2 : 2 + k] = top
        packed[:, 2 + k :] = vals
    return packed

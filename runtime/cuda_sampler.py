"""Sampling on the GPU without host syncs: the CUDA runner's sampler.

Same semantics as `runtime.sampler.Sampler` (greedy, temperature, top-k, top-p, min-p, seeds
through the exponential race), but every per-row parameter reaches the device through a
pinned host buffer and a non-blocking copy, and no value is read back: `sample_async` returns
the sampled ids as a device tensor. Rows that need penalties, min_tokens bans or logprobs take
the reference `Sampler` path (it syncs); the runner counts those steps.
"""

from __future__ import annotations

import torch

from runtime.sampler import Sampler, SampleRow

_NUM_PARAMS = 5  # temperature, top_k, top_p, min_p, greedy
_RING = 2  # pinned parameter buffers in flight: one step's copy may still be pending


class CudaSampler(Sampler):
    def __init__(self, device: torch.device, max_num_seqs: int) -> None:
        super().__init__(device)
        self.max_num_seqs = max_num_seqs
        self._host = [
            torch.empty(_NUM_PARAMS, max_num_seqs, dtype=torch.float32, pin_memory=True)
            for _ in range(_RING)
        ]
        self._dev = torch.empty(_NUM_PARAMS, max_num_seqs, dtype=torch.float32, device=device)
        self._turn = 0

    @staticmethod
    def needs_host_path(rows: list[SampleRow]) -> bool:
        """Rows whose processing this sampler does not do on the device."""
        return any(
            r.params.has_penalties
            or r.params.logprobs
            or len(r.output_token_ids) < r.params.min_tokens
            for r in rows
        )

    def sample_async(self, logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        """logits `[N, V]` float32 on the device, N == len(rows) -> token ids `[N]` int64 on the
        device, enqueued on the current stream; nothing is read back."""
        n, vocab = logits.shape
        assert n == len(rows) <= self.max_num_seqs, (n, len(rows))
        greedy = [r.params.greedy for r in rows]
        if all(greedy):
            return logits.argmax(dim=-1)
        top_k = [float(r.params.top_k if 0 < r.params.top_k < vocab else vocab) for r in rows]
        top_p = [float(r.params.top_p) for r in rows]
        min_p = [float(r.params.min_p) for r in rows]
        temps = [
            1.0 if g else float(r.params.temperature) for g, r in zip(greedy, rows, strict=True)
        ]
        host = self._host[self._turn]
        self._turn = (self._turn + 1) % _RING
        hv = host.numpy()
        hv[0, :n] = temps
        hv[1, :n] = top_k
        hv[2, :n] = top_p
        hv[3, :n] = min_p
        hv[4, :n] = greedy
        dev = self._dev[:, :n]
        dev.copy_(host[:, :n], non_blocking=True)
        temp_t, k_t, p_t, m_t, greedy_t = (dev[i].unsqueeze(1) for i in range(_NUM_PARAMS))

        scaled = logits / temp_t
        if any(k < vocab for k in top_k) or any(p < 1.0 for p in top_p):
            sorted_logits, sorted_idx = scaled.sort(dim=-1, descending=True)
            ranks = torch.arange(vocab, device=logits.device, dtype=torch.float32).unsqueeze(0)
            mask = ranks >= k_t
            probs = torch.softmax(sorted_logits.masked_fill(mask, float("-inf")), dim=-1)
            # keep the smallest prefix whose mass reaches top_p (the first token always stays)
            mask |= (probs.cumsum(dim=-1) - probs) >= p_t
            sorted_logits.masked_fill_(mask, float("-inf"))
            scaled = scaled.scatter(1, sorted_idx, sorted_logits)
        if any(m > 0.0 for m in min_p):
            probs = torch.softmax(scaled, dim=-1)
            threshold = probs.max(dim=-1, keepdim=True).values * m_t
            scaled = scaled.masked_fill(probs < threshold, float("-inf"))
        probs = torch.softmax(scaled, dim=-1)
        noise = self._exponential_noise(rows, vocab)
        sampled = (probs / noise).argmax(dim=-1)
        return torch.where(greedy_t.squeeze(1) > 0.5, logits.argmax(dim=-1), sampled)

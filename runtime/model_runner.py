"""Turns a `SchedulerOutput` into device tensors, runs the model and samples.

Owns the device side of the engine: the model, the paged KV cache, the sampler and each
seeded request's random generator. Knows nothing of HTTP or of how requests were chosen.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from tandem.models.batch import ForwardBatch, KVCache
from tandem.runtime.sampler import Sampler, SampleRow
from tandem.runtime.types import SamplerOutput, SchedulerOutput

if TYPE_CHECKING:
    from tandem.models.config import ModelConfig

log = logging.getLogger(__name__)


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        model_config: ModelConfig,
        kv_cache: KVCache,
        device: torch.device,
        attn_backend: object | None = None,
    ) -> None:
        self.model = model
        self.model_config = model_config
        self.kv_cache = kv_cache
        self.block_size = kv_cache.block_size
        self.device = device
        self.attn_backend = attn_backend
        self.sampler = Sampler(device)
        # CPU bf16: the linears and attention run in ext/cpu kernels on the calling thread, so
        # torch's intra-op threads only split the small elementwise ops, and on a busy machine
        # each such split waits for a descheduled thread (a prefill several times slower).
        # Only where no large matmul is left to torch (a plain nn.Linear, torch-computed
        # experts): one thread would slow those on a many-core machine.
        self._torch_threads = (
            1
            if device.type == "cpu"
            and _model_dtype(model) is torch.bfloat16
            and not _torch_matmuls(model)
            else None
        )
        self._generators: dict[str, torch.Generator] = {}
        # Overlap: each request's token sampled by the last launch, for the one placeholder
        # input a step may schedule before that token is applied (the CPU's "future map").
        self._future_tokens: dict[str, int] = {}
        # Tensor parallel: sends each forward's inputs to the other ranks (runtime/tp.py).
        self.before_forward = None

    # -- per-request state -----------------------------------------------------------------

    def generator_for(self, request_id: str, seed: int | None) -> torch.Generator | None:
        if seed is None:
            return None
        gen = self._generators.get(request_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)
            self._generators[request_id] = gen
        return gen

    def release(self, request_id: str) -> None:
        self._generators.pop(request_id, None)
        self._future_tokens.pop(request_id, None)

    # -- one step -----------------------------------------------------------------------------

    def build_batch(
        self, sched: SchedulerOutput
    ) -> tuple[torch.Tensor, torch.Tensor, ForwardBatch]:
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        logits_indices: list[int] = []
        tables: list[list[int]] = []
        window_slots: list[int] = []  # the window pool's (a cache with window_layers)
        window_tables: list[list[int]] = []
        windowed = bool(self.kv_cache.window_layers)
        bs = self.block_size
        for s in sched.seqs:
            req = s.request
            start, end = s.start_pos, s.start_pos + s.num_tokens
            ids = req.token_ids[start:end]
            if len(ids) < s.num_tokens:  # overlap: the token the step in flight samples
                assert s.num_tokens == 1 and start == req.num_tokens, (start, req.num_tokens)
                ids = [self._future_tokens[req.request_id]]
            input_ids.extend(ids)
            positions.extend(range(start, end))
            blocks = req.block_ids
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(start, end))
            query_lens.append(s.num_tokens)
            seq_lens.append(end)
            tables.append(blocks[: (end + bs - 1) // bs])
            if windowed:
                wblocks = req.window_block_ids
                window_slots.extend(wblocks[p // bs] * bs + p % bs for p in range(start, end))
                window_tables.append(wblocks[: (end + bs - 1) // bs])
            if s.sample:
                logits_indices.append(len(input_ids) - 1)
        max_blocks = max(len(t) for t in tables)
        table_rows = [t + [0] * (max_blocks - len(t)) for t in tables]
        qsl = [0]
        for q in query_lens:
            qsl.append(qsl[-1] + q)

        dev = self.device

        def as_tensor(x: list, dtype: torch.dtype) -> torch.Tensor:
            t = torch.tensor(x, dtype=dtype)
            return t.to(dev, non_blocking=True) if dev.type != "cpu" else t

        batch = ForwardBatch(
            query_start_loc=as_tensor(qsl, torch.int32),
            seq_lens=as_tensor(seq_lens, torch.int32),
            block_tables=as_tensor(table_rows, torch.int32),
            slot_mapping=as_tensor(slots, torch.int64),
            logits_indices=as_tensor(logits_indices, torch.int64),
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
            kv_cache=self.kv_cache,
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
        )
        if windowed:
            batch.window_block_tables = as_tensor(
                [t + [0] * (max_blocks - len(t)) for t in window_tables], torch.int32
            )
            batch.window_slot_mapping = as_tensor(window_slots, torch.int64)
        if self.attn_backend is not None and hasattr(self.attn_backend, "prepare"):
            self.attn_backend.prepare(batch)
        return as_tensor(input_ids, torch.int64), as_tensor(positions, torch.int64), batch

    def execute(self, sched: SchedulerOutput) -> SamplerOutput:
        if self._torch_threads is None:
            return self._execute(sched)
        saved = torch.get_num_threads()
        torch.set_num_threads(self._torch_threads)
        try:
            return self._execute(sched)
        finally:
            torch.set_num_threads(saved)

    @torch.inference_mode()
    def _execute(self, sched: SchedulerOutput) -> SamplerOutput:
        input_ids, positions, batch = self.build_batch(sched)
        if self.before_forward is not None:
            self.before_forward(input_ids, positions, batch)
        hidden = self.model(input_ids, positions, batch)  # [num_sampling_seqs, hidden]
        sampling = [s for s in sched.seqs if s.sample]
        if not sampling:
            return SamplerOutput(token_ids=[])
        logits = self.model.compute_logits(hidden)  # [num_sampling_seqs, vocab] float32
        rows = [
            SampleRow(
                params=s.request.params,
                prompt_token_ids=s.request.prompt_token_ids,
                output_token_ids=s.request.output_token_ids,
                generator=self.generator_for(s.request.request_id, s.request.params.seed),
                eos_token_ids=s.request.eos_token_ids,
                grammar=s.request.grammar,
            )
            for s in sampling
        ]
        return self.sampler(logits, rows)

    # -- overlap: launch now, finish later ----------------------------------------------------

    def needs_sync(self, sched: SchedulerOutput) -> bool:
        """Whether `sched` must launch only after every earlier step is applied: its sampling
        reads the output history (penalties, min_tokens), which lacks tokens in flight, or a
        grammar, whose matcher must have taken the previous token before its mask is built."""
        return any(
            s.sample
            and (
                s.request.params.has_penalties
                or s.request.num_output_tokens < s.request.params.min_tokens
                or s.request.grammar is not None
            )
            for s in sched.seqs
        )

    def launch(self, sched: SchedulerOutput) -> SamplerOutput:
        """Start one step and return a handle for `finish`. Here the step runs at once (the
        engine's worker thread is the CPU's "stream"); the handle is its result."""
        out = self.execute(sched)
        sampling = [s for s in sched.seqs if s.sample]
        for s, token_id in zip(sampling, out.token_ids, strict=True):
            # a failed row's request ends when this step is applied; feed a valid id meanwhile
            self._future_tokens[s.request.request_id] = max(token_id, 0)
        return out

    def finish(self, handle: SamplerOutput) -> SamplerOutput:
        """The sampled ids of a launched step, in the order of its sampling seqs."""
        return handle


def _torch_matmuls(model: torch.nn.Module, min_weights: int = 1 << 16) -> bool:
    """Whether torch computes some large matmul of the model's forward: a plain nn.Linear of
    at least `min_weights` weights left unswapped, or experts on the torch expert backend."""
    backend = getattr(model, "expert_backend", None)
    if backend is not None and getattr(backend, "name", None) == "torch":
        return True
    return any(
        type(m) is torch.nn.Linear and m.weight.numel() >= min_weights for m in model.modules()
    )


def _model_dtype(model: torch.nn.Module) -> torch.dtype | None:
    """The dtype of the model's floating-point parameters (None: it has none)."""
    for p in model.parameters():
        if p.dtype.is_floating_point:
            return p.dtype
    return None

"""The model runner on CUDA: static device buffers fed from pinned host memory, a dedicated
stream, CUDA graphs for decode batch-size buckets, sampling on the GPU.

Owns the CUDA side of one step: it fills pinned host buffers from the `SchedulerOutput`,
copies them non-blocking into static device buffers on its own stream, runs the forward
(graph replay for a decode-only batch that fits a bucket, eager otherwise), samples on the
device and copies only the sampled ids back, to pinned memory, awaited with a CUDA event.
Everything the step reads stays on that one stream, so stream order alone keeps buffer reuse
safe.

Overlap: `launch` enqueues a step and returns at once; `finish` waits for its sampled ids.
Every launch also writes its sampled ids into a device "future" buffer of two halves (launch
k uses half k % 2, one row per sampling seq). A decode input whose token the step in flight
is still sampling is written as the placeholder -(index + 1) of that token's future row and
resolved on the device right before the forward (inside the graph for decode buckets), so no
host sync sits between steps. Only the previous launch's half is ever read, and stream order
puts that read before the next launch overwrites it. What it falls back from (eager decode, host-side sampling, failed compiles) is logged
once and counted in `fallbacks`.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from models.batch import ForwardBatch, KVCache
from runtime.cuda_sampler import CudaSampler
from runtime.model_runner import ModelRunner
from runtime.sampler import SampleRow
from runtime.types import SamplerOutput, SchedulerOutput

if TYPE_CHECKING:
    from models.config import ModelConfig

log = logging.getLogger(__name__)

GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


@dataclass(frozen=True)
class CudaRunnerOptions:
    """How the CUDA runner runs the forward. `from_env` is the one place that reads
    TANDEM_CUDA_GRAPHS=0, TANDEM_COMPILE=<mode> and TANDEM_NVTX=1."""

    cuda_graphs: bool = True
    graph_batch_sizes: tuple[int, ...] = GRAPH_BATCH_SIZES
    # None: eager forward. Else a torch.compile mode for the decode forward captured in the
    # graphs ("default" or "max-autotune-no-cudagraphs"); prefill/mixed steps stay eager.
    compile_mode: str | None = None
    nvtx: bool = False
    # Overlap scheduling: the engine launches step N+1 before it applies step N.
    overlap: bool = True
    # Record a (start, end) timing event pair per step on the stream (benchmarks: GPU idle).
    step_events: bool = False

    @classmethod
    def from_env(cls) -> CudaRunnerOptions:
        """Also reads TANDEM_OVERLAP=0 (overlap off)."""
        mode = os.environ.get("TANDEM_COMPILE") or None
        return cls(
            cuda_graphs=os.environ.get("TANDEM_CUDA_GRAPHS", "1") != "0",
            compile_mode=None if mode in (None, "0", "none") else mode,
            nvtx=os.environ.get("TANDEM_NVTX", "0") == "1",
            overlap=os.environ.get("TANDEM_OVERLAP", "1") != "0",
        )


@dataclass
class _StepBuffers:
    """Host (pinned) or device buffers of one step's inputs, sized for the largest step."""

    input_ids: torch.Tensor  # [max_tokens] int64
    positions: torch.Tensor  # [max_tokens] int64
    slot_mapping: torch.Tensor  # [max_tokens] int64
    logits_indices: torch.Tensor  # [max_seqs] int64
    query_start_loc: torch.Tensor  # [max_seqs + 1] int32
    seq_lens: torch.Tensor  # [max_seqs] int32
    block_tables: torch.Tensor  # [max_seqs, max_blocks] int32

    @classmethod
    def allocate(
        cls, max_tokens: int, max_seqs: int, max_blocks: int, device: torch.device | None
    ) -> _StepBuffers:
        kw = {"device": device} if device is not None else {"pin_memory": True}
        return cls(
            input_ids=torch.zeros(max_tokens, dtype=torch.int64, **kw),
            positions=torch.zeros(max_tokens, dtype=torch.int64, **kw),
            slot_mapping=torch.full((max_tokens,), -1, dtype=torch.int64, **kw),
            logits_indices=torch.zeros(max_seqs, dtype=torch.int64, **kw),
            query_start_loc=torch.zeros(max_seqs + 1, dtype=torch.int32, **kw),
            seq_lens=torch.zeros(max_seqs, dtype=torch.int32, **kw),
            block_tables=torch.zeros(max_seqs, max_blocks, dtype=torch.int32, **kw),
        )


@dataclass
class _Prepared:
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


@dataclass
class StepHandle:
    """A launched step: its sampled ids land in `out` (pinned) when `done` fires; a step that
    sampled on the host carries its `result` already."""

    num_logits: int
    out: torch.Tensor | None = None
    done: torch.cuda.Event | None = None
    result: SamplerOutput | None = None


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor  # [bs, vocab] float32, the graph's static output


@dataclass
class RunnerCounters:
    graph_steps: int = 0
    eager_steps: int = 0
    fallbacks: Counter = field(default_factory=Counter)


class CudaModelRunner(ModelRunner):
    def __init__(
        self,
        model: torch.nn.Module,
        model_config: ModelConfig,
        kv_cache: KVCache,
        device: torch.device,
        attn_backend: object | None = None,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        options: CudaRunnerOptions | None = None,
    ) -> None:
        super().__init__(model, model_config, kv_cache, device, attn_backend)
        self.options = options or CudaRunnerOptions.from_env()
        self.stream = torch.cuda.Stream(device)
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.max_blocks = -(-max_model_len // self.block_size)
        bucket_cap = min(max(self.options.graph_batch_sizes, default=0), _pow2_ceil(max_num_seqs))
        self.graph_sizes = tuple(
            sorted(b for b in self.options.graph_batch_sizes if b <= bucket_cap)
        )
        max_seqs = max(max_num_seqs, max(self.graph_sizes, default=0))
        max_tokens = max(max_num_batched_tokens, max_seqs)
        self._host = [
            _StepBuffers.allocate(max_tokens, max_seqs, self.max_blocks, None) for _ in range(2)
        ]
        self._turn = 0
        self._dev = _StepBuffers.allocate(max_tokens, max_seqs, self.max_blocks, device)
        # Graph replays select rows 0..bs-1; eager steps overwrite `_dev.logits_indices`.
        self._graph_rows = torch.arange(max_seqs, dtype=torch.int64, device=device)
        self._max_seqs = max_seqs
        # Two of each: launch k+1 fills one while step k's copy back may still be pending.
        self._out_host = [
            torch.empty(max_seqs, dtype=torch.int64, pin_memory=True) for _ in range(2)
        ]
        self._done = [torch.cuda.Event() for _ in range(2)]
        self._future = torch.zeros(2 * max_seqs, dtype=torch.int64, device=device)  # int64, cuda
        self._num_launches = 0
        # request id -> (launch number, future row) of the token its last launch sampled
        self._future_rows: dict[str, tuple[int, int]] = {}
        self.step_events: list[tuple[torch.cuda.Event, torch.cuda.Event, bool]] = []
        self.record_step_events = self.options.step_events
        self.sampler = CudaSampler(device, max_seqs)
        self.counters = RunnerCounters()
        self._graphs: dict[int, _Graph] = {}
        self._graph_pool = None
        self._decode_fn = self._forward_logits
        uses_cupy = getattr(attn_backend, "name", None) == "cupy"
        # The CPU expert pool waits on the host inside the forward: nothing to capture there.
        experts_capturable = getattr(
            getattr(model, "expert_backend", None), "supports_cuda_graphs", True
        )
        if self.options.cuda_graphs and not uses_cupy:
            self._fallback(
                "graphs_need_cupy_backend", "CUDA graphs need the cupy attention backend"
            )
        elif self.options.cuda_graphs and not experts_capturable:
            self._fallback(
                "graphs_not_capturable_experts",
                "the expert backend (CPU pool) waits on the host; decode runs eagerly",
            )
        elif self.options.cuda_graphs and self.graph_sizes:
            t0 = time.perf_counter()
            try:
                self._capture_graphs()
            except Exception as e:  # serve eagerly rather than not at all, and say so
                log.exception("decode CUDA graph capture failed")
                self._fallback("graph_capture_failed", f"{type(e).__name__}: {e}")
                self._graphs.clear()
                torch.cuda.synchronize(device)
            log.info(
                "captured %d decode CUDA graphs (batch sizes %s) in %.1fs",
                len(self._graphs),
                ",".join(map(str, sorted(self._graphs))),
                time.perf_counter() - t0,
            )

    # -- bookkeeping --------------------------------------------------------------------------

    def _fallback(self, kind: str, message: str) -> None:
        if kind not in self.counters.fallbacks:
            log.warning("CUDA runner fallback (%s): %s; counted from now on", kind, message)
        self.counters.fallbacks[kind] += 1

    def _nvtx(self, name: str):
        if self.options.nvtx:
            return torch.cuda.nvtx.range(name)
        return contextlib.nullcontext()

    # -- graphs -------------------------------------------------------------------------------

    def _forward_logits(
        self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        return self.model.compute_logits(self.model(input_ids, positions, batch))

    def _decode_batch(self, bs: int) -> ForwardBatch:
        """The static-buffer batch every replay of bucket `bs` reads."""
        d = self._dev
        return ForwardBatch(
            query_start_loc=d.query_start_loc[: bs + 1],
            seq_lens=d.seq_lens[:bs],
            block_tables=d.block_tables[:bs],
            slot_mapping=d.slot_mapping[:bs],
            logits_indices=self._graph_rows[:bs],
            query_lens_cpu=[1] * bs,
            seq_lens_cpu=[self.max_model_len] * bs,
            kv_cache=self.kv_cache,
            max_query_len=1,
            # an upper bound: the decode kernel's split-K plan stays valid for shorter contexts
            max_seq_len=self.max_model_len,
            attn_metadata="cupy",
        )

    @torch.inference_mode()
    def _capture_graphs(self) -> None:
        d = self._dev
        n = max(self.graph_sizes)
        with torch.cuda.stream(self.stream):
            # Inert inputs: warm-up and capture write no KV (slot -1) and read none (len 0).
            d.slot_mapping.fill_(-1)
            d.seq_lens.zero_()
            d.input_ids.zero_()
            d.positions.zero_()
            d.query_start_loc[: n + 1].copy_(
                torch.arange(n + 1, dtype=torch.int32, device=self.device)
            )
        if self.options.compile_mode is not None:
            self._decode_fn = self._compile_decode()
        self._graph_pool = torch.cuda.graph_pool_handle()
        for bs in sorted(self.graph_sizes, reverse=True):  # largest first: the pool fits all
            batch = self._decode_batch(bs)
            ids, pos = d.input_ids[:bs], d.positions[:bs]
            fn = self._decode_fn
            with torch.cuda.stream(self.stream):
                try:
                    for _ in range(2):  # warm-up: kernel compiles, lazy caches, autotuning
                        fn(ids, pos, batch)
                except Exception as e:  # a compile failure must not take the engine down
                    if fn is self._forward_logits:
                        raise
                    self._fallback("compile_failed", f"bucket {bs}: {type(e).__name__}: {e}")
                    fn = self._forward_logits
                    fn(ids, pos, batch)
                self._resolve_placeholders(ids)
            self.stream.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._graph_pool, stream=self.stream):
                self._resolve_placeholders(ids)
                logits = fn(ids, pos, batch)
            self._graphs[bs] = _Graph(graph, logits)
        self.stream.synchronize()

    def _compile_decode(self):
        import torch._dynamo

        # Buckets differ only in the batch dim: the first compile is static, the second marks
        # that dim dynamic and serves every later bucket. More recompiles than buckets is a
        # bug, not a reason to silently run eager: fail loudly; the caller logs and counts it.
        cfg = torch._dynamo.config
        limit = len(self.graph_sizes) + 2
        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(cfg, name):
                setattr(cfg, name, max(getattr(cfg, name), limit))
        if hasattr(cfg, "fail_on_recompile_limit_hit"):
            cfg.fail_on_recompile_limit_hit = True
        return torch.compile(self._forward_logits, mode=self.options.compile_mode)

    def _resolve_placeholders(self, ids: torch.Tensor) -> None:
        """ids `[n]` int64, cuda, in place: each -(row + 1) becomes the future buffer's row."""
        rows = (-ids - 1).clamp_(min=0)
        ids.copy_(torch.where(ids < 0, self._future[rows], ids))

    def release(self, request_id: str) -> None:
        super().release(request_id)
        self._future_rows.pop(request_id, None)

    def _placeholder(self, request_id: str) -> int:
        launch, row = self._future_rows[request_id]
        # Only the previous launch's half is intact; anything older is a scheduling bug.
        assert launch == self._num_launches - 1, (request_id, launch, self._num_launches)
        return -(row + 1)

    def _bucket(self, num_seqs: int) -> int | None:
        for bs in self.graph_sizes:
            if bs >= num_seqs:
                return bs if bs in self._graphs else None
        return None

    # -- one step -----------------------------------------------------------------------------

    def _prepare(self, sched: SchedulerOutput) -> _Prepared:
        """Fill the next pinned buffers from `sched` and enqueue their copies on the stream."""
        h = self._host[self._turn]
        self._turn ^= 1
        bs = self.block_size
        ids_h, pos_h, slot_h = h.input_ids.numpy(), h.positions.numpy(), h.slot_mapping.numpy()
        qsl_h, sl_h, bt_h = h.query_start_loc.numpy(), h.seq_lens.numpy(), h.block_tables.numpy()
        li_h = h.logits_indices.numpy()
        query_lens: list[int] = []
        seq_lens: list[int] = []
        t = 0
        num_logits = 0
        max_nb = 1
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
                    ids_h[t] = self._placeholder(req.request_id)
                    has_placeholders = True
                pos_h[t] = start
                slot_h[t] = block_ids[start // bs] * bs + start % bs
                bt_h[i, :nb] = block_ids[:nb]
            else:
                assert end <= len(req.token_ids), "a placeholder in a multi-token chunk"
                ids_h[t : t + n] = req.token_ids[start:end]
                pos = np.arange(start, end, dtype=np.int64)
                pos_h[t : t + n] = pos
                blocks = np.asarray(block_ids[:nb], dtype=np.int64)
                slot_h[t : t + n] = blocks[pos // bs] * bs + pos % bs
                bt_h[i, :nb] = blocks
            max_nb = max(max_nb, nb)
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
            graph_bs = self._bucket(num_seqs)
            if graph_bs is None and self.options.cuda_graphs:
                self._fallback("eager_decode", f"no captured graph for decode batch {num_seqs}")
        rows, tokens = num_seqs, t
        if graph_bs is not None:
            # Pad to the bucket with inert rows: no KV write (slot -1), no KV read (len 0).
            ids_h[t:graph_bs] = 0
            pos_h[t:graph_bs] = 0
            slot_h[t:graph_bs] = -1
            sl_h[num_seqs:graph_bs] = 0
            qsl_h[num_seqs + 1 : graph_bs + 1] = np.arange(t + 1, graph_bs + 1)
            rows = tokens = graph_bs
        d = self._dev
        with torch.cuda.stream(self.stream):
            if self.record_step_events:
                start_ev = torch.cuda.Event(enable_timing=True)
                start_ev.record(self.stream)
                self._step_start = (start_ev, graph_bs is not None)
            d.input_ids[:tokens].copy_(h.input_ids[:tokens], non_blocking=True)
            d.positions[:tokens].copy_(h.positions[:tokens], non_blocking=True)
            d.slot_mapping[:tokens].copy_(h.slot_mapping[:tokens], non_blocking=True)
            d.query_start_loc[: rows + 1].copy_(h.query_start_loc[: rows + 1], non_blocking=True)
            d.seq_lens[:rows].copy_(h.seq_lens[:rows], non_blocking=True)
            # Graph buckets read rows of the full-width table; eager steps a narrow copy.
            d.block_tables[:num_seqs].copy_(h.block_tables[:num_seqs], non_blocking=True)
            if graph_bs is None:
                d.logits_indices[:num_logits].copy_(
                    h.logits_indices[:num_logits], non_blocking=True
                )
        return _Prepared(
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

    def _forward(self, p: _Prepared) -> torch.Tensor:
        """Enqueue the forward on the stream -> logits `[num_logits, vocab]` float32."""
        if p.graph_bs is not None:
            g = self._graphs[p.graph_bs]
            g.graph.replay()
            self.counters.graph_steps += 1
            # The graph restores the static logits rows; the graph's logits_indices are arange.
            return g.logits[: p.num_logits]
        d = self._dev
        batch = ForwardBatch(
            query_start_loc=d.query_start_loc[: p.num_seqs + 1],
            seq_lens=d.seq_lens[: p.num_seqs],
            block_tables=d.block_tables[: p.num_seqs],
            slot_mapping=d.slot_mapping[: p.num_tokens],
            logits_indices=d.logits_indices[: p.num_logits],
            query_lens_cpu=p.query_lens,
            seq_lens_cpu=p.seq_lens,
            kv_cache=self.kv_cache,
            max_query_len=p.max_query_len,
            max_seq_len=p.max_seq_len,
        )
        self.counters.eager_steps += 1
        if p.has_placeholders:
            self._resolve_placeholders(d.input_ids[: p.num_tokens])
        if p.num_logits == 0:
            self.model(d.input_ids[: p.num_tokens], d.positions[: p.num_tokens], batch)
            return torch.empty(0, device=self.device)
        return self._forward_logits(d.input_ids[: p.num_tokens], d.positions[: p.num_tokens], batch)

    def needs_sync(self, sched: SchedulerOutput) -> bool:
        """The host sampler path (penalties, min_tokens, logprobs) reads the output history."""
        return any(
            s.sample
            and (
                s.request.params.has_penalties
                or s.request.params.logprobs
                or s.request.num_output_tokens < s.request.params.min_tokens
            )
            for s in sched.seqs
        )

    @torch.inference_mode()
    def launch(self, sched: SchedulerOutput) -> StepHandle:
        """Enqueue one step (inputs, forward, sampling, copy back) and return at once."""
        with self._nvtx("prepare"):
            p = self._prepare(sched)
        turn = self._num_launches % 2
        self._num_launches += 1
        with torch.cuda.stream(self.stream):
            with self._nvtx("forward"):
                logits = self._forward(p)
            handle = StepHandle(num_logits=p.num_logits)
            if p.num_logits == 0:
                handle.result = SamplerOutput(token_ids=[])
                self._record_step_end()
                return handle
            with self._nvtx("sample"):
                rows = self._sample_rows(sched)
                if self.sampler.needs_host_path(rows):
                    self._fallback("host_sampler", "penalties, min_tokens or logprobs")
                    handle.result = self.sampler(logits, rows)  # reads back on the host (syncs)
                    ids = torch.tensor(handle.result.token_ids, dtype=torch.int64)
                    ids = ids.pin_memory().to(self.device, non_blocking=True)
                else:
                    ids = self.sampler.sample_async(logits, rows)  # [num_logits] int64, device
                base = turn * self._max_seqs
                self._future[base : base + p.num_logits].copy_(ids)
                sampling = (s for s in sched.seqs if s.sample)
                for row, s in enumerate(sampling):
                    self._future_rows[s.request.request_id] = (self._num_launches - 1, base + row)
                if handle.result is None:
                    handle.out = self._out_host[turn][: p.num_logits]
                    handle.out.copy_(ids, non_blocking=True)
                    handle.done = self._done[turn]
                    handle.done.record(self.stream)
            self._record_step_end()
        return handle

    def finish(self, handle: StepHandle) -> SamplerOutput:
        """Wait for a launched step (blocks the calling thread only) -> its sampled ids."""
        if handle.result is not None:
            return handle.result
        assert handle.done is not None and handle.out is not None
        handle.done.synchronize()
        return SamplerOutput(token_ids=handle.out.tolist())

    def execute(self, sched: SchedulerOutput) -> SamplerOutput:
        return self.finish(self.launch(sched))

    def _record_step_end(self) -> None:
        if self.record_step_events:
            end = torch.cuda.Event(enable_timing=True)
            end.record(self.stream)
            start, is_graph = self._step_start
            self.step_events.append((start, end, is_graph))

    def _sample_rows(self, sched: SchedulerOutput) -> list[SampleRow]:
        return [
            SampleRow(
                params=s.request.params,
                prompt_token_ids=s.request.prompt_token_ids,
                output_token_ids=s.request.output_token_ids,
                generator=self.generator_for(s.request.request_id, s.request.params.seed),
                eos_token_ids=s.request.eos_token_ids,
            )
            for s in sched.seqs
            if s.sample
        ]


def _pow2_ceil(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(n, 1))))


@torch.inference_mode()
def profile_activation_bytes(
    model: torch.nn.Module,
    model_config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    block_size: int,
) -> int:
    """Peak bytes a largest step needs beyond the weights: one prefill of the whole token
    budget (spread over up to `max_num_seqs` sequences, each sampling with top-p) through the
    model's own backend, on a throwaway KV cache; plus the decode graphs' static logits."""
    from runtime.cuda_sampler import CudaSampler
    from runtime.sampling_params import SamplingParams

    num_tokens = max(max_num_batched_tokens, 1)
    num_seqs = max(1, min(max_num_seqs, num_tokens))
    per_seq = -(-num_tokens // num_seqs)
    nb_per_seq = -(-per_seq // block_size)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    cache = KVCache.allocate(
        model_config.num_hidden_layers,
        num_seqs * nb_per_seq,
        block_size,
        model_config.num_key_value_heads,
        model_config.head_dim,
        dtype,
        device,
    )
    cache_bytes = torch.cuda.memory_allocated(device) - base
    lens = [min(per_seq, num_tokens - i * per_seq) for i in range(num_seqs)]
    lens = [n for n in lens if n > 0]
    qsl = [0]
    for n in lens:
        qsl.append(qsl[-1] + n)
    total = qsl[-1]
    slots = torch.cat(
        [
            torch.arange(n, dtype=torch.int64) + i * nb_per_seq * block_size
            for i, n in enumerate(lens)
        ]
    )
    tables = torch.arange(len(lens) * nb_per_seq, dtype=torch.int32).view(len(lens), nb_per_seq)
    batch = ForwardBatch(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        block_tables=tables.to(device),
        slot_mapping=slots.to(device),
        logits_indices=torch.tensor(qsl[1:], dtype=torch.int64, device=device) - 1,
        query_lens_cpu=lens,
        seq_lens_cpu=lens,
        kv_cache=cache,
        max_query_len=max(lens),
        max_seq_len=max(lens),
    )
    ids = torch.randint(0, model_config.vocab_size, (total,), device=device)
    positions = torch.cat([torch.arange(n) for n in lens]).to(device)
    logits = model.compute_logits(model(ids, positions, batch))
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, min_p=0.01)
    rows = [SampleRow(params, [0], [], None) for _ in range(logits.shape[0])]
    CudaSampler(device, len(rows)).sample_async(logits, rows)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base - cache_bytes
    del cache, batch, logits
    torch.cuda.empty_cache()
    graph_logits = sum(GRAPH_BATCH_SIZES) * model_config.vocab_size * 4
    return int(peak + graph_logits + (256 << 20))

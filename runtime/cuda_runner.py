"""The model runner on CUDA: static device buffers fed from pinned host memory, a dedicated
stream, CUDA graphs for decode batch-size buckets, sampling on the GPU.

Owns the CUDA side of one step: inputs are staged by `runtime.cuda_inputs` (pinned host
buffers, non-blocking copies into static device buffers on the runner's stream), the forward
runs there (a `runtime.cuda_graphs` replay for a decode-only batch that fits a bucket, eager
otherwise), `runtime.cuda_sampler` samples on the device for every sampling parameter, and
only the sampled ids (packed with their logprobs where asked) come back to pinned memory, on
a side stream, awaited with a CUDA event. The forward stream never waits for that copy, so
the next step's forward is not queued behind it.

Overlap: `launch` enqueues a step and returns at once; `finish` waits for its sampled ids.
Every launch also writes its sampled ids into a device "future" buffer of two halves (launch
k uses half k % 2, one row per sampling seq). A decode input whose token the step in flight
is still sampling is written as the placeholder -(index + 1) of that token's future row and
resolved on the device right before the forward (inside the graph for decode buckets), so no
host sync sits between steps. Only the previous launch's half is ever read, and stream order
puts that read before the next launch overwrites it; the copy back of launch k reads half
k % 2 on the side stream, and launch k + 2 waits (on the device) for that copy before it
writes the half again. What it falls back from (eager decode, failed compiles) is logged once
and counted in `fallbacks`.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch

from tandem.models.batch import ForwardBatch, KVCache
from tandem.runtime.cuda_graphs import (
    GRAPH_BATCH_SIZES,
    CompiledEagerForward,
    DecodeGraphs,
    compile_forward,
    pow2_ceil,
)
from tandem.runtime.cuda_inputs import InputStager, PreparedStep
from tandem.runtime.cuda_memory import profile_activation_bytes
from tandem.runtime.cuda_sampler import PACK_WIDTH, CudaSampler, DeviceSample, GpuRow
from tandem.runtime.model_runner import ModelRunner
from tandem.runtime.types import SamplerOutput, SchedulerOutput

if TYPE_CHECKING:
    from tandem.models.config import ModelConfig
    from tandem.runtime.step_mirror import StepMirror

log = logging.getLogger(__name__)

__all__ = ["CudaModelRunner", "CudaRunnerOptions", "profile_activation_bytes"]

# Compiles a prefill/mixed forward may take (dynamic shapes: ideally one, plus one for a
# batch of a single sequence); past it dynamo raises and the runner counts a fall-back.
PREFILL_RECOMPILES = 8


@dataclass(frozen=True)
class CudaRunnerOptions:
    """How the CUDA runner runs the forward. `from_env` is the one place that reads
    TANDEM_CUDA_GRAPHS=0, TANDEM_COMPILE=<mode>, TANDEM_COMPILE_PREFILL=1 and TANDEM_NVTX=1."""

    cuda_graphs: bool = True
    graph_batch_sizes: tuple[int, ...] = GRAPH_BATCH_SIZES
    # None: eager forward. Else a torch.compile mode for the decode forward captured in the
    # graphs ("default" or "max-autotune-no-cudagraphs").
    compile_mode: str | None = None
    # With a compile mode: prefill/mixed steps compiled too (dynamic shapes; recompiles and a
    # fall-back to eager are logged and counted). Off by default until measured on the device.
    compile_prefill: bool = False
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
            compile_prefill=os.environ.get("TANDEM_COMPILE_PREFILL", "0") == "1",
            nvtx=os.environ.get("TANDEM_NVTX", "0") == "1",
            overlap=os.environ.get("TANDEM_OVERLAP", "1") != "0",
        )


@dataclass
class StepHandle:
    """A launched step: the host copy of its sample lands in `out` (pinned) when `done`
    fires; a step that sampled nothing carries its `result` already."""

    num_logits: int
    sample: DeviceSample | None = None
    out: torch.Tensor | None = None
    done: torch.cuda.Event | None = None
    result: SamplerOutput | None = None


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
        tp_mirror: Callable[[int, int], StepMirror] | None = None,
    ) -> None:
        """`tp_mirror(max_seqs, block_size)`: under tensor parallelism, the link that carries
        each step's inputs from rank 0 (which `launch`es) to the other ranks (which
        `follow`); every rank captures the same decode graphs, collectives included."""
        super().__init__(model, model_config, kv_cache, device, attn_backend)
        self.options = options or CudaRunnerOptions.from_env()
        if tp_mirror is not None and self.options.compile_mode is not None:
            log.warning("tensor parallel: torch.compile off (TANDEM_COMPILE ignored)")
            self.options = replace(self.options, compile_mode=None)
        if getattr(model, "batch_invariant", False) and self.options.compile_mode is not None:
            # Inductor's own GEMMs and reductions pick configurations per shape; the invariant
            # model runs eager (its decode steps still replay CUDA graphs).
            log.warning("--deterministic: torch.compile off (TANDEM_COMPILE ignored)")
            self.options = replace(self.options, compile_mode=None)
        self.stream = torch.cuda.Stream(device)
        self.copy_stream = torch.cuda.Stream(device)  # sampled ids back to the host
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.max_blocks = -(-max_model_len // self.block_size)
        bucket_cap = min(max(self.options.graph_batch_sizes, default=0), pow2_ceil(max_num_seqs))
        self.graphs = DecodeGraphs(
            tuple(b for b in self.options.graph_batch_sizes if b <= bucket_cap)
        )
        max_seqs = max(max_num_seqs, max(self.graphs.sizes, default=0))
        max_tokens = max(max_num_batched_tokens, max_seqs)
        self.inputs = InputStager(
            device, self.block_size, max_tokens, max_seqs, self.max_blocks,
            windowed=bool(kv_cache.window_layers),
        )  # fmt: skip
        # Graph replays select rows 0..bs-1; eager steps overwrite `logits_indices`.
        self._graph_rows = torch.arange(max_seqs, dtype=torch.int64, device=device)
        self._max_seqs = max_seqs
        self.tp_mirror = None if tp_mirror is None else tp_mirror(max_seqs, self.block_size)
        # Two of each: launch k+1 fills one while step k's copy back may still be pending.
        self._out_ids = [
            torch.empty(max_seqs, dtype=torch.int64, pin_memory=True) for _ in range(2)
        ]
        self._out_packed = [
            torch.empty(max_seqs * PACK_WIDTH, dtype=torch.float64, pin_memory=True)
            for _ in range(2)
        ]
        self._sampled = [torch.cuda.Event() for _ in range(2)]  # forward stream: ids ready
        self._done = [torch.cuda.Event() for _ in range(2)]  # copy stream: ids on the host
        self._future = torch.zeros(2 * max_seqs, dtype=torch.int64, device=device)  # int64, cuda
        self._num_launches = 0
        # request id -> (launch number, future row) of the token its last launch sampled
        self._future_rows: dict[str, tuple[int, int]] = {}
        self.step_events: list[tuple[torch.cuda.Event, torch.cuda.Event, bool]] = []
        self.record_step_events = self.options.step_events
        self._step_start: torch.cuda.Event | None = None
        self.sampler = CudaSampler(device, max_num_seqs)
        self.counters = RunnerCounters()
        self._eager_model = model
        if self.options.compile_mode is not None and self.options.compile_prefill:
            self._eager_model = CompiledEagerForward(
                model, self.options.compile_mode, PREFILL_RECOMPILES, self._fallback
            )
        uses_cupy = getattr(attn_backend, "name", None) == "cupy"
        # An expert backend may wait on the host inside the forward (the CPU pool with
        # GPU-resident experts, or its host-wait path): then decode runs eagerly.
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
                "the expert backend waits on the host inside the forward; decode runs eagerly",
            )
        elif self.options.cuda_graphs and self.graphs.sizes:
            try:
                self._capture_graphs()
            except Exception as e:  # serve eagerly rather than not at all, and say so
                log.exception("decode CUDA graph capture failed")
                self._fallback("graph_capture_failed", f"{type(e).__name__}: {e}")
                self.graphs.graphs.clear()
                torch.cuda.synchronize(device)

    # -- bookkeeping --------------------------------------------------------------------------

    def _fallback(self, kind: str, message: str) -> None:
        if kind not in self.counters.fallbacks:
            log.warning("CUDA runner fallback (%s): %s; counted from now on", kind, message)
        self.counters.fallbacks[kind] += 1

    def _nvtx(self, name: str):
        if self.options.nvtx:
            return torch.cuda.nvtx.range(name)
        return contextlib.nullcontext()

    def release(self, request_id: str) -> None:
        super().release(request_id)
        self._future_rows.pop(request_id, None)
        self.sampler.release(request_id)

    # -- graphs -------------------------------------------------------------------------------

    @property
    def _graphs(self) -> dict:
        """The captured decode graphs by bucket (tools/bench_gpu.py replays one alone)."""
        return self.graphs.graphs

    def _forward_logits(
        self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        return self.model.compute_logits(self.model(input_ids, positions, batch))

    def _decode_batch(self, bs: int) -> ForwardBatch:
        """The static-buffer batch every replay of bucket `bs` reads."""
        d = self.inputs.dev
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
            window_block_tables=(
                None if d.window_block_tables is None else d.window_block_tables[:bs]
            ),
            window_slot_mapping=(
                None if d.window_slot_mapping is None else d.window_slot_mapping[:bs]
            ),
        )

    @torch.inference_mode()
    def _capture_graphs(self) -> None:
        d = self.inputs.dev
        n = max(self.graphs.sizes)
        with torch.cuda.stream(self.stream):
            # Inert inputs: warm-up and capture write no KV (slot -1) and read none (len 0).
            d.slot_mapping.fill_(-1)
            if d.window_slot_mapping is not None:
                d.window_slot_mapping.fill_(-1)
            d.seq_lens.zero_()
            d.input_ids.zero_()
            d.positions.zero_()
            d.query_start_loc[: n + 1].copy_(
                torch.arange(n + 1, dtype=torch.int32, device=self.device)
            )
        forward = self._forward_logits
        if self.options.compile_mode is not None:
            # Buckets differ only in the batch dim: the first compile is static, the second
            # marks that dim dynamic and serves every later bucket. More recompiles than
            # buckets is a bug, not a reason to silently run eager: it raises, counted.
            forward = compile_forward(
                forward,
                self.options.compile_mode,
                dynamic=None,
                recompiles=len(self.graphs.sizes) + 2,
            )
        self.graphs.capture(
            self.stream,
            self._decode_batch,
            d.input_ids,
            d.positions,
            forward,
            self._forward_logits,
            self._resolve_placeholders,
            self._fallback,
        )

    def _resolve_placeholders(self, ids: torch.Tensor) -> None:
        """ids `[n]` int64, cuda, in place: each -(row + 1) becomes the future buffer's row."""
        rows = (-ids - 1).clamp_(min=0)
        ids.copy_(torch.where(ids < 0, self._future[rows], ids))

    def _placeholder(self, request_id: str) -> int:
        launch, row = self._future_rows[request_id]
        # Only the previous launch's half is intact; anything older is a scheduling bug.
        assert launch == self._num_launches - 1, (request_id, launch, self._num_launches)
        return -(row + 1)

    def _bucket(self, num_seqs: int) -> int | None:
        if not self.graphs.graphs:
            return None
        bs = self.graphs.bucket(num_seqs)
        if bs is None:
            self._fallback("eager_decode", f"no captured graph for decode batch {num_seqs}")
        return bs

    # -- one step -----------------------------------------------------------------------------

    def _prepare(self, sched: SchedulerOutput) -> PreparedStep:
        """Stage one step's inputs on the stream (tests drive `_prepare`/`_forward` by hand)."""
        with torch.cuda.stream(self.stream):
            return self.inputs.prepare(sched, self._placeholder, self._bucket)

    def _forward(self, p: PreparedStep) -> torch.Tensor:
        """Enqueue the forward on the stream -> logits `[num_logits, vocab]` float32 (None
        past rank 0 under tensor parallelism)."""
        d = self.inputs.dev
        mirror = self.tp_mirror
        if mirror is not None and mirror.rank == 0:
            if p.has_placeholders:  # the other ranks get the ids resolved, not placeholders
                self._resolve_placeholders(d.input_ids[: p.num_tokens])
            mirror.send(p, d)
        if p.graph_bs is not None:
            self.counters.graph_steps += 1
            # The graph restores the static logits rows; the graph's logits_indices are arange.
            return self.graphs.replay(p.graph_bs, p.num_logits)
        batch = self.inputs.eager_batch(p, self.kv_cache)
        self.counters.eager_steps += 1
        ids, pos = d.input_ids[: p.num_tokens], d.positions[: p.num_tokens]
        if p.has_placeholders:
            self._resolve_placeholders(ids)
        hidden = self._eager_model(ids, pos, batch)
        if p.num_logits == 0:
            return torch.empty(0, device=self.device)
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def follow(self) -> bool:
        """A rank past 0: run the next step rank 0 sends (its forward and collectives, no
        sampling) -> False once rank 0 stops."""
        assert self.tp_mirror is not None and self.tp_mirror.rank != 0
        with torch.cuda.stream(self.stream):
            p = self.tp_mirror.receive(self.inputs.dev)
            if p is None:
                return False
            if p.graph_bs is not None and p.graph_bs not in self.graphs.graphs:
                # rank 0 replays a bucket this rank failed to capture: same shapes, eagerly
                d = self.inputs.dev
                ids, pos = d.input_ids[: p.graph_bs], d.positions[: p.graph_bs]
                self._forward_logits(ids, pos, self._decode_batch(p.graph_bs))
            else:
                self._forward(p)
        return True

    def needs_sync(self, sched: SchedulerOutput) -> bool:
        """Only for a grammar: its mask is built on the host from a matcher that must have
        taken the previous token. Penalties, min_tokens and logprobs are sampled on the
        device, which also holds the token in flight, so they never wait."""
        return any(s.sample and s.request.grammar is not None for s in sched.seqs)

    @torch.inference_mode()
    def launch(self, sched: SchedulerOutput) -> StepHandle:
        """Enqueue one step (inputs, forward, sampling, copy back) and return at once."""
        with torch.cuda.stream(self.stream):
            self._record_step_start()
            with self._nvtx("prepare"):
                p = self._prepare(sched)
            turn = self._num_launches % 2
            self._num_launches += 1
            with self._nvtx("forward"):
                logits = self._forward(p)
            handle = StepHandle(num_logits=p.num_logits)
            if p.num_logits == 0:
                handle.result = SamplerOutput(token_ids=[])
                self._record_step_end(p)
                return handle
            with self._nvtx("sample"):
                rows = self._sample_rows(sched)
                penalties = any(r.params.has_penalties for r in rows)
                last_ids = self.inputs.last_input_ids(p) if penalties else None
                handle.sample = self.sampler.sample_async(logits, rows, last_ids)
                # This half was last read by the copy back of launch k - 2: wait for it.
                self.stream.wait_event(self._done[turn])
                base = turn * self._max_seqs
                # a failed row's id is FAILED_ROW: a step already launched may read its slot
                future = self._future[base : base + p.num_logits]
                torch.clamp(handle.sample.token_ids, min=0, out=future)
                for row, s in enumerate(s for s in sched.seqs if s.sample):
                    self._future_rows[s.request.request_id] = (self._num_launches - 1, base + row)
                self._sampled[turn].record(self.stream)
            self._copy_back(handle, turn)
            self._record_step_end(p)
        return handle

    def _copy_back(self, handle: StepHandle, turn: int) -> None:
        """Copy the step's sample to pinned memory on the side stream; `handle.done` fires
        when it has landed."""
        sample, n = handle.sample, handle.num_logits
        assert sample is not None
        with torch.cuda.stream(self.copy_stream):
            self.copy_stream.wait_event(self._sampled[turn])
            src = sample.host_source  # the ids with their FAILED_ROW flags, or packed
            src.record_stream(self.copy_stream)  # allocated on the forward stream
            if sample.packed is None:
                out = self._out_ids[turn][:n]
            else:
                out = self._out_packed[turn][: src.numel()].view(src.shape)
            out.copy_(src, non_blocking=True)
            self._done[turn].record(self.copy_stream)
        handle.out = out
        handle.done = self._done[turn]

    def finish(self, handle: StepHandle) -> SamplerOutput:
        """Wait for a launched step (blocks the calling thread only) -> its sampled ids."""
        if handle.result is not None:
            return handle.result
        assert handle.done is not None and handle.out is not None and handle.sample is not None
        handle.done.synchronize()
        return handle.sample.output(handle.out)

    def execute(self, sched: SchedulerOutput) -> SamplerOutput:
        return self.finish(self.launch(sched))

    def _record_step_start(self) -> None:
        if self.record_step_events:
            self._step_start = torch.cuda.Event(enable_timing=True)
            self._step_start.record(self.stream)

    def _record_step_end(self, p: PreparedStep) -> None:
        if self.record_step_events:
            end = torch.cuda.Event(enable_timing=True)
            end.record(self.stream)
            assert self._step_start is not None
            self.step_events.append((self._step_start, end, p.graph_bs is not None))

    def _sample_rows(self, sched: SchedulerOutput) -> list[GpuRow]:
        rows = []
        for s in sched.seqs:
            if not s.sample:
                continue
            req = s.request
            rows.append(
                GpuRow(
                    params=req.params,
                    token_ids=req.token_ids,
                    num_prompt_tokens=req.num_prompt_tokens,
                    # under overlap one more than the host holds: the token in flight
                    num_output_tokens=s.start_pos + s.num_tokens - req.num_prompt_tokens,
                    generator=self.generator_for(req.request_id, req.params.seed),
                    eos_token_ids=req.eos_token_ids,
                    request_id=req.request_id,
                    grammar=req.grammar,
                )
            )
        return rows

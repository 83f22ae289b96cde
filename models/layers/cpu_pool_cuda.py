"""The cpu_pool backend's CUDA paths: the stream-ordered one (capturable in decode CUDA
graphs), the older host-wait one, and the GPU prefill of large steps from the pool's weights.

One layer's step on CUDA (stream-ordered, the default): all of it is enqueued on the current
stream, nothing waits on the host, so it can be captured in a decode CUDA graph:
  1. hidden (fp32), the CPU-routed ids (GPU-placed experts -> -1), the routing weights and the
     row count -> fixed pinned buffers (non_blocking D2H copies);
  2. the stream starts the pool on those buffers: by default ("flags" sync) it writes the row
     count into a pinned go word that the pool's poller thread watches
     (`CpuExpertPool.enqueue_go`); with "host_func" sync a host function starts it
     (`enqueue_submit`, rows from a pinned word copied in step 1);
  3. meanwhile the GPU runs the GPU-resident experts and, in the MoE block, the shared expert;
  4. the stream waits until the pool is done: the GPU polls the job's done word
     (`enqueue_done_wait`), or a host function blocks it (`enqueue_wait`);
  5. the pinned output -> a fixed device buffer (non_blocking H2D), then added.
Flags cost no CUDA driver thread and no host-function launch (each host-function round trip
cost ~100 us a layer on an H100 host); TANDEM_POOL_SYNC=host_func selects the older way.
The pinned buffers are shared by all layers: the stream orders layer l's output copy before
layer l+1's input copies, so one set suffices (one stream at a time). They are sized for the
largest call seen and only grow outside graph capture (a capture is preceded by warm-up runs
of the same size); a grown set leaves the old one alive for the graphs that point at it. A
graph replays the row count it was captured with: the padding rows of a decode bucket are
computed by the pool like real ones (inert inputs; their output is never read).
A layer split between GPU and CPU is captured too: its GPU-resident experts run without a host
sync at graph sizes (models/layers/local_experts.py; tests/models/test_moe_families_cuda.py).

`stream_ordered=False` keeps the older path: copy, wait on the host for the copy, submit, sync.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tandem.models.layers.cpu_expert_options import (
    FUSED_MOE_STAGE,
    GPU_PREFILL_MIN_TOKENS,
    GPU_PREFILL_TOKENS,
)
from tandem.models.layers.local_experts import _local_experts

if TYPE_CHECKING:
    from tandem.ext.cpu import CpuExpertPool, StreamJob
    from tandem.models.layers.gpu_prefill import GpuExpertPrefill

logger = logging.getLogger(__name__)


class _PinnedBuffers:
    """Host staging for one layer call, grown on demand. One set suffices: layers run one after
    another and each reuse follows a host wait on work queued after the previous use."""

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self.tokens = 0
        self.x = self.ids = self.w = self.out = torch.empty(0)

    def get(self, tokens: int, hidden: int, k: int) -> tuple[torch.Tensor, ...]:
        if tokens > self.tokens or self.x.shape[1:] != (hidden,) or self.ids.shape[1:] != (k,):
            cap = max(tokens, 2 * self.tokens if self.x.shape[1:] == (hidden,) else 0, 16)
            kw = {"pin_memory": self.pin}
            self.x = torch.empty(cap, hidden, dtype=torch.float32, **kw)
            self.out = torch.empty(cap, hidden, dtype=torch.float32, **kw)
            self.ids = torch.empty(cap, k, dtype=torch.int64, **kw)
            self.w = torch.empty(cap, k, dtype=torch.float32, **kw)
            self.tokens = cap
        return self.x[:tokens], self.ids[:tokens], self.w[:tokens], self.out[:tokens]


class _StreamStaging:
    """Fixed buffers of the stream-ordered CUDA path and one pool job per layer over them.
    Never freed while the backend lives: a captured graph keeps their addresses."""

    def __init__(
        self, capacity: int, hidden: int, k: int, device: torch.device, flags: bool
    ) -> None:
        pin = {"pin_memory": True}
        self.capacity, self.hidden, self.k, self.flags = capacity, hidden, k, flags
        self.x = torch.zeros(capacity, hidden, dtype=torch.float32, **pin)  # [C, H] pinned
        self.ids = torch.full((capacity, k), -1, dtype=torch.int64, **pin)  # [C, k]
        self.w = torch.zeros(capacity, k, dtype=torch.float32, **pin)  # [C, k]
        self.out = torch.zeros(capacity, hidden, dtype=torch.float32, **pin)  # [C, H]
        self.rows = torch.zeros(1, dtype=torch.int32, **pin)  # [1]: the rows of a call
        # rows_d[T] is T: a 4-byte D2H copy of rows_d[T:T+1] sets `rows`, no kernel needed
        self.rows_d = torch.arange(capacity + 1, dtype=torch.int32, device=device)
        self.out_d = torch.zeros(capacity, hidden, dtype=torch.float32, device=device)
        self.jobs: dict[int, StreamJob] = {}

    def fits(self, tokens: int, hidden: int, k: int) -> bool:
        return tokens <= self.capacity and (hidden, k) == (self.hidden, self.k)

    def job(self, pool: CpuExpertPool, layer_idx: int) -> StreamJob:
        job = self.jobs.get(layer_idx)
        if job is None:
            job = self.jobs[layer_idx] = pool.stream_job(
                layer_idx, self.x, self.ids, self.w, self.out, self.rows, flags=self.flags
            )
        return job


@dataclass
class _Pending:
    """A layer call between `start` and `finish`."""

    hidden: torch.Tensor  # [T, H] model dtype (for the output dtype and device)
    out: torch.Tensor | None = None  # [T, H] the CPU part, when already computed
    staging: _StreamStaging | None = None  # stream-ordered: whose job to wait for
    job: StreamJob | None = None
    stream: int = 0
    extra: torch.Tensor | None = None  # [T, H] f32: the GPU-resident experts' part
    fused: bool = False  # started by route_and_start: finish gathers with one kernel


class PoolCudaPaths:
    """Mixin of CpuPoolExpertBackend (cpu_experts.py), over its pool, staging buffers and
    options."""

    pool: CpuExpertPool
    _gpu_prefill: GpuExpertPrefill | None
    _biases: dict

    def gpu_prefill_tokens(self, layer_idx: int) -> int:
        """From how many tokens a CUDA step computes this layer on the GPU (0: never; else at
        least GPU_PREFILL_MIN_TOKENS)."""
        n = self._gpu_prefill_option
        if n is None:
            n = GPU_PREFILL_TOKENS.get(self.pool.layer_format(layer_idx)[0], 0)
        return max(n, GPU_PREFILL_MIN_TOKENS) if n else 0

    def _use_gpu_prefill(self, layer_idx: int, tokens: int) -> bool:
        """Whether this CUDA call goes to the GPU from the pool's weights: enough tokens, not
        inside a graph capture (decode graphs keep the pool), and the path set up (it takes
        the layers' expert biases, GPT-OSS, from the backend)."""
        n = self.gpu_prefill_tokens(layer_idx)
        if not n or tokens < n or self._gpu_prefill_failed:
            return False
        if torch.cuda.is_current_stream_capturing():
            return False
        if self._gpu_prefill is None:
            try:
                from tandem.models.layers.gpu_prefill import GpuExpertPrefill

                device = self._layer_counts(layer_idx).device
                self._gpu_prefill = GpuExpertPrefill(
                    self.pool, sorted(self._counts), device, biases=self._biases
                )
                self._gpu_prefill.layer_bytes(layer_idx)  # the pool's layout is readable
            except Exception as e:  # noqa: BLE001 - fall back to the pool, loudly
                self._gpu_prefill_failed = True
                logger.warning("cpu_pool: GPU prefill unavailable, the pool computes: %s", e)
                return False
        return True

    @torch.compiler.disable
    @torch.no_grad()
    def route_and_start(
        self,
        layer_idx: int,
        hidden: torch.Tensor,  # [T, H] model dtype, cuda
        logits: torch.Tensor,  # [T, E] the router's logits, same dtype
        top_k: int,
        renormalize: bool,
    ) -> _Pending | None:
        """The router and `start` in one kernel on CUDA (ext/cuda/moe_stage.py): softmax,
        top-k, routing counts and the pool's inputs written straight into the pinned staging
        buffers. None where it does not apply (CPU, the host-wait path, shapes the kernel does
        not take, TANDEM_FUSED_MOE_STAGE=0): the caller routes in torch and calls `start`."""
        if not (FUSED_MOE_STAGE and hidden.is_cuda and self.stream_ordered):
            return None
        if self._use_gpu_prefill(layer_idx, hidden.shape[0]):
            return None  # `start` takes it to the GPU
        from tandem.ext.cuda import moe_stage

        if not moe_stage.supported(hidden, logits, top_k):
            return None
        counts = self._layer_counts(layer_idx)
        place = self._placements.get(layer_idx)
        st = self._staging_for(hidden.shape[0], hidden.shape[1], top_k, hidden.device)
        topk_ids, topk_weights = moe_stage.route_stage(
            hidden, logits, top_k, renormalize, st.x, st.ids, st.w,
            local=place.local if place is not None else None, counts=counts,
        )  # fmt: skip
        pending = self._launch(st, layer_idx, hidden, topk_ids, topk_weights, place, fused=True)
        self._note_routed(layer_idx, hidden.shape[0])
        return pending

    @torch.compiler.disable
    @torch.no_grad()
    def finish(self, pending: _Pending) -> torch.Tensor:
        """-> `[T, H]` in the hidden states' dtype, on their device."""
        hidden = pending.hidden
        if pending.out is not None:
            return pending.out.to(hidden.dtype)
        st, job = pending.staging, pending.job
        assert st is not None and job is not None
        T = hidden.shape[0]
        if st.flags:
            self.pool.enqueue_done_wait(pending.stream, job)
        else:
            self.pool.enqueue_wait(pending.stream, job)
        if pending.fused:
            from tandem.ext.cuda import moe_stage

            return moe_stage.gather(st.out[:T], pending.extra, hidden.dtype, st.out_d)
        out = st.out_d[:T]
        out.copy_(st.out[:T], non_blocking=True)  # [T, H] f32 cuda, after the wait node
        if pending.extra is not None:
            return (out + pending.extra).to(hidden.dtype)
        # a copy even in fp32: out_d is overwritten by the next layer
        return out.to(hidden.dtype, copy=True)

    def _start_stream(self, layer_idx, hidden, cpu_ids, topk_ids, topk_weights, place):
        T, H = hidden.shape
        st = self._staging_for(T, H, topk_ids.shape[1], hidden.device)
        st.x[:T].copy_(hidden.float().contiguous(), non_blocking=True)  # [T, H] f32 pinned
        st.ids[:T].copy_(cpu_ids.contiguous(), non_blocking=True)
        st.w[:T].copy_(topk_weights.float().contiguous(), non_blocking=True)
        return self._launch(st, layer_idx, hidden, topk_ids, topk_weights, place)

    def _launch(
        self, st: _StreamStaging, layer_idx: int, hidden, topk_ids, topk_weights, place,
        fused: bool = False,
    ) -> _Pending:  # fmt: skip
        """After the pool's inputs are enqueued into `st`: start the layer's job in stream
        order, and run the GPU-resident experts while the pool computes."""
        T = hidden.shape[0]
        job = st.job(self.pool, layer_idx)
        stream = torch.cuda.current_stream(hidden.device).cuda_stream
        if st.flags:
            self.pool.kick()  # the poller: spin, layers are coming (eager steps, captures)
            self.pool.enqueue_go(stream, job, T)
        else:
            st.rows.copy_(st.rows_d[T : T + 1], non_blocking=True)
            self.pool.enqueue_submit(stream, job)
        extra = None
        if place is not None:
            extra = _local_experts(
                hidden, place.local[topk_ids], topk_weights, place.w13, place.w2, place.bias
            )
        return _Pending(hidden, staging=st, job=job, stream=stream, extra=extra, fused=fused)

    def _staging_for(
        self, tokens: int, hidden: int, k: int, device: torch.device
    ) -> _StreamStaging:
        if self._staging and self._staging[-1].fits(tokens, hidden, k):
            return self._staging[-1]
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"cpu_pool: a captured call of {tokens} rows needs larger pinned buffers; "
                "run the same shape once eagerly before capturing (warm-up)"
            )
        last = self._staging[-1].capacity if self._staging else 0
        capacity = max(tokens, 2 * last, 256)
        self._staging.append(_StreamStaging(capacity, hidden, k, device, self.sync == "flags"))
        return self._staging[-1]

    def _forward_cuda(self, layer_idx, hidden, cpu_ids, topk_ids, topk_weights, place):
        """The host-wait path (stream_ordered=False): not capturable."""
        T, H = hidden.shape
        k = topk_ids.shape[1]
        if self._buffers is None:
            self._buffers = _PinnedBuffers(pin=True)
        x_h, ids_h, w_h, out_h = self._buffers.get(T, H, k)
        stream = torch.cuda.current_stream(hidden.device)
        x_h.copy_(hidden.float(), non_blocking=True)  # [T, H] f32 pinned
        ids_h.copy_(cpu_ids, non_blocking=True)
        w_h.copy_(topk_weights.float(), non_blocking=True)
        copied = torch.cuda.Event()
        copied.record(stream)
        t0 = time.perf_counter()
        copied.synchronize()  # the copies only: nothing else is queued before them
        t1 = time.perf_counter()
        self.pool.submit(layer_idx, x_h, ids_h, w_h, out_h)
        t2 = time.perf_counter()
        extra = None
        if place is not None:  # the GPU-resident experts run while the pool computes
            extra = _local_experts(
                hidden, place.local[topk_ids], topk_weights, place.w13, place.w2, place.bias
            )
        t3 = time.perf_counter()
        self.pool.sync()
        t4 = time.perf_counter()
        out = out_h.to(hidden.device, non_blocking=True)  # [T, H] f32 cuda
        if extra is not None:
            out += extra
        s = self._stats
        s.layer_calls += 1
        s.pool_wait_seconds += (t1 - t0) + (t4 - t3)
        s.pool_seconds += t4 - t2
        s.d2h_bytes += T * H * 4 + T * k * 12
        s.h2d_bytes += T * H * 4
        return out

"""The "cpu_pool" expert backend: a MoE layer's experts live in the C++ CPU expert pool
(ext/cpu), optionally with each layer's most-routed experts kept on the GPU as well.

Owns expert placement, the host<->device traffic of the hybrid path and its counters. Knows
nothing about requests or scheduling. At load (`attach`) every MoE block hands its stacked
weights to the pool, which converts them (bf16, int8 or int4), and the block's torch copies
are replaced by empty tensors, so host memory holds the experts once. Before that, the loader
asks `skip_expert_layers` which layers' expert tensors it need not read at all: those found in
the expert cache (a header check) and a GGUF's stacked experts (converted from its blocks).

The backend is split by responsibility: loading and converting (cpu_pool_loading.py), the
GPU-resident experts (cpu_pool_placement.py), the CUDA paths and graph integration
(cpu_pool_cuda.py), the counters (cpu_pool_stats.py); this module holds the options, the
pool and the call itself.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tandem.models.layers.cpu_expert_options import (
    CPU_SPIN_US,
    CUDA_SPIN_US,
    FORMATS,
    GPU_PREFILL_ENV,
    SYNC_ENV,
    SYNC_MODES,
    default_cuda_pool_threads,
    parse_cpu_experts,
    parse_gpu_prefill,
    spin_us_from_env,
)
from tandem.models.layers.cpu_pool_cuda import (
    PoolCudaPaths,
    _Pending,
    _PinnedBuffers,
    _StreamStaging,
)
from tandem.models.layers.cpu_pool_loading import PoolLoading
from tandem.models.layers.cpu_pool_placement import GpuPlacement, _Placement
from tandem.models.layers.cpu_pool_stats import HybridMoeStats
from tandem.models.layers.experts import ExpertBias
from tandem.models.layers.local_experts import _local_experts

if TYPE_CHECKING:
    from tandem.ext.cpu import CpuExpertPool, ExpertCache
    from tandem.models.layers.gpu_prefill import GpuExpertPrefill


class CpuPoolExpertBackend(PoolLoading, GpuPlacement, PoolCudaPaths):
    """ExpertBackend over a `CpuExpertPool`; see the module docstring for the step.

    Options: fmt ("bf16" | "int8" | "int4"), group_size (int4), num_threads and isa (pool),
    cpu_experts ("all" | N) and gpu_experts (N) per layer, rebalance_after_tokens (after this
    many routed tokens, re-place each layer's hottest experts on the GPU once; 0 = never),
    expert_cache (None: on when the cache directory is writable and TANDEM_EXPERT_CACHE is not
    0, see ext/cpu/cache.py; False: off; True or a directory: on) and cache_source (the
    checkpoint path; load_model's `skip_expert_layers` call sets it when not given; without one
    the cache is keyed by a sampled fingerprint of the weights). With the cache on, each layer
    is loaded from its saved converted file when the key matches, else converted and saved.
    GPU-resident experts are copied from the pool's weights. stream_ordered (CUDA: the
    pool is started and awaited in stream order, capturable; False: host waits), sync (how a
    stream-ordered call reaches the pool: "flags" or "host_func"; None: TANDEM_POOL_SYNC, else
    flags where the driver has stream memory operations) and spin_us (how long idle pool
    workers spin before sleeping; None: the pool's default).

    Besides `forward`, `start` + `finish` split a call so that the caller (the MoE block) can
    enqueue GPU work, such as a shared expert, while the pool computes.
    """

    name = "cpu_pool"
    host_experts = True  # build_model materializes MoE expert weights in host memory
    supports_expert_bias = True  # GPT-OSS: biases and the clamped SwiGLU in the pool's kernels

    def __init__(
        self,
        fmt: str = "bf16",
        group_size: int | None = None,
        num_threads: int | None = None,
        isa: str | None = None,
        cpu_experts: str | int | None = "all",
        gpu_experts: int | None = None,
        rebalance_after_tokens: int = 4096,
        pool: CpuExpertPool | None = None,
        expert_cache: bool | str | Path | None = None,
        cache_source: str | Path | None = None,
        stream_ordered: bool = True,
        spin_us: int | None = None,
        sync: str | None = None,
        gpu_prefill: str | int | None = None,
    ) -> None:
        if fmt not in FORMATS:
            raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")
        sync = sync or os.environ.get(SYNC_ENV) or None
        if sync is not None and sync not in SYNC_MODES:
            raise ValueError(f"sync ({SYNC_ENV}) must be one of {SYNC_MODES}, got {sync!r}")
        self._sync_option = sync
        if gpu_prefill is None:
            gpu_prefill = os.environ.get(GPU_PREFILL_ENV) or None
        self._gpu_prefill_option = parse_gpu_prefill(gpu_prefill)
        self._gpu_prefill: GpuExpertPrefill | None = None
        self._gpu_prefill_failed = False
        parse_cpu_experts(cpu_experts)  # validate early
        if group_size not in (None, 32, 64):
            raise ValueError(f"group_size must be 32 or 64, got {group_size!r}")
        # int4 groups: group_size, else 64 (a GGUF's Q4 experts keep their 32)
        self.fmt, self.group_size, self._group_option = fmt, group_size or 64, group_size
        self.cpu_experts, self.gpu_experts = cpu_experts, gpu_experts
        self.rebalance_after_tokens = rebalance_after_tokens
        self._pool_args = (num_threads, isa)
        self._pool = pool
        self._placements: dict[int, _Placement] = {}
        self._biases: dict[int, ExpertBias] = {}  # layer -> its experts' biases (GPT-OSS)
        self._counts: dict[int, torch.Tensor] = {}  # layer -> [E] int64 on the ids' device
        self._num_experts: dict[int, int] = {}
        self._buffers: _PinnedBuffers | None = None
        self._stats = HybridMoeStats()
        self._t_attach = time.perf_counter()
        self._load_s = {"read": 0.0, "convert": 0.0}  # attach: filling/reading, converting
        self._routed_tokens = 0
        self._rebalanced = False
        self._lock = threading.Lock()
        self.gguf_source: Path | None = None  # set by skip_expert_layers for a .gguf file
        self._gguf_layers: frozenset[int] = frozenset()  # its layers with stacked experts
        self._skipped: set[int] = set()  # layers whose expert tensors the loader did not read
        self.cache_source = Path(cache_source) if cache_source is not None else None
        self._cache_option = expert_cache
        self._cache: ExpertCache | None = None
        self.stream_ordered = stream_ordered
        self._spin_us = spin_us
        self._staging: list[_StreamStaging] = []  # the last one is in use; older: graphs
        self._on_cuda = False  # set by add_block: the default thread count depends on it
        self._torch_threads: int | None = None  # torch's CPU threads before `confine`

    # -- load --------------------------------------------------------------------------------

    @property
    def pool(self) -> CpuExpertPool:
        if self._pool is None:
            from tandem.ext.cpu import CpuExpertPool  # lazy: builds the extension on first use

            num_threads, isa = self._pool_args
            spin_us = self._spin_us if self._spin_us is not None else spin_us_from_env()
            if self._on_cuda:
                num_threads = num_threads or default_cuda_pool_threads()
            if spin_us is None:
                spin_us = CUDA_SPIN_US if self._on_cuda else CPU_SPIN_US
            self._pool = CpuExpertPool(num_threads, isa, spin_us=spin_us)
        return self._pool

    @property
    def supports_cuda_graphs(self) -> bool:
        """True when a CUDA forward enqueues no host wait: the stream-ordered path and the CUDA
        driver found. GPU-resident experts run densely at graph sizes (no host sync), and a
        rebalance rewrites their tensors in place."""
        if not self.stream_ordered:
            return False
        from tandem.ext.cpu import cuda_host_funcs_error, cuda_memops_error

        check = cuda_memops_error if self.sync == "flags" else cuda_host_funcs_error
        return check() is None

    @property
    def sync(self) -> str:
        """How stream-ordered calls reach the pool: "flags" (the stream writes and waits on
        pinned words, the pool polls) or "host_func" (cuLaunchHostFunc)."""
        if self._sync_option is not None:
            return self._sync_option
        from tandem.ext.cpu import cuda_memops_error

        return "flags" if cuda_memops_error() is None else "host_func"

    # -- forward -----------------------------------------------------------------------------

    @torch.compiler.disable  # pool calls by address; nothing for dynamo to trace
    @torch.no_grad()
    def forward(
        self,
        layer_idx: int,
        hidden: torch.Tensor,  # [T, H] model dtype, cpu or cuda
        topk_ids: torch.Tensor,  # [T, k] int64
        topk_weights: torch.Tensor,  # [T, k] float32
        w13: torch.Tensor,  # unused: the pool holds the experts
        w2: torch.Tensor,
        bias: ExpertBias | None = None,
    ) -> torch.Tensor:
        """`bias`: the layer's ExpertBias (GPT-OSS), which the pool and the GPU-resident experts
        took at `attach` (each call only checks that it did)."""
        return self.finish(self.start(layer_idx, hidden, topk_ids, topk_weights, bias))

    @torch.compiler.disable
    @torch.no_grad()
    def start(
        self,
        layer_idx: int,
        hidden: torch.Tensor,  # [T, H] model dtype, cpu or cuda
        topk_ids: torch.Tensor,  # [T, k] int64
        topk_weights: torch.Tensor,  # [T, k] float32
        bias: ExpertBias | None = None,
    ) -> _Pending:
        """Starts the layer's experts (on CUDA: enqueues them); `finish` returns the sum."""
        T = topk_ids.shape[0]
        counts = self._layer_counts(layer_idx)
        if (bias is None) != (layer_idx not in self._biases):
            raise RuntimeError(
                f"cpu_pool: layer {layer_idx} was attached "
                f"{'with' if bias is None else 'without'} expert biases but called "
                f"{'without' if bias is None else 'with'} them"
            )
        flat = topk_ids.reshape(-1)
        counts.scatter_add_(0, flat, torch.ones_like(flat))  # no host sync (bincount has one)
        place = self._placements.get(layer_idx)
        cpu_ids = (
            topk_ids if place is None else torch.where(place.local[topk_ids] >= 0, -1, topk_ids)
        )
        if hidden.device.type != "cuda":
            out = self._forward_cpu(layer_idx, hidden, cpu_ids, topk_ids, topk_weights, place)
            pending = _Pending(hidden, out=out)
        elif self._use_gpu_prefill(layer_idx, T):
            out = self._gpu_prefill.run(layer_idx, hidden, topk_ids, topk_weights)
            pending = _Pending(hidden, out=out)
        elif self.stream_ordered:
            pending = self._start_stream(layer_idx, hidden, cpu_ids, topk_ids, topk_weights, place)
        else:
            out = self._forward_cuda(layer_idx, hidden, cpu_ids, topk_ids, topk_weights, place)
            pending = _Pending(hidden, out=out)
        self._note_routed(layer_idx, T)
        return pending

    def _layer_counts(self, layer_idx: int) -> torch.Tensor:
        """The layer's routing counts [E] (on the router's device); its presence says the layer
        was attached."""
        counts = self._counts.get(layer_idx)
        if counts is None:
            raise RuntimeError(f"cpu_pool: layer {layer_idx} was not attached (load_model does it)")
        return counts

    def _forward_cpu(self, layer_idx, hidden, cpu_ids, topk_ids, topk_weights, place):
        x = hidden.float().contiguous()  # [T, H] f32
        ids = cpu_ids.contiguous()
        w = topk_weights.float().contiguous()
        out = torch.empty_like(x)
        t0 = time.perf_counter()
        self.pool.submit(layer_idx, x, ids, w, out)
        extra = None
        if place is not None:
            extra = _local_experts(
                hidden, place.local[topk_ids], w, place.w13, place.w2, place.bias
            )
        t1 = time.perf_counter()
        self.pool.sync()
        t2 = time.perf_counter()
        self._stats.layer_calls += 1
        self._stats.pool_wait_seconds += t2 - t1
        self._stats.pool_seconds += t2 - t0
        if extra is not None:
            out += extra
        return out

    # -- metrics and lifecycle ---------------------------------------------------------------

    def stats(self) -> HybridMoeStats:
        """A snapshot of the cumulative counters (copies; safe to keep)."""
        s = self._stats
        busy = self._pool.busy_seconds() if self._pool is not None else []
        # Stream-ordered calls are counted by the pool's host functions (graph replays too),
        # up to where the GPU has got.
        st = self._pool.stream_stats() if self._pool is not None else {}
        gp = self._gpu_prefill
        gp_calls, gp_bytes = (gp.calls, gp.h2d_bytes) if gp is not None else (0, 0)
        return HybridMoeStats(
            layer_calls=s.layer_calls + st.get("calls", 0) + gp_calls,
            gpu_prefill_calls=gp_calls,
            pool_wait_seconds=s.pool_wait_seconds + st.get("wait_ns", 0) * 1e-9,
            pool_seconds=s.pool_seconds + st.get("pool_ns", 0) * 1e-9,
            d2h_bytes=s.d2h_bytes + st.get("d2h_bytes", 0),
            h2d_bytes=s.h2d_bytes + st.get("h2d_bytes", 0) + gp_bytes,
            stream_errors=st.get("errors", 0),
            pool_threads=len(busy),
            pool_busy_seconds=sum(busy),
            wall_seconds=time.perf_counter() - self._t_attach,
            routing_counts={i: c.tolist() for i, c in sorted(self._counts.items())},
            gpu_experts={i: p.expert_ids.tolist() for i, p in sorted(self._placements.items())},
        )

    def close(self) -> None:
        """Closes the pool once no queued host function can still reach it. Graphs captured
        over this backend must not be replayed afterwards."""
        if self._pool is not None:
            if self._staging:
                torch.cuda.synchronize(self._staging[-1].rows_d.device)
            if self._gpu_prefill is not None:  # unpin before the pool frees the memory
                self._gpu_prefill.close()
                self._gpu_prefill = None
            self._pool.close()  # undoes confine_others
            if self._torch_threads is not None:
                torch.set_num_threads(self._torch_threads)
                self._torch_threads = None

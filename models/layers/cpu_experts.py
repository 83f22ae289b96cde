"""The "cpu_pool" expert backend: a MoE layer's experts live in the C++ CPU expert pool
(ext/cpu), optionally with each layer's most-routed experts kept on the GPU as well.

Owns expert placement, the host<->device traffic of the hybrid path and its counters. Knows
nothing about requests or scheduling. At load (`attach`) every MoE block hands its stacked
weights to the pool, which converts them (bf16, int8 or int4), and the block's torch copies
are replaced by empty tensors, so host memory holds the experts once. Before that, the loader
asks `skip_expert_layers` which layers' expert tensors it need not read at all: those found in
the expert cache (a header check) and a GGUF's stacked experts (converted from its blocks).

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
Graphs need all experts on the pool: GPU-resident experts sync on the host (`.tolist()`), so a
layer split between GPU and CPU keeps `supports_cuda_graphs` False and decodes eagerly.

`stream_ordered=False` keeps the older path: copy, wait on the host for the copy, submit, sync.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from tandem.models.layers.cpu_expert_options import (
    CONFINE_ENV,
    CPU_SPIN_US,
    CUDA_SPIN_US,
    FORMATS,
    FUSED_MOE_STAGE,
    GPU_PREFILL_ENV,
    GPU_PREFILL_MIN_TOKENS,
    GPU_PREFILL_TOKENS,
    SYNC_ENV,
    SYNC_MODES,
    default_cuda_pool_threads,
    num_gpu_experts,
    parse_cpu_experts,
    parse_gpu_prefill,
    spin_us_from_env,
)
from tandem.models.layers.experts import register_expert_backend
from tandem.models.layers.local_experts import _local_experts

if TYPE_CHECKING:
    from tandem.ext.cpu import CpuExpertPool, ExpertCache, StreamJob
    from tandem.models.layers.gpu_prefill import GpuExpertPrefill

logger = logging.getLogger(__name__)


def _shape(w13: torch.Tensor) -> tuple[int, int, int]:
    """(E, I, H) of a stacked w13 `[E, 2I, H]`."""
    return w13.shape[0], w13.shape[1] // 2, w13.shape[2]


@dataclass
class HybridMoeStats:
    """Cumulative counters of the hybrid path (monotonic since `attach`)."""

    layer_calls: int = 0  # MoE layer forwards through the backend
    pool_wait_seconds: float = 0.0  # caller blocked on the pool (copy wait + sync)
    pool_seconds: float = 0.0  # submit -> sync returned, summed over calls
    d2h_bytes: int = 0  # device -> pinned host (hidden, ids, weights)
    h2d_bytes: int = 0  # pinned host -> device (pool output, GPU expert weights)
    pool_threads: int = 0
    pool_busy_seconds: float = 0.0  # summed over worker threads
    wall_seconds: float = 0.0  # since attach
    stream_errors: int = 0  # stream-ordered calls that failed (output zeroed; see the pool)
    gpu_prefill_calls: int = 0  # layer calls computed on the GPU from the pool's weights
    routing_counts: dict[int, list[int]] = field(default_factory=dict)  # layer -> per expert
    gpu_experts: dict[int, list[int]] = field(default_factory=dict)  # layer -> ids on the GPU

    @property
    def pool_utilisation(self) -> float:
        """Fraction of the pool threads' time spent computing, since attach."""
        denom = self.wall_seconds * max(self.pool_threads, 1)
        return self.pool_busy_seconds / denom if denom > 0 else 0.0


@dataclass
class _Placement:
    """One layer's GPU-resident experts."""

    expert_ids: torch.Tensor  # [G] int64, device
    local: torch.Tensor  # [E] int64, device: index into w13/w2 below, -1 = CPU
    w13: torch.Tensor  # [G, 2I, H] model dtype, device
    w2: torch.Tensor  # [G, H, I]


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


class CpuPoolExpertBackend:
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

    def _blocks(self, model: nn.Module) -> list[nn.Module]:
        return [
            block
            for block in model.modules()
            if hasattr(block, "w13") and hasattr(block, "layer_idx") and block.backend is self
        ]

    def skip_expert_layers(
        self, model: nn.Module, checkpoint: str | Path, checkpoint_format: str
    ) -> frozenset[int]:
        """Asked by the loader before it reads any weight: the MoE layers whose routed-expert
        tensors it need not read. Those are the layers whose expert-cache entry passes its
        header check (no weight is mapped or read), and, for a GGUF file, every layer with
        stacked experts (`add_block` converts them from the file's own blocks). `attach` then
        maps or converts them; it must be given `read_experts` in case an entry has gone bad
        in between. Records `checkpoint` as the cache's source identity. For safetensors,
        every other layer too: `attach` reads each right before converting it, so one layer's
        host copy exists at a time (a 671B checkpoint's experts never fit at once). For random
        weights ("dummy") every layer: `read_experts` fills each right before it is converted,
        and nothing is cached."""
        checkpoint = Path(checkpoint)
        self._skipped = set()
        if checkpoint_format == "dummy":
            self._cache_option = False
            self._skipped = {block.layer_idx for block in self._blocks(model)}
            return frozenset(self._skipped)
        if checkpoint_format == "gguf":
            from tandem.models.gguf_reader import GGUFReader
            from tandem.models.loader.gguf_experts import gguf_expert_layers

            self.gguf_source = checkpoint
            self._gguf_layers = frozenset(gguf_expert_layers(GGUFReader(checkpoint)))
        elif self.cache_source is None:
            self.cache_source = checkpoint
        blocks = list(self._blocks(model))
        cache = self._expert_cache(dtype=blocks[0].w13.dtype if blocks else None)
        for block in blocks:
            layer, w13, w2 = block.layer_idx, block.w13, block.w2
            if layer in self._gguf_layers or (
                cache is not None
                and cache.check(layer, self._layer_key(cache, layer, w13, w2), _shape(w13))
            ):
                self._skipped.add(layer)
            elif checkpoint_format == "safetensors":
                # read right before its conversion (attach): one layer's copy at a time
                self._skipped.add(layer)
        return frozenset(self._skipped)

    @torch.no_grad()
    def attach(self, model: nn.Module, read_experts: Callable[[int], None] | None = None) -> None:
        """Moves every MoE block's experts into the pool (converting them, or mapping them
        from the expert cache) and frees the torch copies; keeps each layer's first `gpu`
        experts on the model's device until routing counts say which are hottest
        (`rebalance`). `read_experts(layer)` fills a block's w13/w2 from the checkpoint: the
        fall-back for a layer `skip_expert_layers` left unread whose cache entry went bad."""
        t0 = time.perf_counter()
        for block in self._blocks(model):
            self.add_block(block, read_experts)
        self._t_attach = time.perf_counter()
        if self._num_experts:
            self.confine()
            info = self.pool.info()
            logger.info(
                "cpu_pool: %d MoE layers (%s, %.2f GB) in %.1fs (reading %.1fs, converting "
                "%.1fs), kernels %s/%s%s, %d threads on %d NUMA node(s)%s, %d experts a layer on "
                "the GPU",
                len(info["layers"]),
                "+".join(sorted(info["bytes_per_format"])),
                sum(info["bytes_per_format"].values()) / 1e9,
                self._t_attach - t0,
                self._load_s["read"],
                self._load_s["convert"],
                info["isa"],
                info["int_isa"] or "-",
                ", packed rows" if info["pack_rows"] else "",
                info["num_threads"],
                len(info["numa_nodes"]),
                f", sync {self.sync}" if self._on_cuda else "",
                num_gpu_experts(
                    max(self._num_experts.values()), self.cpu_experts, self.gpu_experts
                ),
            )

    def confine(self) -> list[int]:
        """On CUDA (unless TANDEM_POOL_CONFINE=off): every thread of the process but the pool's
        pinned ones onto the cpus the workers leave, and torch's CPU threads to that many;
        called by `attach` once the experts are in. A decode step waits on the slowest worker
        of each layer's job, and an unpinned thread of the server (the event loop, the
        scheduler, the CUDA driver) landing on a worker's core delays that job by a time slice
        (Qwen3-30B-A3B shape, int4, `tandem serve` on the H100 machine, same call: batch-1
        decode 58.4 tok/s unconfined, 64.1 confined; docs/BENCHMARKS.md). Returns the cpus,
        empty where nothing changed."""
        from tandem.ext.cpu.pool import switch_from_env

        if not self._on_cuda or switch_from_env(CONFINE_ENV) is False:
            return []
        cpus = self.pool.confine_others()
        if cpus:
            if self._torch_threads is None:
                self._torch_threads = torch.get_num_threads()
            torch.set_num_threads(len(cpus))
            logger.info("cpu_pool: the process's other threads confined to cpus %s", cpus)
        return cpus

    @torch.no_grad()
    def add_block(
        self, block: nn.Module, read_experts: Callable[[int], None] | None = None
    ) -> None:
        layer, w13, w2 = block.layer_idx, block.w13, block.w2
        # the router and the shared expert live on the model's device (the pool's thread count
        # depends on it; decided before the first access to `pool` below)
        self._on_cuda = self._on_cuda or any(p.is_cuda for p in block.parameters())
        E = w13.shape[0]
        device = block.gate.weight.device
        unread = layer in self._skipped  # the loader left w13/w2 uninitialized
        cache = self._expert_cache(None if unread else (w13, w2), w13.dtype)
        key = self._layer_key(cache, layer, w13, w2) if cache is not None else ""
        if cache is None or not cache.load(self.pool, layer, key, _shape(w13)):
            if layer in self._gguf_layers:  # from the file's own blocks, decoded to fp32
                from tandem.models.loader.gguf_experts import load_gguf_experts

                load_gguf_experts(
                    self.gguf_source, self.pool, self.fmt, [layer], self._group_option
                )
            else:
                if unread:
                    if read_experts is None:
                        raise RuntimeError(
                            f"cpu_pool: layer {layer}'s experts were not read and its cache "
                            "entry is unusable; attach needs read_experts"
                        )
                    if cache is not None:
                        logger.warning(
                            "expert cache: re-reading layer %d's experts from the checkpoint",
                            layer,
                        )
                    t_read = time.perf_counter()
                    read_experts(layer)
                    self._load_s["read"] += time.perf_counter() - t_read
                    w13, w2 = block.w13, block.w2
                fmt = "bf16" if self.fmt == "auto" else self.fmt
                w13_h, w2_h = w13.detach().cpu(), w2.detach().cpu()
                t_convert = time.perf_counter()
                self.pool.add_layer(layer, w13_h, w2_h, fmt, self.group_size)
                self._load_s["convert"] += time.perf_counter() - t_convert
            if cache is not None:
                cache.save(self.pool, layer, key)
        self._num_experts[layer] = E
        self._counts[layer] = torch.zeros(E, dtype=torch.int64, device=device)
        gpu = num_gpu_experts(E, self.cpu_experts, self.gpu_experts)
        if gpu:
            self._place(layer, torch.arange(gpu), w13.dtype, device)
        # Free the torch copies: the pool holds the experts now.
        empty13 = torch.empty(E, 0, w13.shape[2], dtype=w13.dtype, device=w13.device)
        empty2 = torch.empty(E, w2.shape[1], 0, dtype=w2.dtype, device=w2.device)
        block.w13 = nn.Parameter(empty13, requires_grad=False)
        block.w2 = nn.Parameter(empty2, requires_grad=False)

    def _layer_key(
        self, cache: ExpertCache, layer: int, w13: torch.Tensor, w2: torch.Tensor
    ) -> str:
        """Besides shapes, what the converted bytes depend on: nothing more for a GGUF layer
        (converted from the file's blocks), the dtype the loader casts a checkpoint to, or,
        without a checkpoint file, a sampled fingerprint of the weights themselves."""
        if layer in self._gguf_layers:
            weights_id = "gguf"
        elif self.gguf_source is not None or self.cache_source is not None:
            weights_id = f"file:{w13.dtype}"
        else:
            from tandem.ext.cpu.cache import weights_fingerprint

            weights_id = f"weights:{weights_fingerprint(w13, w2)}"
        return cache.layer_key(layer, tuple(w13.shape), tuple(w2.shape), weights_id)

    def _expert_cache(
        self,
        weights: tuple[torch.Tensor, torch.Tensor] | None = None,
        dtype: torch.dtype | None = None,
    ) -> ExpertCache | None:
        """The cache of this model, made at the first call (None when off or unwritable, or
        when there is neither a checkpoint file nor `weights` to key it by). A checkpoint
        loaded in another dtype (`dtype`, what the loader casts the experts to) converts to
        other bytes, so it gets its own directory: runs in float32 and bf16 keep one each
        instead of overwriting each other."""
        if self._cache is not None or self._cache_option is False:
            return self._cache
        from tandem.ext.cpu import ExpertCache, default_cache_root, source_identity
        from tandem.ext.cpu.cache import weights_fingerprint

        src = self.gguf_source or self.cache_source
        if src is None and weights is None:
            return None
        if self._cache_option is None or self._cache_option is True:
            root = default_cache_root()
        else:
            root = Path(self._cache_option)
        if root is None:
            self._cache_option = False
            return None
        if src is None:
            source = f"weights:{weights_fingerprint(*weights)}"
        elif self.gguf_source is None and dtype is not None:
            source = f"file:{source_identity(src)}:{dtype}"
        else:  # GGUF experts convert from the file's own blocks, whatever the model's dtype
            source = f"file:{source_identity(src)}"
        # "auto" converts float weights to bf16: one entry for both spellings, not two copies
        # of the same bytes (a GGUF's "auto" keeps each layer's own format, so stays "auto")
        fmt = "bf16" if self.fmt == "auto" and self.gguf_source is None else self.fmt
        self._cache = ExpertCache(root, source, fmt, self.group_size)
        return self._cache

    def _place(
        self,
        layer: int,
        expert_ids: torch.Tensor,  # [G] int64, CPU
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        """Puts `expert_ids` of the layer on `device`, from the pool's weights (what the pool
        computes with): the same whether the layer was converted or mapped from the cache."""
        E = self._num_experts[layer]
        local = torch.full((E,), -1, dtype=torch.int64)
        local[expert_ids] = torch.arange(len(expert_ids))
        p13, p2 = self.pool.dequantize(layer, expert_ids.tolist())  # [G, ...] fp32
        g13 = p13.to(device=device, dtype=dtype)
        g2 = p2.to(device=device, dtype=dtype)
        del p13, p2
        if device.type == "cuda":
            self._stats.h2d_bytes += (
                g13.numel() * g13.element_size() + g2.numel() * g2.element_size()
            )
        old = self._placements.get(layer)
        if old is not None and old.w13.shape == g13.shape and old.w2.shape == g2.shape:
            # in place: captured CUDA graphs read these tensors by address
            old.expert_ids.copy_(expert_ids)
            old.local.copy_(local)
            old.w13.copy_(g13)
            old.w2.copy_(g2)
            return
        self._placements[layer] = _Placement(expert_ids.to(device), local.to(device), g13, g2)

    @torch.no_grad()
    def rebalance(self, counts: dict[int, torch.Tensor] | None = None) -> None:
        """Keeps each layer's most-routed experts (by `counts`, default the counts gathered so
        far) on the GPU; the pool keeps every expert, GPU-placed ones just get id -1."""
        counts = counts or self._counts
        if self._staging:  # host functions of queued layers may still use the pool
            torch.cuda.synchronize(self._staging[-1].rows_d.device)
        for layer, place in list(self._placements.items()):
            G = len(place.expert_ids)
            hottest = torch.topk(counts[layer].cpu().float(), G).indices.sort().values
            if torch.equal(hottest, place.expert_ids.cpu()):
                continue
            self._place(layer, hottest, place.w13.dtype, place.w13.device)

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
    ) -> torch.Tensor:
        return self.finish(self.start(layer_idx, hidden, topk_ids, topk_weights))

    @torch.compiler.disable
    @torch.no_grad()
    def start(
        self,
        layer_idx: int,
        hidden: torch.Tensor,  # [T, H] model dtype, cpu or cuda
        topk_ids: torch.Tensor,  # [T, k] int64
        topk_weights: torch.Tensor,  # [T, k] float32
    ) -> _Pending:
        """Starts the layer's experts (on CUDA: enqueues them); `finish` returns the sum."""
        T = topk_ids.shape[0]
        counts = self._layer_counts(layer_idx)
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

    def gpu_prefill_tokens(self, layer_idx: int) -> int:
        """From how many tokens a CUDA step computes this layer on the GPU (0: never; else at
        least GPU_PREFILL_MIN_TOKENS)."""
        n = self._gpu_prefill_option
        if n is None:
            n = GPU_PREFILL_TOKENS.get(self.pool.layer_format(layer_idx)[0], 0)
        return max(n, GPU_PREFILL_MIN_TOKENS) if n else 0

    def _use_gpu_prefill(self, layer_idx: int, tokens: int) -> bool:
        """Whether this CUDA call goes to the GPU from the pool's weights: enough tokens, not
        inside a graph capture (decode graphs keep the pool), and the path set up."""
        n = self.gpu_prefill_tokens(layer_idx)
        if not n or tokens < n or self._gpu_prefill_failed:
            return False
        if torch.cuda.is_current_stream_capturing():
            return False
        if self._gpu_prefill is None:
            try:
                from tandem.models.layers.gpu_prefill import GpuExpertPrefill

                device = self._layer_counts(layer_idx).device
                self._gpu_prefill = GpuExpertPrefill(self.pool, sorted(self._counts), device)
                self._gpu_prefill.layer_bytes(layer_idx)  # the pool's layout is readable
            except Exception as e:  # noqa: BLE001 - fall back to the pool, loudly
                self._gpu_prefill_failed = True
                logger.warning("cpu_pool: GPU prefill unavailable, the pool computes: %s", e)
                return False
        return True

    def _layer_counts(self, layer_idx: int) -> torch.Tensor:
        """The layer's routing counts [E] (on the router's device); its presence says the layer
        was attached."""
        counts = self._counts.get(layer_idx)
        if counts is None:
            raise RuntimeError(f"cpu_pool: layer {layer_idx} was not attached (load_model does it)")
        return counts

    def _note_routed(self, layer_idx: int, tokens: int) -> None:
        """Counts routed tokens (on the first MoE layer) and rebalances once when due."""
        if layer_idx == min(self._counts):
            self._routed_tokens += tokens
            if (
                self._placements
                and not self._rebalanced
                and self.rebalance_after_tokens
                and self._routed_tokens >= self.rebalance_after_tokens
            ):
                self._rebalanced = True
                self.rebalance()

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
            extra = _local_experts(hidden, place.local[topk_ids], topk_weights, place.w13, place.w2)
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

    def _forward_cpu(self, layer_idx, hidden, cpu_ids, topk_ids, topk_weights, place):
        x = hidden.float().contiguous()  # [T, H] f32
        ids = cpu_ids.contiguous()
        w = topk_weights.float().contiguous()
        out = torch.empty_like(x)
        t0 = time.perf_counter()
        self.pool.submit(layer_idx, x, ids, w, out)
        extra = None
        if place is not None:
            extra = _local_experts(hidden, place.local[topk_ids], w, place.w13, place.w2)
        t1 = time.perf_counter()
        self.pool.sync()
        t2 = time.perf_counter()
        self._stats.layer_calls += 1
        self._stats.pool_wait_seconds += t2 - t1
        self._stats.pool_seconds += t2 - t0
        if extra is not None:
            out += extra
        return out

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
            extra = _local_experts(hidden, place.local[topk_ids], topk_weights, place.w13, place.w2)
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


def hybrid_moe_stats(model: nn.Module) -> HybridMoeStats | None:
    """The hybrid counters of a loaded model, or None when its experts are not on the pool."""
    backend = getattr(model, "expert_backend", None)
    return backend.stats() if isinstance(backend, CpuPoolExpertBackend) else None


def hybrid_moe_metrics(model: nn.Module) -> dict[str, Any]:
    """Flat Prometheus-style samples: name -> value, or name -> {label value: value}."""
    s = hybrid_moe_stats(model)
    if s is None:
        return {}
    return {
        "tandem_moe_pool_wait_seconds_total": s.pool_wait_seconds,
        "tandem_moe_pool_seconds_total": s.pool_seconds,
        "tandem_moe_layer_calls_total": s.layer_calls,
        "tandem_moe_d2h_bytes_total": s.d2h_bytes,
        "tandem_moe_h2d_bytes_total": s.h2d_bytes,
        "tandem_moe_pool_threads": s.pool_threads,
        "tandem_moe_pool_busy_seconds_total": s.pool_busy_seconds,
        "tandem_moe_pool_utilisation": s.pool_utilisation,
        "tandem_moe_stream_errors_total": s.stream_errors,
        "tandem_moe_gpu_prefill_calls_total": s.gpu_prefill_calls,
        "tandem_moe_expert_routed_total": {
            (layer, e): n for layer, c in s.routing_counts.items() for e, n in enumerate(c)
        },
    }


register_expert_backend("cpu_pool", CpuPoolExpertBackend)

"""`CpuExpertPool`: the Python face of the C++ expert pool (ext/cpu/*.cpp).

Validates every tensor before its address reaches C++, keeps the tensors of the call in flight
alive until `sync()`, and reads TANDEM_CPU_ISA. Knows nothing about requests or model classes.
Its stream-ordered jobs (the CUDA path) are in stream_jobs.py, its environment knobs in
pool_env.py and the argument checks in tensor_checks.py.
"""

from __future__ import annotations

import ctypes
import os
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .build import load_extension
from .layout import K_ALIGN, ShardLayout
from .pool_env import (  # noqa: F401  (re-exported: ext.cpu.pool.X stays valid)
    AMX_BF16_ENV,
    AMX_TILE_ENV,
    INT_PATH_ENV,
    ISA_ENV,
    ISAS,
    PACK_ROWS_ENV,
    _check_amx_tile_env,
    _int_min_tokens_from_env,
    _pack_rows_from_env,
    isa_from_env,
    switch_from_env,
)
from .stream_jobs import (  # noqa: F401
    FLAG_WORDS,
    StreamJob,
    StreamJobMethods,
    cuda_host_funcs_error,
    cuda_memops_error,
)
from .tensor_checks import _check_cpu_tensor, _non_negative_int, _overlaps

_FORMATS = {"bf16": 0, "int8": 1, "int4": 2}
_FORMAT_NAMES = {v: k for k, v in _FORMATS.items()}
_SRC_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def supported_isas() -> list[str]:
    """ISAs this CPU and build can run, slowest first ("scalar" always)."""
    return list(load_extension().supported_isas())


def _set_masks(which: Callable[[set[int]], bool], cpus: set[int]) -> None:
    """Sets the cpu mask of every thread of this process whose mask `which` accepts."""
    for tid in os.listdir("/proc/self/task"):
        try:
            if which(os.sched_getaffinity(int(tid))):
                os.sched_setaffinity(int(tid), cpus)
        except OSError:  # the thread has exited, or the mask is not ours to set
            continue


def check_layer_file(
    path: str | Path,
    *,
    key: str | None = None,
    shape: tuple[int, int, int] | None = None,  # (E, I, H) expected
    fmt: str | None = None,
    group_size: int | None = None,
) -> None:
    """The checks of `CpuExpertPool.load_layer` (header, expected key / shape / format, file
    size, sampled data lines) without mapping the weights or needing a pool: reads the 4 KiB
    header and 1,025 lines of 64 bytes. Raises ValueError naming the mismatch, as load_layer
    would."""
    load_extension().check_layer_file(*_layer_file_args(path, key, shape, fmt, group_size))


def _layer_file_args(
    path: str | Path,
    key: str | None,
    shape: tuple[int, int, int] | None,
    fmt: str | None,
    group_size: int | None,
) -> tuple:
    """The extension's (path, has_key, key, E, I, H, fmt code, group) for a layer file check
    (-1: not checked). Raises ValueError for an unknown format."""
    if fmt is not None and fmt not in _FORMATS:
        raise ValueError(f"fmt must be one of {tuple(_FORMATS)}, got {fmt!r}")
    E, inter, H = shape if shape is not None else (-1, -1, -1)
    return (
        str(path),
        key is not None,
        key or "",
        E,
        inter,
        H,
        _FORMATS[fmt] if fmt is not None else -1,
        group_size if group_size is not None else -1,
    )


class CpuExpertPool(StreamJobMethods):
    """MoE experts on the CPU: one fused call per layer and step, run on pinned worker threads.

    Contract: `submit` returns at once; the tensors passed to it must not be modified (and `out`
    not read) until `sync` returns. One call is in flight per pool; a second `submit` first waits
    for the previous one. Use one pool per caller thread, or serialize calls.
    """

    def __init__(
        self,
        num_threads: int | None = None,
        isa: str | None = None,
        *,
        split_nodes: int = 0,
        spin_us: int | None = None,
        int_min_tokens: int | None = None,
        pack_rows: bool | None = None,
    ) -> None:
        """`split_nodes` > 0 (tests): pretend the allowed cpus form that many NUMA nodes.
        `int_min_tokens`: int8/int4 experts with at least this many tokens in a call multiply
        the quantized weights as integers (`int_isa`: "vnni" on AVX-512 VNNI, "amx-int8" on
        AMX; activations quantized to int8 per 32-element block, or to 16 bits per token in the
        AMX tiles on packed int8 rows: `int_tiles_from`); 0: never; None: $TANDEM_CPU_INT_PATH,
        else the C++ default where the CPU has the path.
        `pack_rows`: store int8/int4 rows of layers converted from now on in the order the
        integer path's 1-token kernel reads (ext/cpu/kernels.h: packed_at); None:
        $TANDEM_CPU_PACK_ROWS (auto|on|off), auto: where the CPU has the integer path.
        Other paths unpack a work item's rows first.
        `spin_us`: how long idle workers (and a waiting caller) spin before they sleep (None:
        the C++ default, 200; 0: sleep at once). A forward's layers come tens of microseconds
        apart, so spinning keeps the workers hot from one layer's job to the next."""
        if num_threads is not None and (not isinstance(num_threads, int) or num_threads < 1):
            raise ValueError(f"num_threads must be a positive int or None, got {num_threads!r}")
        isa = isa_from_env(isa)
        _check_amx_tile_env()
        ext = load_extension()
        # ValueError if unavailable
        self._pool = ext.ExpertPool(num_threads or 0, isa or "", int(split_nodes))
        self._confined: tuple[set[int], set[int]] | None = None  # (mask before, spare cpus)
        if spin_us is not None:
            self.spin_us = spin_us
        if int_min_tokens is None:
            int_min_tokens = _int_min_tokens_from_env()
        if int_min_tokens is not None:
            self.int_min_tokens = int_min_tokens
        if pack_rows is None:
            pack_rows = _pack_rows_from_env()
        if pack_rows is not None:
            self.pack_rows = pack_rows
        self._layers: dict[int, tuple[int, int, int, str, int]] = {}  # E, I, H, fmt, group
        self._inflight: tuple[torch.Tensor, ...] | None = None
        self._stream_tensors: list[tuple[torch.Tensor | None, ...]] = []  # of stream jobs
        self._lock = threading.Lock()
        self._unmap_hooks: list[Callable[[], None]] = []
        self.layers_converted = 0  # add_layer calls (conversion work done)
        self.layers_loaded = 0  # load_layer calls that installed a saved layer

    # -- weights ---------------------------------------------------------------------------

    def add_layer(
        self,
        layer_idx: int,
        w13: torch.Tensor,  # [E, 2I, H] gate rows then up rows; fp32/bf16/fp16, CPU
        w2: torch.Tensor,  # [E, H, I]
        fmt: str = "bf16",
        group_size: int = 64,
    ) -> None:
        """Converts one layer's experts to `fmt` ("bf16", "int8" per row, "int4" per group of
        `group_size` in {32, 64}); each NUMA node's workers write their own shard. Replaces an
        existing layer of the same index."""
        pool = self._live()
        if fmt not in _FORMATS:
            raise ValueError(f"fmt must be one of {tuple(_FORMATS)}, got {fmt!r}")
        if fmt == "int4" and group_size not in (32, 64):
            raise ValueError(f"int4 group_size must be 32 or 64, got {group_size}")
        if not isinstance(layer_idx, int) or layer_idx < 0:
            raise ValueError(f"layer_idx must be a non-negative int, got {layer_idx!r}")
        dtypes = tuple(_SRC_DTYPES)
        _check_cpu_tensor("w13", w13, dtypes, 3)
        _check_cpu_tensor("w2", w2, dtypes, 3)
        E, two_i, H = w13.shape
        if two_i % 2 or two_i == 0 or E == 0 or H == 0:
            raise ValueError(f"w13 must be [E, 2I, H] with E, I, H > 0, got {tuple(w13.shape)}")
        inter = two_i // 2
        if tuple(w2.shape) != (E, H, inter):
            raise ValueError(f"w2 must be [E, H, I] = {(E, H, inter)}, got {tuple(w2.shape)}")
        if w2.dtype != w13.dtype:
            w2 = w2.to(w13.dtype)
        w13, w2 = w13.contiguous(), w2.contiguous()
        self._before_unmap(layer_idx)
        with self._lock:
            self._inflight = None
            pool.add_layer(
                layer_idx,
                w13.data_ptr(),
                w2.data_ptr(),
                _SRC_DTYPES[w13.dtype],
                E,
                inter,
                H,
                _FORMATS[fmt],
                group_size if fmt == "int4" else 0,
            )
            self._layers[layer_idx] = (E, inter, H, fmt, group_size if fmt == "int4" else 0)
            self.layers_converted += 1

    def save_layer(self, layer_idx: int, path: str | Path, key: str = "") -> None:
        """Writes the layer's converted weights (the pool's own layout: packed rows + scales,
        after a 4 KiB header holding shapes, format, `key` and a checksum) to `path`, atomically:
        a temporary file in the same directory, fsynced, then renamed over `path`."""
        pool = self._live()
        self._layer(layer_idx)
        path = Path(path)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            with self._lock:
                self._inflight = None
                pool.save_layer(layer_idx, str(tmp), key)  # RuntimeError on an OS error
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)

    def load_layer(
        self,
        layer_idx: int,
        path: str | Path,
        *,
        key: str | None = None,
        shape: tuple[int, int, int] | None = None,  # (E, I, H) expected
        fmt: str | None = None,
        group_size: int | None = None,
    ) -> None:
        """Installs a layer written by `save_layer` instead of converting one (replacing any
        layer of the same index). With one NUMA node the file is memory-mapped read-only and
        paged in on first use; with several, each node's workers copy their shard into local
        memory. Raises ValueError (nothing installed) when the file is missing, short,
        corrupted, or its key / shape / format differ from the ones given."""
        pool = self._live()
        if not isinstance(layer_idx, int) or layer_idx < 0:
            raise ValueError(f"layer_idx must be a non-negative int, got {layer_idx!r}")
        args = _layer_file_args(path, key, shape, fmt, group_size)
        self._before_unmap(layer_idx)
        with self._lock:
            self._inflight = None
            pool.load_layer(layer_idx, *args)
            E, inter, H, fmt_code, group = pool.layer_shape(layer_idx)
            self._layers[layer_idx] = (E, inter, H, _FORMAT_NAMES[fmt_code], group)
            self.layers_loaded += 1

    def set_expert_act(
        self,
        layer_idx: int,
        b13: torch.Tensor | None = None,  # [E, 2I] gate then up, CPU
        b2: torch.Tensor | None = None,  # [E, H]
        clamped_swiglu: tuple[float, float] | None = None,  # (alpha, limit)
    ) -> None:
        """Sets the layer's expert biases and activation: SiLU(gate) * up, or GPT-OSS's clamped
        SwiGLU `(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)`, g = min(gate, limit).
        The biases are added to each expert's gate/up and down outputs, before the activation
        and before the routing weight. Kept until the layer is replaced (add_layer, load_layer
        reset it to bias-free SiLU)."""
        pool = self._live()
        E, inter, H, _, _ = self._layer(layer_idx)
        kind, alpha, limit = 0, 1.0, 0.0
        if clamped_swiglu is not None:
            alpha, limit = (float(v) for v in clamped_swiglu)
            if not limit > 0:
                raise ValueError(f"the clamped SwiGLU's limit must be positive, got {limit}")
            kind = 1
        kept = []
        for name, t, shape in (("b13", b13, (E, 2 * inter)), ("b2", b2, (E, H))):
            if t is None:
                kept.append(None)
                continue
            if t.device.type != "cpu" or tuple(t.shape) != shape:
                raise ValueError(f"{name} must be a CPU tensor of shape {shape}, got "
                                 f"{tuple(t.shape)} on {t.device}")  # fmt: skip
            kept.append(t.detach().float().contiguous())
        with self._lock:
            self._inflight = None
            pool.set_expert_act(
                layer_idx,
                kept[0].data_ptr() if kept[0] is not None else 0,
                kept[1].data_ptr() if kept[1] is not None else 0,
                kind,
                alpha,
                limit,
            )

    def layer_format(self, layer_idx: int) -> tuple[str, int]:
        """(format, int4 group size or 0) of an added layer."""
        _, _, _, fmt, group = self._layer(layer_idx)
        return fmt, group

    def dequantize(
        self, layer_idx: int, experts: list[int] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's weights as the kernels use them: (w13 [E, 2I, H], w2 [E, H, I]) fp32;
        with `experts`, only those, in that order ([len(experts), ...])."""
        pool = self._live()
        E, inter, H, _, _ = self._layer(layer_idx)
        ids = [int(e) for e in experts] if experts is not None else []
        if experts is not None and not all(0 <= e < E for e in ids):
            raise ValueError(f"expert ids must lie in [0, {E}), got {ids}")
        n = len(ids) if experts is not None else E
        w13 = torch.empty(n, 2 * inter, H, dtype=torch.float32)
        w2 = torch.empty(n, H, inter, dtype=torch.float32)
        if n == 0:
            return w13, w2
        with self._lock:
            pool.dequantize(layer_idx, w13.data_ptr(), w2.data_ptr(), ids)
        return w13, w2

    def on_unmap(self, hook: Callable[[], None]) -> None:
        """Calls `hook()` before any layer's memory goes away (a layer replaced, the pool
        closed): whoever page-locked or mapped `shard_memory` regions (the GPU prefill path)
        releases them there. Each hook runs once, then is dropped."""
        self._unmap_hooks.append(hook)

    def _before_unmap(self, layer_idx: int | None = None) -> None:
        if layer_idx is not None and layer_idx not in self._layers:
            return  # a new layer: nothing of it was handed out
        hooks, self._unmap_hooks = self._unmap_hooks, []
        for hook in hooks:
            hook()

    def layer_shards(self, layer_idx: int) -> list[ShardLayout]:
        """Where the layer's converted weights live: one region per NUMA node shard, with its
        layout (ext/cpu/layout.py). Valid until the layer is replaced or the pool closed."""
        pool = self._live()
        E, _, H, fmt, group = self._layer(layer_idx)
        hp = -(-H // K_ALIGN) * K_ALIGN
        return [
            ShardLayout(E=E, H=H, Hp=hp, fmt=fmt, group=group, **d)
            for d in pool.layer_shards(layer_idx)
        ]

    def shard_memory(self, shard: ShardLayout) -> torch.Tensor:
        """The shard's region as a uint8 CPU tensor over the pool's memory (no copy). Read
        only; it must not outlive the layer (replacing the layer or closing the pool unmaps
        it)."""
        self._live()
        if shard.nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        buf = (ctypes.c_uint8 * shard.nbytes).from_address(shard.ptr)
        with warnings.catch_warnings():  # read-only cached layers: torch warns, we only read
            warnings.simplefilter("ignore")
            return torch.frombuffer(buf, dtype=torch.uint8)

    # -- compute ---------------------------------------------------------------------------

    def submit(
        self,
        layer_idx: int,
        hidden: torch.Tensor,  # [T, H] float32, CPU, contiguous
        topk_ids: torch.Tensor,  # [T, k] int64 or int32; -1 skips a slot
        topk_weights: torch.Tensor,  # [T, k] float32
        out: torch.Tensor,  # [T, H] float32; may be `hidden` itself
    ) -> None:
        """Starts out = sum_j topk_weights[:, j] * expert_{topk_ids[:, j]}(hidden) and returns."""
        pool = self._live()
        _, _, H, _, _ = self._layer(layer_idx)
        _check_cpu_tensor("hidden", hidden, (torch.float32,), 2)
        _check_cpu_tensor("topk_ids", topk_ids, (torch.int64, torch.int32), 2)
        _check_cpu_tensor("topk_weights", topk_weights, (torch.float32,), 2)
        _check_cpu_tensor("out", out, (torch.float32,), 2)
        T = hidden.shape[0]
        if hidden.shape[1] != H:
            raise ValueError(f"hidden must be [T, {H}], got {tuple(hidden.shape)}")
        if topk_ids.shape[0] != T or topk_ids.shape[1] < 1:
            raise ValueError(f"topk_ids must be [{T}, k>=1], got {tuple(topk_ids.shape)}")
        if tuple(topk_weights.shape) != tuple(topk_ids.shape):
            raise ValueError(
                f"topk_weights must be {tuple(topk_ids.shape)}, got {tuple(topk_weights.shape)}"
            )
        if tuple(out.shape) != (T, H):
            raise ValueError(f"out must be [{T}, {H}], got {tuple(out.shape)}")
        for name, t in (
            ("hidden", hidden),
            ("topk_ids", topk_ids),
            ("topk_weights", topk_weights),
            ("out", out),
        ):
            if not t.is_contiguous():
                raise ValueError(f"{name} must be contiguous")
        if out.data_ptr() != hidden.data_ptr() and _overlaps(out, hidden):
            raise ValueError("out partially overlaps hidden")
        with self._lock:
            pool.submit(
                layer_idx,
                hidden.data_ptr(),
                topk_ids.data_ptr(),
                topk_ids.dtype == torch.int64,
                topk_weights.data_ptr(),
                out.data_ptr(),
                T,
                topk_ids.shape[1],
            )
            self._inflight = (hidden, topk_ids, topk_weights, out)

    def sync(self) -> None:
        """Waits for the last submit (no-op when none is in flight)."""
        pool = self._live()
        pool.sync()
        self._inflight = None

    def forward(
        self,
        layer_idx: int,
        hidden: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """submit + sync; allocates `out` when not given and returns it."""
        if out is None:
            _check_cpu_tensor("hidden", hidden, (torch.float32,), 2)
            out = torch.empty_like(hidden)
        self.submit(layer_idx, hidden, topk_ids, topk_weights, out)
        self.sync()
        return out

    @property
    def spin_us(self) -> int:
        return self._live().spin_us

    @spin_us.setter
    def spin_us(self, value: int) -> None:
        self._live().spin_us = _non_negative_int("spin_us", value)

    @property
    def int_isa(self) -> str:
        """The integer path of this pool ("vnni", "amx-int8"), or "" where the ISA has none."""
        return self._live().int_isa

    @property
    def int_tiles_from(self) -> int:
        """Tokens of one expert from which the integer path multiplies in AMX tiles (int8
        weights then take 16-bit activations: ext/cpu/reference.py int_path_activations); 0:
        no tiles."""
        return self._live().int_tiles_from

    @property
    def int_min_tokens(self) -> int:
        return self._live().int_min_tokens

    @int_min_tokens.setter
    def int_min_tokens(self, value: int) -> None:
        _non_negative_int("int_min_tokens", value)
        if value > 0 and not self.int_isa:
            raise ValueError(f"no integer path for CPU ISA {self._live().isa!r}")
        self._live().int_min_tokens = value

    @property
    def pack_rows(self) -> bool:
        return self._live().pack_rows

    @pack_rows.setter
    def pack_rows(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise ValueError(f"pack_rows must be a bool, got {value!r}")
        self._live().pack_rows = value

    def layer_packed(self, layer_idx: int) -> bool:
        """Whether the layer's int8/int4 rows are stored in the packed order."""
        self._layer(layer_idx)
        return self._live().layer_packed(layer_idx)

    def phase_stats(self) -> dict[str, Any]:
        """Where the calls' time went since the last `reset_phase_stats` (ns, summed over
        calls): route_ns (submit on the caller), job_ns (submit to last worker done), wall_ns
        per phase (worker 0's view) and busy_ns per phase (summed over workers); phases: wake,
        prep_x, gate_up, silu (inside gate_up), prep_act, down, reduce, stall (workers waiting
        for an expert's prepared inputs). The preps overlap other experts' gate/up work, so
        their walls stay 0: gate_up's wall runs from the wake to worker 0's first down item,
        down's to the end of every down item (ext/cpu/moe.h: Phase). int_experts /
        float_experts and int_items / float_items count which path the experts and gemm work
        items took."""
        return dict(self._live().phase_stats())

    def reset_phase_stats(self) -> None:
        self._live().reset_phase_stats()

    # -- lifecycle and introspection -------------------------------------------------------

    def busy_seconds(self) -> list[float]:
        """Seconds each worker thread has spent inside jobs (conversion and MoE steps) since the
        pool started; divide by wall time for utilisation."""
        return [ns * 1e-9 for ns in self._live().busy_ns()]

    def info(self) -> dict[str, Any]:
        pool = self._live()
        bytes_per_format: dict[str, int] = {}
        for idx, (_, _, _, fmt, _) in self._layers.items():
            bytes_per_format[fmt] = bytes_per_format.get(fmt, 0) + pool.layer_bytes(idx)
        return {
            "isa": pool.isa,
            "int_isa": pool.int_isa,
            "int_min_tokens": pool.int_min_tokens,
            "pack_rows": pool.pack_rows,
            "supported_isas": supported_isas(),
            "num_threads": pool.num_threads,
            "numa_nodes": pool.nodes,
            "layers": sorted(self._layers),
            "bytes_per_format": bytes_per_format,
        }

    @property
    def spare_cpus(self) -> list[int]:
        """The allowed cpus no worker is pinned to (the stream poller takes the highest)."""
        return list(self._live().spare_cpus)

    def confine_others(self) -> list[int]:
        """Moves every thread of this process that is not pinned to one cpu (the workers and
        the poller are) onto the spare cpus, so the interpreter, the event loop and the CUDA
        driver's threads stop preempting workers; threads they start later inherit that mask.
        Returns the cpus, empty (nothing changed) where no cpu is spare or not on Linux."""
        spare = set(self.spare_cpus)
        if not spare or not hasattr(os, "sched_setaffinity"):
            return []
        if self._confined is None:
            self._confined = (os.sched_getaffinity(0), spare)
        _set_masks(lambda mask: len(mask) > 1, spare)
        return sorted(spare)

    def close(self) -> None:
        """Waits for the call in flight, stops the workers and frees the weights. Idempotent."""
        if getattr(self, "_pool", None) is not None:
            self._before_unmap()
        pool, self._pool = getattr(self, "_pool", None), None
        if pool is not None:
            pool.sync()
            del pool  # stops the poller of flag jobs before their buffers go
        confined, self._confined = getattr(self, "_confined", None), None
        if confined is not None:  # confine_others undone: a later pool sees every cpu again
            before, spare = confined
            _set_masks(lambda mask: mask == spare, before)
        self._inflight = None
        self._stream_tensors = []

    def __enter__(self) -> CpuExpertPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def _live(self) -> Any:
        if self._pool is None:
            raise RuntimeError("CpuExpertPool is closed")
        return self._pool

    def _layer(self, layer_idx: int) -> tuple[int, int, int, str, int]:
        if layer_idx not in self._layers:
            raise ValueError(f"layer {layer_idx} has not been added (have {sorted(self._layers)})")
        return self._layers[layer_idx]

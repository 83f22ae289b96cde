"""`CpuExpertPool`: the Python face of the C++ expert pool (ext/cpu/*.cpp).

Validates every tensor before its address reaches C++, keeps the tensors of the call in flight
alive until `sync()`, and reads TANDEM_CPU_ISA. Knows nothing about requests or model classes.
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

ISA_ENV = "TANDEM_CPU_ISA"
# The integer path for int8/int4 experts (ext/cpu/kernels.h: kQBlock): "off", "auto" (default)
# or the minimum tokens per expert from which it is used.
INT_PATH_ENV = "TANDEM_CPU_INT_PATH"
ISAS = ("scalar", "avx2", "avx512", "amx")
_FORMATS = {"bf16": 0, "int8": 1, "int4": 2}
_FORMAT_NAMES = {v: k for k, v in _FORMATS.items()}
_SRC_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def supported_isas() -> list[str]:
    """ISAs this CPU and build can run, slowest first ("scalar" always)."""
    return list(load_extension().supported_isas())


_ENV_ON = ("on", "1", "yes", "true")
_ENV_OFF = ("off", "0", "no", "false")


def _int_min_tokens_from_env() -> int | None:
    """TANDEM_CPU_INT_PATH as a minimum token count: None for unset/"auto", 0 for "off"."""
    raw = os.environ.get(INT_PATH_ENV, "").strip().lower()
    if raw in ("", "auto"):
        return None
    if raw in _ENV_OFF:
        return 0
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 1:
        raise ValueError(f"{INT_PATH_ENV} must be 'auto', 'off' or a positive int, got {raw!r}")
    return value


PACK_ROWS_ENV = "TANDEM_CPU_PACK_ROWS"
# Tokens of one expert from which AMX int8 tiles replace VNNI (ext/cpu/kernels.h:
# kAmxTileMinTokens); read by the extension when its first pool starts, checked here.
AMX_TILE_ENV = "TANDEM_AMX_TILE_MIN_TOKENS"
# Tokens of one expert from which AMX bf16 tiles replace the AVX-512 kernel (kAmxMinTokens, 1).
AMX_BF16_ENV = "TANDEM_AMX_BF16_MIN_TOKENS"


def _check_amx_tile_env() -> None:
    for name in (AMX_TILE_ENV, AMX_BF16_ENV):
        raw = os.environ.get(name, "").strip()
        if raw and not (raw.isdigit() and int(raw) > 0):
            raise ValueError(f"{name} must be a positive int, got {raw!r}")


def switch_from_env(name: str) -> bool | None:
    """An auto/on/off environment switch: None for unset or "auto", else True/False."""
    raw = os.environ.get(name, "").strip().lower()
    if raw in ("", "auto"):
        return None
    if raw in _ENV_ON:
        return True
    if raw in _ENV_OFF:
        return False
    raise ValueError(f"{name} must be 'auto', 'on' or 'off', got {raw!r}")


def _pack_rows_from_env() -> bool | None:
    """TANDEM_CPU_PACK_ROWS: None for unset/"auto", else on/off."""
    return switch_from_env(PACK_ROWS_ENV)


def _set_masks(which: Callable[[set[int]], bool], cpus: set[int]) -> None:
    """Sets the cpu mask of every thread of this process whose mask `which` accepts."""
    for tid in os.listdir("/proc/self/task"):
        try:
            if which(os.sched_getaffinity(int(tid))):
                os.sched_setaffinity(int(tid), cpus)
        except OSError:  # the thread has exited, or the mask is not ours to set
            continue


def cuda_host_funcs_error() -> str | None:
    """None when the CUDA driver's cuLaunchHostFunc can be used (stream-ordered jobs); else
    why not. The extension itself never needs CUDA."""
    return load_extension().cuda_driver_error() or None


def cuda_memops_error() -> str | None:
    """None when the CUDA driver's stream memory operations (cuStreamWriteValue32 and
    cuStreamWaitValue32) can be used (flag jobs); else why not."""
    return load_extension().cuda_memops_error() or None


FLAG_WORDS = 32  # int32 words of a flag job's pinned flags: go at [0], done at [16]


class StreamJob:
    """A fixed job descriptor of one layer over fixed host buffers (see
    `CpuExpertPool.stream_job`). Holds the buffers alive; its address is what a captured graph
    keeps, so it lives (inside the pool, which never frees it) as long as the pool."""

    def __init__(
        self,
        handle: int,
        layer_idx: int,
        tensors: tuple[torch.Tensor, ...],
        flags: torch.Tensor | None = None,
    ) -> None:
        self.handle = handle
        self.layer_idx = layer_idx
        self.hidden, self.topk_ids, self.topk_weights, self.out, self.num_tokens = tensors
        self.flags = flags  # [FLAG_WORDS] int32 pinned: a flag job (enqueue_go / done_wait)

    @property
    def capacity(self) -> int:
        return self.hidden.shape[0]


def _check_cpu_tensor(name: str, t: Any, dtypes: tuple[torch.dtype, ...], ndim: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"{name} must be on the CPU, got {t.device}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name} must have dtype {' or '.join(map(str, dtypes))}, got {t.dtype}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")


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


class CpuExpertPool:
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
        if isa is None:
            isa = os.environ.get(ISA_ENV, "") or None
        if isa is not None and isa not in ISAS:
            raise ValueError(f"isa must be one of {ISAS}, got {isa!r}")
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

    # -- stream-ordered jobs (the CUDA path, capturable in a CUDA graph) ---------------------

    def stream_job(
        self,
        layer_idx: int,
        hidden: torch.Tensor,  # [C, H] float32, host (pinned for async copies)
        topk_ids: torch.Tensor,  # [C, k] int64
        topk_weights: torch.Tensor,  # [C, k] float32
        out: torch.Tensor,  # [C, H] float32
        num_tokens: torch.Tensor,  # [1] int32: the rows of a call, written before its submit
        flags: bool = False,
    ) -> StreamJob:
        """A fixed descriptor of a call over these buffers for `enqueue_submit`/`enqueue_wait`.

        Every call reads `num_tokens[0]` when its submit host function runs (0 to C rows), so
        one job serves every token count. The buffers must stay at their addresses for as long
        as any stream or captured graph may run the job (the pool keeps them alive until it
        closes).

        flags=True makes a flag job instead, for `enqueue_go` / `enqueue_done_wait`: no host
        function; the pool's poller thread watches two pinned words that the stream writes
        and waits on (the row count travels in the go word; `num_tokens` is not read)."""
        self._live()
        _, _, H, _, _ = self._layer(layer_idx)
        _check_cpu_tensor("hidden", hidden, (torch.float32,), 2)
        _check_cpu_tensor("topk_ids", topk_ids, (torch.int64,), 2)
        _check_cpu_tensor("topk_weights", topk_weights, (torch.float32,), 2)
        _check_cpu_tensor("out", out, (torch.float32,), 2)
        _check_cpu_tensor("num_tokens", num_tokens, (torch.int32,), 1)
        C, k = topk_ids.shape
        if hidden.shape != (C, H) or out.shape != (C, H):
            raise ValueError(f"hidden and out must be [{C}, {H}], got {tuple(hidden.shape)}, "
                             f"{tuple(out.shape)}")  # fmt: skip
        if topk_weights.shape != (C, k) or C < 1 or k < 1:
            raise ValueError(f"topk_ids and topk_weights must be the same [C>=1, k>=1], got "
                             f"{tuple(topk_ids.shape)}, {tuple(topk_weights.shape)}")  # fmt: skip
        if num_tokens.numel() != 1:
            raise ValueError(f"num_tokens must have one element, got {num_tokens.numel()}")
        tensors = (hidden, topk_ids, topk_weights, out, num_tokens)
        names = ("hidden", "topk_ids", "topk_weights", "out", "num_tokens")
        for name, t in zip(names, tensors, strict=True):
            if not t.is_contiguous():
                raise ValueError(f"{name} must be contiguous")
        if _overlaps(out, hidden):
            raise ValueError("out must not overlap hidden")
        flag_words = None
        if flags:
            pin = torch.cuda.is_available()  # device-mapped where a GPU will write it
            flag_words = torch.zeros(FLAG_WORDS, dtype=torch.int32, pin_memory=pin)
        handle = self._pool.make_stream_job(
            layer_idx, *(t.data_ptr() for t in tensors), C, k,
            flag_words.data_ptr() if flag_words is not None else 0,
        )  # fmt: skip
        # the poller may read them (and a graph write them) until the pool is gone
        self._stream_tensors.append((*tensors, flag_words))
        return StreamJob(handle, layer_idx, tensors, flag_words)

    def enqueue_go(self, stream: int, job: StreamJob, rows: int) -> None:
        """Flag job: enqueues on `stream` a 4-byte write that tells the pool's poller to run
        `job` on its first `rows` rows (after a memory barrier: the copies queued before it
        have landed). Capturable; a graph replays it with the same `rows`."""
        self._flag_job(job, rows)
        self._live().enqueue_go(int(stream), job.handle, rows)

    def enqueue_done_wait(self, stream: int, job: StreamJob) -> None:
        """Flag job: enqueues a wait of `stream` until the poller has finished `job` (the GPU
        polls the done word; no host function, no host thread blocks), then resets it."""
        self._flag_job(job)
        self._live().enqueue_done_wait(int(stream), job.handle)

    def host_go(self, job: StreamJob, rows: int) -> None:
        """What `enqueue_go` does on the GPU, from this thread (tests without a GPU)."""
        self._flag_job(job, rows)
        self._live().host_go(job.handle, rows)

    def host_done_wait(self, job: StreamJob, timeout_s: float = 10.0) -> bool:
        """What `enqueue_done_wait` does on the GPU: False if the job did not finish in time."""
        self._flag_job(job)
        return bool(self._live().host_done_wait(job.handle, float(timeout_s)))

    def kick(self) -> None:
        """Flag jobs are coming: the poller spins (instead of napping) for `poll_spin_us`."""
        self._live().kick()

    @property
    def poll_spin_us(self) -> int:
        """How long the poller of flag jobs spins after the last job before it naps (50 us)
        between looks."""
        return self._live().poll_spin_us

    @poll_spin_us.setter
    def poll_spin_us(self, value: int) -> None:
        self._live().poll_spin_us = _non_negative_int("poll_spin_us", value)

    @property
    def flag_jobs_run(self) -> int:
        return int(self._live().flag_jobs_run)

    def _flag_job(self, job: StreamJob, rows: int | None = None) -> None:
        if job.flags is None:
            raise ValueError("not a flag job: make it with stream_job(..., flags=True)")
        if rows is not None and not 0 <= rows <= job.capacity:
            raise ValueError(f"rows must be in [0, {job.capacity}], got {rows}")

    def enqueue_submit(self, stream: int, job: StreamJob) -> None:
        """Enqueues on CUDA stream `stream` (a cudaStream_t as an int, e.g. torch's
        `current_stream().cuda_stream`) a host function that starts `job` on the pool with
        the rows its buffers hold when the stream reaches it. Returns at once. During stream
        capture it becomes a host node of the graph and runs at every replay. RuntimeError if
        the CUDA driver (libcuda.so.1) is missing or refuses the launch."""
        self._live().enqueue_submit(int(stream), job.handle)

    def enqueue_wait(self, stream: int, job: StreamJob) -> None:
        """Enqueues a host function that blocks `stream` until `job` is done, so work queued
        after it (the copy of `job.out` to the device) sees the result."""
        self._live().enqueue_wait(int(stream), job.handle)

    def run_stream_job(self, job: StreamJob) -> None:
        """Runs the submit and wait host functions here, in order (tests, no CUDA needed)."""
        self._live().run_stream_job(job.handle)

    def stream_stats(self) -> dict[str, int]:
        """Counters of the stream-ordered jobs that ran: calls, errors, tokens, pool_ns
        (submit to done), wait_ns (stream blocked in the wait), d2h_bytes, h2d_bytes."""
        return dict(self._live().stream_stats())

    def last_stream_error(self) -> str:
        """The message of the last failed stream job ("" if none). A failed job zeroes its
        output rows; the host functions cannot raise into the stream."""
        return self._live().last_stream_error()

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


def _non_negative_int(name: str, value: Any) -> int:
    if not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    return value


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    a0, b0 = a.data_ptr(), b.data_ptr()
    a1, b1 = a0 + a.numel() * a.element_size(), b0 + b.numel() * b.element_size()
    return a0 < b1 and b0 < a1

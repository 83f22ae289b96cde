"""Compiles the `.cu` sources beside this file with CuPy (NVRTC) and launches their kernels
on torch's current CUDA stream.

Each (source, template instantiation, device) is compiled once per process and cached; CuPy
also caches the binary on disk. CuPy is imported lazily, so importing `ext.cuda` works on a
machine without CuPy or CUDA; only a launch needs them.
"""

from __future__ import annotations

import re
import threading
from pathlib import Path
from typing import Any

import numpy as np
import torch

_SRC_DIR = Path(__file__).resolve().parent
_OPTIONS = ("-std=c++17", "--use_fast_math")

_lock = threading.Lock()
_kernels: dict[tuple[str, str, int], Any] = {}
_streams: dict[tuple[int, int], Any] = {}
_sources: dict[str, str] = {}
_smem_limits: dict[tuple[str, str, int], int] = {}


def cupy_module() -> Any:
    """Import CuPy or raise a clear error (the only place that imports it)."""
    try:
        import cupy
    except ImportError as e:  # pragma: no cover - depends on the machine
        raise RuntimeError(
            "tandem.ext.cuda kernels need CuPy (pip install cupy-cuda12x or cupy-cuda13x)"
        ) from e
    return cupy


def cupy_available() -> bool:
    try:
        import cupy  # noqa: F401
    except ImportError:
        return False
    return True


_INCLUDE = re.compile(r'^#include "([\w.]+)"[^\n]*$', re.M)


def _inline(filename: str, seen: set[str]) -> str:
    """`filename`'s text with its local `#include "x"` lines replaced by x's text, each file
    once (a source may include another kernel file for its device functions)."""
    seen.add(filename)

    def sub(m: re.Match) -> str:
        name = m[1]
        return "" if name in seen else _inline(name, seen)

    return _INCLUDE.sub(sub, (_SRC_DIR / filename).read_text())


def _source(filename: str) -> str:
    """The source text with its local includes (common.cuh, ...) inlined, so CuPy's cache key
    sees them."""
    src = _sources.get(filename)
    if src is None:
        src = _inline(filename, set())
        _sources[filename] = src
    return src


def get_kernel(filename: str, name: str, device_index: int) -> Any:
    """The compiled kernel `name` (a name expression, e.g. `f<1,128>`) of `filename`."""
    key = (filename, name, device_index)
    fn = _kernels.get(key)
    if fn is not None:
        return fn
    cp = cupy_module()
    with _lock:
        fn = _kernels.get(key)
        if fn is None:
            with cp.cuda.Device(device_index):
                module = cp.RawModule(
                    code=_source(filename), options=_OPTIONS, name_expressions=(name,)
                )
                fn = module.get_function(name)
            _kernels[key] = fn
    return fn


def _stream(device: torch.device) -> Any:
    cp = cupy_module()
    ptr = torch.cuda.current_stream(device).cuda_stream
    key = (device.index, ptr)
    s = _streams.get(key)
    if s is None:
        try:
            s = cp.cuda.ExternalStream(ptr, device.index)
        except TypeError:  # older CuPy: no device_id argument
            s = cp.cuda.ExternalStream(ptr)
        _streams[key] = s
    return s


def launch(
    filename: str,
    name: str,
    device: torch.device,
    grid: tuple[int, int, int],
    block: tuple[int, int, int],
    args: tuple,
    shared_mem: int = 0,
) -> None:
    """Launch kernel `name` of `filename` on torch's current stream of `device`.

    `args` are numpy scalars (np.uint64 for pointers, np.int32, np.int64, np.float32) in the
    kernel's parameter order; `shared_mem` is the dynamic shared memory in bytes (above 48 KiB
    the kernel's limit is raised once).
    """
    index = device.index if device.index is not None else torch.cuda.current_device()
    _launch(get_kernel(filename, name, index), (filename, name, index), index, grid, block,
            args, shared_mem)  # fmt: skip


def get_cubin_kernel(path: str, name: str, device_index: int) -> Any:
    """The `extern "C"` kernel `name` of a prebuilt cubin (ext/cuda/sm90_build.py)."""
    key = (path, name, device_index)
    fn = _kernels.get(key)
    if fn is None:
        cp = cupy_module()
        with _lock, cp.cuda.Device(device_index):
            fn = _kernels.get(key)
            if fn is None:
                fn = cp.RawModule(path=path).get_function(name)
                _kernels[key] = fn
    return fn


def launch_cubin(
    path: str,
    name: str,
    device: torch.device,
    grid: tuple[int, int, int],
    block: tuple[int, int, int],
    args: tuple,
    shared_mem: int = 0,
) -> None:
    """`launch` for a kernel of a prebuilt cubin."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    _launch(get_cubin_kernel(path, name, index), (path, name, index), index, grid, block,
            args, shared_mem)  # fmt: skip


def _launch(fn: Any, key: tuple[str, str, int], index: int, grid: tuple[int, int, int],
            block: tuple[int, int, int], args: tuple, shared_mem: int) -> None:  # fmt: skip
    cp = cupy_module()
    device = torch.device("cuda", index)
    with cp.cuda.Device(index), _stream(device):
        if shared_mem > _smem_limits.get(key, 48 * 1024):
            fn.max_dynamic_shared_size_bytes = shared_mem
            _smem_limits[key] = shared_mem
        fn(grid, block, args, shared_mem=shared_mem)


def ptr(t: torch.Tensor | None) -> np.uint64:
    return np.uint64(0 if t is None else t.data_ptr())


def i32(x: int) -> np.int32:
    return np.int32(x)


def i64(x: int) -> np.int64:
    return np.int64(x)


def f32(x: float) -> np.float32:
    return np.float32(x)

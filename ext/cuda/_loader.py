"""Compiles the `.cu` sources beside this file with CuPy (NVRTC) and launches their kernels
on torch's current CUDA stream (`pdl=True`: with programmatic dependent launch, through the
driver's cuLaunchKernelEx, on sm_90 and newer).

Each (source, template instantiation, device) is compiled once per process and cached; CuPy
also caches the binary on disk. CuPy is imported lazily, so importing `ext.cuda` works on a
machine without CuPy or CUDA; only a launch needs them.
"""

from __future__ import annotations

import ctypes
import logging
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
log = logging.getLogger(__name__)


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
    pdl: bool = False,
) -> None:
    """Launch kernel `name` of `filename` on torch's current stream of `device`.

    `args` are numpy scalars (np.uint64 for pointers, np.int32, np.int64, np.float32) in the
    kernel's parameter order; `shared_mem` is the dynamic shared memory in bytes (above 48 KiB
    the kernel's limit is raised once). `pdl`: the kernel may start before the previous one in
    the stream has finished; it must call `pdl_wait()` (common.cuh) before it reads anything
    an earlier kernel wrote and before its first write.
    """
    index = device.index if device.index is not None else torch.cuda.current_device()
    fn = get_kernel(filename, name, index)
    if pdl and shared_mem == 0 and _pdl_ok(index):
        try:
            _launch_pdl(fn, index, grid, block, args)
            return
        except (OSError, AttributeError, RuntimeError) as e:  # then launch as usual from now on
            log.warning("programmatic dependent launch unavailable (%s); plain launches", e)
            PDL["on"] = False
    _launch(fn, (filename, name, index), index, grid, block, args, shared_mem)


# Programmatic dependent launch: "on" is the switch (benchmarks turn it off for an A/B).
PDL = {"on": True}
_pdl_devices: dict[int, bool] = {}
_libcuda: list = []
_CTYPES = {np.uint64: ctypes.c_uint64, np.int64: ctypes.c_int64, np.int32: ctypes.c_int32,
           np.float32: ctypes.c_float}  # fmt: skip
_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CUlaunchAttributeID (cuda.h)


class _LaunchAttribute(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_char * 64)]


class _LaunchConfig(ctypes.Structure):
    _fields_ = [
        ("grid", ctypes.c_uint * 3),
        ("block", ctypes.c_uint * 3),
        ("shared_mem", ctypes.c_uint),
        ("stream", ctypes.c_void_p),
        ("attrs", ctypes.POINTER(_LaunchAttribute)),
        ("num_attrs", ctypes.c_uint),
    ]


def _pdl_ok(index: int) -> bool:
    if not PDL["on"]:
        return False
    ok = _pdl_devices.get(index)
    if ok is None:
        ok = _pdl_devices[index] = torch.cuda.get_device_capability(index)[0] >= 9
    return ok


def _launch_pdl(fn: Any, index: int, grid: tuple[int, int, int], block: tuple[int, int, int],
                args: tuple) -> None:  # fmt: skip
    if not _libcuda:
        lib = ctypes.CDLL("libcuda.so.1")
        lib.cuLaunchKernelEx.restype = ctypes.c_int
        _libcuda.append(lib)
    values = [_CTYPES[type(a)](a) for a in args]
    params = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])
    attr = _LaunchAttribute()
    attr.id = _PROGRAMMATIC_STREAM_SERIALIZATION
    attr.value = (1).to_bytes(4, "little")  # programmaticStreamSerializationAllowed = 1
    cfg = _LaunchConfig()
    cfg.grid[:] = grid
    cfg.block[:] = block
    cfg.shared_mem = 0
    cfg.stream = torch.cuda.current_stream(torch.device("cuda", index)).cuda_stream
    cfg.attrs = ctypes.pointer(attr)
    cfg.num_attrs = 1
    with cupy_module().cuda.Device(index):
        handle = fn.kernel.ptr  # RawKernel -> its CUfunction on this device (compiled once)
        rc = _libcuda[0].cuLaunchKernelEx(ctypes.byref(cfg), ctypes.c_void_p(handle), params, None)
    if rc != 0:
        raise RuntimeError(f"cuLaunchKernelEx returned CUresult {rc}")


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

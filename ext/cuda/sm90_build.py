"""Builds `.cu` sources that need Hopper-only instructions (wgmma) into an `sm_90a` cubin
with nvcc, cached under $TANDEM_HOME/cuda_sm90 by a hash of the source and the compiler.

CuPy's RawModule compiles for `sm_90` (or `compute_90`), where wgmma does not exist; loading a
cubin built here gives the same launch path as every other kernel (ext/cuda/_loader.py). A
machine without nvcc, or a failed build, raises `Sm90BuildError`; callers fall back to their
portable kernel.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

from tandem.ext.cpu.build import tandem_home

_SRC_DIR = Path(__file__).resolve().parent
_FLAGS = ("-arch=sm_90a", "-cubin", "-O3", "-std=c++17", "--use_fast_math")
_lock = threading.Lock()
_built: dict[str, Path | Sm90BuildError] = {}


class Sm90BuildError(RuntimeError):
    """No nvcc, or the sm_90a build failed (the message holds the compiler's output)."""


def nvcc_path() -> str | None:
    for cand in (
        shutil.which("nvcc"),
        os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc"),
    ):
        if cand and os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    return None


def _key(nvcc: str, filename: str) -> str:
    h = hashlib.sha256()
    for name in (filename, "common.cuh"):
        h.update((_SRC_DIR / name).read_bytes())
    h.update(" ".join(_FLAGS).encode())
    h.update(subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout.encode())
    return h.hexdigest()[:20]


def _build(filename: str) -> Path:
    nvcc = nvcc_path()
    if nvcc is None:
        raise Sm90BuildError("nvcc not found (PATH, $CUDA_HOME/bin): no sm_90a kernels")
    out_dir = tandem_home() / "cuda_sm90"
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / f"{Path(filename).stem}-{_key(nvcc, filename)}.cubin"
    if target.is_file():
        return target
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        tmp_out = Path(tmp) / target.name
        cmd = [nvcc, *_FLAGS, f"-I{_SRC_DIR}", "-o", str(tmp_out), str(_SRC_DIR / filename)]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0 or not tmp_out.is_file():
            raise Sm90BuildError(f"nvcc failed on {filename}:\n{res.stdout}{res.stderr}")
        os.replace(tmp_out, target)  # atomic: concurrent builders leave one whole file
    return target


def sm90_cubin(filename: str) -> Path:
    """Path of `filename`'s sm_90a cubin, built once per process (errors are cached too)."""
    with _lock:
        got = _built.get(filename)
        if got is None:
            try:
                got = _build(filename)
            except (Sm90BuildError, OSError) as e:
                got = e if isinstance(e, Sm90BuildError) else Sm90BuildError(str(e))
            _built[filename] = got
    if isinstance(got, Sm90BuildError):
        raise got
    return got

"""Just-in-time build of the C++ expert pool (`_tandem_cpu`) into a per-user cache.

Owns compiling and loading the extension; knows nothing about experts. Each ISA's kernels are a
separate translation unit with its own -m flags, so the library loads on any x86-64 CPU and the
pool picks kernels from CPUID at run time. An ISA the compiler cannot target is left out of the
build with a warning naming it and the compiler's first errors (the pool reports it as
unavailable). Needs only g++ (or $CXX), pybind11's headers and the
Python headers: no setuptools step and no package registry.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import logging
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from functools import lru_cache
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)
# Log records flagged so are shown by the CLI without -v (first-start progress).
PROGRESS = {"progress": True}

SRC_DIR = Path(__file__).resolve().parent
MODULE_NAME = "_tandem_cpu"

BASE_FLAGS = ["-O3", "-std=c++17", "-fPIC", "-fvisibility=hidden", "-pthread", "-DNDEBUG"]
AVX2_FLAGS = ["-mavx2", "-mfma", "-mf16c"]
AVX512_FLAGS = AVX2_FLAGS + [
    "-mavx512f",
    "-mavx512bw",
    "-mavx512vl",
    "-mavx512bf16",
    "-mavx512vnni",
]
AMX_FLAGS = AVX512_FLAGS + ["-mamx-tile", "-mamx-bf16", "-mamx-int8"]
# The integer path: VNNI without BF16 (so nothing in it needs more than AVX512-VNNI).
VNNI_FLAGS = AVX2_FLAGS + ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"]

# (source, extra flags, define that says it was built); define None: always built.
CORE_UNITS = [
    ("isa.cpp", [], None),
    ("workers.cpp", [], None),
    ("helpers.cpp", [], None),
    ("moe.cpp", [], None),
    ("moe_convert.cpp", [], None),
    ("moe_file.cpp", [], None),
    ("moe_step.cpp", [], None),
    ("stream.cpp", [], None),
    ("kernels_scalar.cpp", [], None),
    ("linear.cpp", [], None),
    ("linear_scalar.cpp", [], None),
    ("qlinear.cpp", [], None),
    ("qlinear_scalar.cpp", [], None),
    ("qlinear_bindings.cpp", [], None),
    ("attention.cpp", [], None),
    ("norm.cpp", [], None),
    ("rope.cpp", [], None),
    ("bindings.cpp", [], None),
]
X86_UNITS = [
    ("kernels_avx2.cpp", AVX2_FLAGS, "TANDEM_HAVE_AVX2"),
    ("kernels_avx512.cpp", AVX512_FLAGS, "TANDEM_HAVE_AVX512"),
    ("kernels_vnni.cpp", VNNI_FLAGS, "TANDEM_HAVE_VNNI"),
    ("kernels_amx.cpp", AMX_FLAGS, "TANDEM_HAVE_AMX"),
    ("kernels_amx_int8.cpp", AMX_FLAGS, "TANDEM_HAVE_AMX_INT8"),
]
# Units built only when the units whose defines are listed were built.
UNIT_NEEDS = {
    "TANDEM_HAVE_AMX": ["TANDEM_HAVE_AVX512"],
    "TANDEM_HAVE_AMX_INT8": ["TANDEM_HAVE_AMX", "TANDEM_HAVE_VNNI"],
}
# Dense-linear kernels of an ISA: built with its flags, only when its expert unit was built.
LINEAR_UNITS = {
    "TANDEM_HAVE_AVX2": [
        ("linear_avx2.cpp", AVX2_FLAGS),
        ("qlinear_avx2_int8.cpp", AVX2_FLAGS),
    ],
    "TANDEM_HAVE_AVX512": [
        ("linear_avx512.cpp", AVX512_FLAGS),
        ("qlinear_avx512.cpp", AVX512_FLAGS),
    ],
    "TANDEM_HAVE_VNNI": [("qlinear_vnni.cpp", VNNI_FLAGS), ("qlinear_vnni_k.cpp", VNNI_FLAGS)],
    "TANDEM_HAVE_AMX": [("linear_amx.cpp", AMX_FLAGS)],
}
HEADERS = [
    "amx_emulate.h",
    "amx_tiles.h",
    "kernels.h",
    "isa.h",
    "workers.h",
    "helpers.h",
    "moe.h",
    "moe_act.h",
    "moe_internal.h",
    "stream.h",
    "linear.h",
    "qlinear.h",
    "qlinear_int8.h",
    "attention.h",
    "norm.h",
    "rope.h",
    "simd_avx512.h",
    "simd_q8.h",
]


# TANDEM_CPU_AMX_EMULATE=1: a separate build whose "amx" ISA runs the AMX units with tiles in
# software (amx_emulate.h) on any CPU with the AVX-512 path, so tests exercise the AMX kernels'
# logic (tile shapes, layouts, thresholds) on machines without AMX. Slow; tests only.
EMULATE_ENV = "TANDEM_CPU_AMX_EMULATE"


def _emulate_flags() -> list[str]:
    return ["-DTANDEM_AMX_EMULATE"] if os.environ.get(EMULATE_ENV) == "1" else []


class CpuExtensionError(RuntimeError):
    """The C++ expert pool could not be built or loaded (no compiler, missing headers, errors)."""


def tandem_home() -> Path:
    """$TANDEM_HOME, else ~/.cache/tandem (the same rule as models.hub.tandem_home)."""
    home = os.environ.get("TANDEM_HOME") or os.path.join(
        os.path.expanduser("~"), ".cache", "tandem"
    )
    return Path(home)


def cache_root() -> Path:
    return tandem_home() / "cpu_ext"


def _compiler() -> str:
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx or not shutil.which(cxx):
        raise CpuExtensionError(
            "no C++ compiler found for the CPU expert pool: install g++ (or set CXX)"
        )
    return cxx


def _is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64", "i686", "i386")


def _include_dirs() -> list[str]:
    try:
        import pybind11
    except ImportError as e:
        raise CpuExtensionError("pybind11 is not installed (needed to build the CPU pool)") from e
    py_inc = sysconfig.get_paths()["include"]
    if not (Path(py_inc) / "Python.h").exists():
        raise CpuExtensionError(
            f"Python headers not found ({py_inc}/Python.h): install python3-dev"
        )
    return [pybind11.get_include(), py_inc, str(SRC_DIR)]


def _build_key(cxx: str) -> str:
    h = hashlib.sha256()
    linear = [u[0] for units in LINEAR_UNITS.values() for u in units]
    for name in [u[0] for u in CORE_UNITS + X86_UNITS] + linear + HEADERS + ["build.py"]:
        h.update(name.encode())
        h.update((SRC_DIR / name).read_bytes())
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    flags = [BASE_FLAGS, AVX2_FLAGS, AVX512_FLAGS, VNNI_FLAGS, AMX_FLAGS, UNIT_NEEDS]
    flags.append(_emulate_flags())
    for part in (
        version,
        repr(flags),
        sys.version,
        sysconfig.get_config_var("EXT_SUFFIX") or "",
        platform.machine(),
    ):
        h.update(part.encode())
    return h.hexdigest()[:20]


def _run(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:  # the first errors are the ones that explain the rest
        raise CpuExtensionError(
            f"command failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr[:4000]}"
        )


def first_errors(e: CpuExtensionError, lines: int = 3) -> str:
    """The compiler's first `lines` error lines of a failed command, joined by " | " (its last
    output line where none says so)."""
    out = str(e).splitlines()[1:] or str(e).splitlines()
    errors = [line.strip() for line in out if "error:" in line.lower()]
    return " | ".join((errors or [line.strip() for line in out[-1:]])[:lines])[:800]


def _isa_name(define: str) -> str:
    """TANDEM_HAVE_AMX_INT8 -> "amx-int8"."""
    return define.removeprefix("TANDEM_HAVE_").lower().replace("_", "-")


def _left_out(skipped: list[str], src: str, define: str, why: str) -> None:
    skipped.append(f"{src}: {why}")
    log.warning(
        "C++ CPU extension: the %s kernels (%s) are left out of the build: %s",
        _isa_name(define),
        src,
        why,
        extra=PROGRESS,
    )


def _build(cxx: str, target: Path) -> list[str]:
    """Compiles every unit into target; returns the ISA units left out and why."""
    # every unit: the include dirs, and the emulation define of an emulated build
    common = [f"-I{d}" for d in _include_dirs()] + _emulate_flags()
    skipped: list[str] = []
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        objects: list[str] = []
        defines: list[str] = []
        if _is_x86():
            for src, flags, define in X86_UNITS:
                obj = os.path.join(tmp, src + ".o")
                missing = [d for d in UNIT_NEEDS.get(define, []) if f"-D{d}" not in defines]
                if missing:
                    needs = ", ".join(_isa_name(d) for d in missing)
                    _left_out(skipped, src, define, f"needs the {needs} kernels")
                    continue
                try:
                    _run(
                        [
                            cxx,
                            *BASE_FLAGS,
                            *flags,
                            *defines,
                            *common,
                            "-c",
                            str(SRC_DIR / src),
                            "-o",
                            obj,
                        ]
                    )
                    for lsrc, lflags in LINEAR_UNITS.get(define, []):
                        lobj = os.path.join(tmp, lsrc + ".o")
                        _run(
                            [cxx, *BASE_FLAGS, *lflags, *common, "-c", str(SRC_DIR / lsrc)]
                            + ["-o", lobj]
                        )
                        objects.append(lobj)
                except CpuExtensionError as e:
                    _left_out(skipped, src, define, f"compile failed: {first_errors(e)}")
                    continue
                objects.append(obj)
                defines.append(f"-D{define}")
        for src, flags, _ in CORE_UNITS:
            obj = os.path.join(tmp, src + ".o")
            _run([cxx, *BASE_FLAGS, *flags, *defines, *common, "-c", str(SRC_DIR / src), "-o", obj])
            objects.append(obj)
        out = os.path.join(tmp, target.name)
        # -ldl: dlopen of libcuda at run time (ext/cpu/stream.cpp); no CUDA library is linked.
        _run([cxx, "-shared", "-pthread", *objects, "-ldl", "-o", out])
        os.replace(out, target)
    return skipped


@lru_cache(maxsize=1)
def load_extension() -> ModuleType:
    """Builds (once per source/compiler/Python combination) and imports `_tandem_cpu`."""
    cxx = _compiler()
    key = _build_key(cxx)
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    target = root / key / (MODULE_NAME + (sysconfig.get_config_var("EXT_SUFFIX") or ".so"))
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(root / f"{key}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                if not target.exists():
                    t0 = time.perf_counter()
                    log.info(
                        "compiling the C++ CPU extension with %s (first start only, about "
                        "20-60 s) into %s",
                        cxx,
                        target.parent,
                        extra=PROGRESS,
                    )
                    skipped = _build(cxx, target)
                    log.info(
                        "compiled the C++ CPU extension in %.1fs",
                        time.perf_counter() - t0,
                        extra=PROGRESS,
                    )
                    (target.parent / "skipped_isas.txt").write_text("\n".join(skipped))
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)
    spec = importlib.util.spec_from_file_location(MODULE_NAME, target)
    if spec is None or spec.loader is None:
        raise CpuExtensionError(f"cannot load {target}")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except ImportError as e:
        raise CpuExtensionError(f"cannot load {target}: {e}") from e
    return module


@lru_cache(maxsize=1)
def extension_available() -> bool:
    """Whether `_tandem_cpu` builds and loads here (the small fused CPU ops fall back to torch
    where it does not)."""
    try:
        load_extension()
        return True
    except Exception as exc:  # no compiler, a failed build: torch serves instead
        log.warning("C++ CPU extension unavailable (%s: %s)", type(exc).__name__, exc)
        return False

"""The CPU read-bandwidth floor, measured where it is used: builds tools/peers/cpu_bandwidth.c
(once per source and compiler flags, into $TANDEM_HOME/tools) and runs it at the benchmark's
thread count. Each thread first-touches and then reads its own slice with vector loads, over a
buffer far larger than the L3; a torch sum reads less and gave floors that were too low.

    python tools/peers/cpu_bandwidth.py [--gigabytes 8] [--threads 1 8 14 16] [--passes 5]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

SOURCE = Path(__file__).with_name("cpu_bandwidth.c")
FLAGS = ["-O3", "-march=native", "-fopenmp"]


def _cache_dir() -> Path:
    home = os.environ.get("TANDEM_HOME") or os.path.join(
        os.path.expanduser("~"), ".cache", "tandem"
    )
    return Path(home) / "tools"


def build() -> Path:
    """Compile the probe if this source/flags pair has no binary yet; returns its path."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("the CPU bandwidth probe needs a C compiler (cc or gcc) with OpenMP")
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join([compiler, *FLAGS]).encode()).hexdigest()
    binary = _cache_dir() / f"cpu_bandwidth-{key[:16]}"
    if not binary.exists():
        binary.parent.mkdir(parents=True, exist_ok=True)
        tmp = binary.with_name(f"{binary.name}.{os.getpid()}.tmp")
        proc = subprocess.run(
            [compiler, *FLAGS, str(SOURCE), "-o", str(tmp)], capture_output=True, text=True
        )
        if proc.returncode != 0:
            raise RuntimeError(f"building the CPU bandwidth probe failed:\n{proc.stderr}")
        os.replace(tmp, binary)
    return binary


def parse(output: str) -> tuple[str, dict[int, float]]:
    """The probe's stdout -> (isa, {threads: GB/s})."""
    isa, rates = "?", {}
    for line in output.splitlines():
        if line.startswith("# isa "):
            isa = line.split()[2].rstrip(",")
        elif line.strip() and not line.startswith("#"):
            threads, gbps = line.split()
            rates[int(threads)] = float(gbps)
    return isa, rates


def measure(
    threads: list[int], gigabytes: float = 8.0, passes: int = 5
) -> tuple[str, dict[int, float]]:
    """Best-of-`passes` read GB/s at each thread count (threads spread over the cores)."""
    env = dict(os.environ, OMP_PROC_BIND="spread", OMP_PLACES="threads")
    proc = subprocess.run(
        [str(build()), f"{gigabytes:g}", ",".join(map(str, threads)), str(passes)],
        capture_output=True,
        text=True,
        env=env,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"the CPU bandwidth probe failed: {proc.stderr.strip()}")
    return parse(proc.stdout)


def read_bandwidth_gbps(threads: int, gigabytes: float = 2.0, passes: int = 5) -> float:
    """The floor's bandwidth for a benchmark that reads with `threads` threads (2 GB is
    several times the largest L3 the project meets: 300 MB on the GPU machine)."""
    return measure([threads], gigabytes, passes)[1][threads]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--gigabytes", type=float, default=8.0, help="buffer size (far above the L3)")
    p.add_argument("--threads", type=int, nargs="+", default=[os.cpu_count() or 1])
    p.add_argument("--passes", type=int, default=5)
    a = p.parse_args(argv)
    isa, rates = measure(a.threads, a.gigabytes, a.passes)
    print(f"# CPU read bandwidth ({isa} loads, {a.gigabytes:g} GB buffer, best of {a.passes})")
    for threads, gbps in rates.items():
        print(f"threads {threads:3d}  {gbps:7.1f} GB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The AMX kernels (ext/cpu/kernels_amx.cpp, kernels_amx_int8.cpp, linear_amx.cpp) on CPUs
without AMX.

A second build of the extension (TANDEM_CPU_AMX_EMULATE=1, ext/cpu/build.py) runs their tile
instructions in software (ext/cpu/amx_emulate.h, which also checks every tile op's operand
shapes), so the pool's own "amx" tests run the AMX units' layouts, tile widths and token
thresholds here, in a child process (one process loads one build of `_tandem_cpu`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import tandem
from tandem.ext.cpu import supported_isas

ROOT = Path(__file__).resolve().parents[2]
POOL_TESTS = [
    "tests/ext/test_cpu_pool.py",
    "tests/ext/test_cpu_int8_path.py",
    "tests/ext/test_packed_rows.py",
    "tests/ext/test_cpu_pool_bias.py",
    "tests/ext/test_cpu_linear.py",
]
# The 300-token case of the quantized-activation parity takes ~45 s a format with software
# tiles; its smaller cases (1-64 tokens, both tile paths) stay.
SLOW_CASES = [
    f"tests/ext/test_cpu_int8_path.py::test_parity_with_quantized_activation_reference[3-{c}-amx]"
    for c in ("int8-64", "int4-32", "int4-64")
]


def _env() -> dict[str, str]:
    # the child imports the `tandem` this process imported (a worktree's, not an installed one)
    here = str(Path(tandem.__file__).parent.parent)
    path = os.pathsep.join(p for p in (here, str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, TANDEM_CPU_AMX_EMULATE="1", PYTHONPATH=path)
    env.pop("TANDEM_CPU_ISA", None)
    return env


@pytest.fixture(scope="module")
def emulated():
    if "avx512" not in supported_isas():
        pytest.skip("emulated AMX runs the AMX units' AVX-512 code: this CPU has no AVX-512 path")
    probe = (
        "import tandem; from tandem.ext.cpu.build import load_extension; m = load_extension(); "
        "print(m.amx_emulated, 'amx' in m.supported_isas(), tandem.__file__)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, env=_env(), capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[:2] == ["True", "True"], proc.stdout
    assert proc.stdout.split()[2] == tandem.__file__, proc.stdout  # this checkout's code


def test_emulated_amx_pool_tests(emulated):
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-k", "amx"]
    cmd += [f"--deselect={c}" for c in SLOW_CASES] + POOL_TESTS
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True)
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, tail
    summary = [ln for ln in proc.stdout.splitlines() if " passed" in ln]
    assert summary and "failed" not in summary[-1], tail
    # the amx cases ran (a -k that matched nothing would pass with "no tests ran": rc 5)
    assert int(summary[-1].split(" passed")[0].split()[-1]) >= 50, summary[-1]

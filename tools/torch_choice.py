"""Which torch build `tools/install.sh` installs: keep one already there, the CUDA build only
where an NVIDIA driver is present, the CPU build otherwise (never PyPI's multi-GB CUDA wheel
on a machine that cannot use it).

Standard library only: it runs before torch exists. `plan_torch` is pure (tested with fake
inputs); `python tools/torch_choice.py --install` runs its plan.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass

TORCH_VERSION = "2.13.0"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
FORCE_ENV = "TANDEM_TORCH"  # cpu | cuda: overrides the driver check (an installed torch stays)


@dataclass(frozen=True)
class TorchPlan:
    build: str  # "keep" | "cpu" | "cuda"
    reason: str
    attempts: tuple[tuple[str, ...], ...] = ()  # pip argument lists, tried in order until one works


def nvidia_driver_present(
    proc_dir: str = "/proc/driver/nvidia",
    which: Callable[[str], str | None] = shutil.which,
    exists: Callable[[str], bool] = os.path.exists,
) -> bool:
    """True where the NVIDIA kernel driver is loaded or its `nvidia-smi` is installed."""
    return exists(proc_dir) or which("nvidia-smi") is not None


def plan_torch(installed: str | None, driver: bool, force: str | None = None) -> TorchPlan:
    """The build to install given the installed torch version (None: none), whether an NVIDIA
    driver is present, and an optional `TANDEM_TORCH` override."""
    if installed:
        kind = "CPU" if "+cpu" in installed else "as installed"
        return TorchPlan("keep", f"torch {installed} is already installed ({kind}); kept")
    if force not in (None, "", "cpu", "cuda"):
        raise ValueError(f"{FORCE_ENV} must be cpu or cuda, got {force!r}")
    pin = f"torch=={TORCH_VERSION}"
    if force == "cuda" or (driver and force != "cpu"):
        why = f"{FORCE_ENV}=cuda" if force == "cuda" else "an NVIDIA driver is present"
        return TorchPlan("cuda", f"{why}: installing the CUDA build of {pin}", ((pin,),))
    why = f"{FORCE_ENV}=cpu" if force == "cpu" else "no NVIDIA driver found"
    return TorchPlan(
        "cpu",
        f"{why}: installing the CPU build of {pin}",
        # The CPU wheel index first; then only a local wheel (pip's find-links), never PyPI,
        # whose Linux torch is the CUDA build.
        ((pin, "--index-url", CPU_INDEX), ("--no-index", pin)),
    )


def _installed_torch(python: str) -> str | None:
    probe = subprocess.run(
        [python, "-c", "import torch; print(torch.__version__)"],
        capture_output=True,
        text=True,
    )
    return probe.stdout.strip() if probe.returncode == 0 and probe.stdout.strip() else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--install", action="store_true", help="run the plan (default: print it)")
    p.add_argument("--python", default=sys.executable)
    args = p.parse_args(argv)
    try:
        plan = plan_torch(
            _installed_torch(args.python), nvidia_driver_present(), os.environ.get(FORCE_ENV)
        )
    except ValueError as e:
        print(f"[tandem] error: {e}", file=sys.stderr)
        return 2
    print(f"[tandem] {plan.reason}", file=sys.stderr)
    if not args.install:
        for attempt in plan.attempts:
            print("pip install " + " ".join(attempt))
        return 0
    for i, attempt in enumerate(plan.attempts):
        cmd = [args.python, "-m", "pip", "install", "-q", *attempt]
        if plan.build == "cpu" and "--index-url" in attempt:
            cmd += ["--retries", "1", "--timeout", "30"]
        if subprocess.run(cmd).returncode == 0:
            installed = _installed_torch(args.python)
            print(f"[tandem] installed torch {installed}", file=sys.stderr)
            return 0
        if i + 1 < len(plan.attempts):
            print("[tandem] that source did not work; trying the next", file=sys.stderr)
    if plan.attempts:
        print(f"[tandem] error: could not install the {plan.build} build of torch", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""tools/torch_choice.py: the torch build install.sh picks, from fake machine facts."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _tool():
    spec = importlib.util.spec_from_file_location(
        "torch_choice", ROOT / "tools" / "torch_choice.py"
    )
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


tc = _tool()


def test_installed_torch_is_kept_whatever_the_machine() -> None:
    for driver in (False, True):
        plan = tc.plan_torch("2.11.0+cu130", driver)
        assert plan.build == "keep" and plan.attempts == ()
        assert "2.11.0+cu130" in plan.reason
    assert "CPU" in tc.plan_torch("2.13.0+cpu", True).reason


def test_no_driver_gets_the_cpu_index_first_and_never_plain_pypi() -> None:
    plan = tc.plan_torch(None, driver=False)
    assert plan.build == "cpu"
    first, *rest = plan.attempts
    assert first == ("torch==2.13.0", "--index-url", tc.CPU_INDEX)
    # Fallbacks may only read local wheels: a bare `torch==2.13.0` from PyPI is the CUDA build.
    assert rest and all("--no-index" in a for a in rest)
    assert "no NVIDIA driver" in plan.reason


def test_driver_gets_the_cuda_build() -> None:
    plan = tc.plan_torch(None, driver=True)
    assert plan.build == "cuda"
    assert plan.attempts == (("torch==2.13.0",),)


def test_override() -> None:
    assert tc.plan_torch(None, driver=True, force="cpu").build == "cpu"
    assert tc.plan_torch(None, driver=False, force="cuda").build == "cuda"
    assert "TANDEM_TORCH=cpu" in tc.plan_torch(None, driver=True, force="cpu").reason
    with pytest.raises(ValueError, match="TANDEM_TORCH"):
        tc.plan_torch(None, driver=False, force="rocm")


def test_driver_detection() -> None:
    def nowhere(_: str) -> bool:
        return False

    assert not tc.nvidia_driver_present(which=lambda _: None, exists=nowhere)
    assert tc.nvidia_driver_present(which=lambda _: "/usr/bin/nvidia-smi", exists=nowhere)
    assert tc.nvidia_driver_present(
        "/proc/driver/nvidia", which=lambda _: None, exists=lambda p: p == "/proc/driver/nvidia"
    )


def test_cli_prints_the_plan_without_installing(tmp_path: Path, capsys) -> None:
    fake_python = tmp_path / "python"
    fake_python.write_text("#!/bin/sh\nexit 1\n")  # a Python without torch
    fake_python.chmod(0o755)
    assert tc.main(["--python", str(fake_python)]) == 0
    out, err = capsys.readouterr()
    assert "pip install" in out and "torch==2.13.0" in out
    assert "[tandem]" in err

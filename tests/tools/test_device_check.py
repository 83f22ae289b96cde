"""tools/device_check.sh: every stage it lists is a script in tools/device/ and every script
there (but the sourced env.sh) is a listed stage; unknown stages are refused."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(ROOT / "tools" / "device_check.sh"), *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_listed_stages_are_the_scripts() -> None:
    proc = run("list")
    assert proc.returncode == 0
    listed = {
        line.split()[0]
        for line in proc.stdout.splitlines()
        if line and not line.startswith(" ") and "  " in line
    }
    scripts = {p.stem for p in (ROOT / "tools" / "device").glob("*.sh")} - {"env"}
    assert listed == scripts


def test_unknown_stage_is_refused_before_anything_runs() -> None:
    proc = run("gpu,nope")
    assert proc.returncode == 2
    assert "unknown stage 'nope'" in proc.stderr and "=====" not in proc.stdout

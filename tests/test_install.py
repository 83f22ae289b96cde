"""The distribution installs one top-level package, `tandem` (app/, runtime/, models/ and ext/
as tandem.app, tandem.runtime, ...): a fresh install imports under that name only, and nothing
generic (a `models` or `runtime` of its own) lands at the top of site-packages."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_a_fresh_install_imports_as_tandem_only(tmp_path: Path) -> None:
    wheels, target = tmp_path / "wheels", tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
    # built from a copy: setuptools leaves build/ and *.egg-info beside the sources it builds
    src = tmp_path / "src"
    skip = shutil.ignore_patterns("__pycache__", "*.so", "build", "*.egg-info")
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "__init__.py", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for name in ("app", "runtime", "models", "ext"):
        shutil.copytree(ROOT / name, src / name, ignore=skip)
    subprocess.run([*pip, "wheel", "--no-deps", "-w", str(wheels), str(src)], check=True)
    (wheel,) = wheels.glob("tandem_serve-*.whl")
    subprocess.run([*pip, "install", "--no-deps", "--target", str(target), str(wheel)], check=True)
    top = {p.name for p in target.iterdir() if not p.name.endswith(".dist-info")}
    assert top <= {"tandem", "bin"}, top
    assert (target / "tandem" / "ext" / "cuda" / "paged_decode.cu").exists()  # package data
    assert (target / "tandem" / "app" / "webui" / "index.html").exists()
    check = (
        "import importlib.util, tandem, tandem.runtime.llm, tandem.app.server\n"
        "from tandem import LLM, SamplingParams\n"
        f"assert tandem.runtime.__file__.startswith({str(target)!r}), tandem.runtime.__file__\n"
        "assert all(importlib.util.find_spec(n) is None for n in ('app', 'runtime', 'models', 'ext'))\n"
    )
    env = dict(os.environ, PYTHONPATH=str(target))
    subprocess.run([sys.executable, "-c", check], check=True, cwd=tmp_path, env=env)

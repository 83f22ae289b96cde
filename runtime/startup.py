"""Start-up phase timing: `with startup_phase("weights"):` logs the phase's name, duration and
the process's resident memory after it at INFO (shown by `tandem ... -v`), so a slow or
memory-hungry start names the step that took the time or the bytes."""

from __future__ import annotations

import ctypes
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

log = logging.getLogger(__name__)


def resident_bytes() -> tuple[int, int]:
    """(VmRSS, VmHWM) of this process in bytes from /proc/self/status; (0, 0) where there is
    none (not Linux)."""
    rss = hwm = 0
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    rss = int(line.split()[1]) * 1024
                elif line.startswith("VmHWM:"):
                    hwm = int(line.split()[1]) * 1024
    except OSError:
        pass
    return rss, hwm


def release_free_heap() -> None:
    """Return the C heap's free pages to the OS (glibc `malloc_trim`; a no-op elsewhere). Loading
    frees many small temporaries (GGUF metadata parsed as Python objects, per-tensor copies) whose
    pages malloc otherwise keeps resident for the process's life."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


@contextmanager
def startup_phase(name: str) -> Iterator[None]:
    t0 = time.perf_counter()
    rss0 = resident_bytes()[0]
    log.info("start-up: %s ...", name)
    yield
    rss, hwm = resident_bytes()
    log.info(
        "start-up: %s done in %.2fs; RSS %.0f MB (%+.0f), peak %.0f MB",
        name, time.perf_counter() - t0, rss / 1e6, (rss - rss0) / 1e6, hwm / 1e6,
    )  # fmt: skip

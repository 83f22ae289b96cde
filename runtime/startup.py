"""Start-up phase timing: `with startup_phase("weights"):` logs the phase's name and duration
at INFO (shown by `tandem ... -v`), so a slow start names the step that took the time."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

log = logging.getLogger(__name__)


@contextmanager
def startup_phase(name: str) -> Iterator[None]:
    t0 = time.perf_counter()
    log.info("start-up: %s ...", name)
    yield
    log.info("start-up: %s done in %.2fs", name, time.perf_counter() - t0)

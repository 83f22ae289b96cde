"""Test-wide set-up. The CPU expert pool's conversion cache goes to a temporary directory for
the whole session, so test runs never fill the user's $TANDEM_HOME/expert_cache: every model
a test writes to a fresh temporary path gets cache entries of its own, which nothing would
ever read again. Tests of the cache itself point TANDEM_HOME / TANDEM_EXPERT_CACHE at their
own tmp_path; a TANDEM_EXPERT_CACHE set by the caller is left as it is."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tandem.ext.cpu.cache import EXPERT_CACHE_ENV


@pytest.fixture(autouse=True, scope="session")
def _session_expert_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    if EXPERT_CACHE_ENV in os.environ:
        yield
        return
    os.environ[EXPERT_CACHE_ENV] = str(tmp_path_factory.mktemp("expert_cache"))
    try:
        yield
    finally:
        os.environ.pop(EXPERT_CACHE_ENV, None)

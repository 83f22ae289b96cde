"""Per-app server state shared by handlers, stored on the aiohttp app under `STATE_KEY`."""

from __future__ import annotations

import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from aiohttp import web

from tandem.app.config import ServerConfig
from tandem.runtime.loop import EngineLoop


class TokenText:
    """Text and UTF-8 bytes of single tokens, for logprobs; cached per token id."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self.get = lru_cache(maxsize=65536)(self._decode)

    def _decode(self, token_id: int) -> tuple[str, list[int]]:
        text = self._tokenizer.decode([token_id], skip_special_tokens=False)
        return text, list(text.encode("utf-8"))


# Request bodies of at least this many bytes are validated and tokenized on a worker thread.
PARSE_OFF_LOOP_BYTES = 16 * 1024
PARSE_THREADS = 2  # at most this many such bodies at once; the others wait their turn


@dataclass
class ServerState:
    config: ServerConfig
    engine_loop: EngineLoop
    token_text: TokenText
    created: int = field(default_factory=lambda: int(time.time()))
    websockets: weakref.WeakSet[web.WebSocketResponse] = field(default_factory=weakref.WeakSet)
    # threads are started on first use; a cancelled request's parse still holds its thread
    parse_pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(PARSE_THREADS, thread_name_prefix="parse")
    )

    @property
    def model_name(self) -> str:
        """The id clients see in /v1/models and in every response's `model` field."""
        return self.config.served_model_name or self.engine_loop.model_name

    @property
    def model_names(self) -> tuple[str, ...]:
        """Names a request may use: the served name first, then the engine's own."""
        names = [self.model_name, self.engine_loop.model_name]
        return tuple(dict.fromkeys(names))


STATE_KEY = web.AppKey("tandem_state", ServerState)

"""The server's frozen configuration: network, auth and admission settings around an EngineConfig.

Built once from argv in `app/serve.py` (the only place that also reads the environment).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.runtime.config import EngineConfig


@dataclass(frozen=True)
class ServerConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)
    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: tuple[str, ...] = ()  # empty: no auth
    served_model_name: str | None = None  # None: the engine's model name
    max_queue: int = 256  # sequences that may wait beyond those running
    shutdown_timeout: float = 30.0  # seconds to drain in-flight requests on SIGTERM
    max_body_bytes: int = 8 * 1024 * 1024
    ws_heartbeat_s: float = 30.0
    web_ui: bool = True  # the chat page at / (app/webui)
    idle_timeout_s: float = 15.0  # a connection without a complete request for this long closes
    body_timeout_s: float = 60.0  # to receive a request body once its headers are in (else 408)
    allowed_origins: tuple[str, ...] = ()  # CORS: browser origins allowed ("*": any)
    # completion tokens of a request that sets none (None: up to the end of the context)
    max_tokens_default: int | None = 1024
    # reader wake-ups a second over all streams above 16 open ones (None: every step's delta)
    stream_wakeups: int | None = 8000
    # the engine in a child process (runtime/engine_process.py), off the event loop's GIL;
    # None: on for one CUDA device (runtime.engine_process.use_engine_process)
    engine_process: bool | None = None

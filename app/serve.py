"""`tandem serve`: its arguments, the ServerConfig they build, and the serving lifecycle.

`app/cli.py` parses argv and calls `run_server(args)`. This module reads the environment
(TANDEM_API_KEY) in one place, loads the engine, runs aiohttp on uvloop, and on SIGTERM or
SIGINT stops admitting (503), drains up to --shutdown-timeout, aborts the rest, and returns 0;
if the engine fails, it ends the streams in flight and returns ENGINE_DEAD_EXIT.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import logging
import os
import signal
import socket
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from tandem.app.config import ServerConfig
from tandem.app.engine_args import add_engine_arguments, count_arg, engine_config_from_args
from tandem.app.http_guard import GuardedAppRunner
from tandem.app.server import create_app
from tandem.app.version import tandem_version
from tandem.runtime.loop import EngineLoop
from tandem.runtime.stream import WakePacer

logger = logging.getLogger("tandem.app.serve")

API_KEY_ENV = "TANDEM_API_KEY"
ENGINE_DEAD_EXIT = 3  # the exit status after an engine failure


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="the model to serve, as --model takes it (default: smollm2-135m-instruct)",
    )
    add_engine_arguments(parser)
    parser.add_argument(
        "--served-model-name",
        default=None,
        help="the model id clients see (default: the engine's model name)",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=None,
        help="seeds the random state of requests without a seed, and dummy weights",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on")
    parser.add_argument(
        "--allowed-origins",
        action="append",
        default=None,
        metavar="ORIGIN",
        help="browser origins allowed to call the API (CORS), e.g. http://localhost:3000 or *; "
        "repeatable or comma-separated (default: none, same-origin only)",
    )
    parser.add_argument(
        "--max-tokens-default",
        type=int,
        default=ServerConfig.max_tokens_default,
        help="completion tokens of a request that sets no max_tokens; 0: up to the end of the "
        "context",
    )
    parser.add_argument(
        "--stream-wakeups",
        type=count_arg(0),
        default=ServerConfig.stream_wakeups,
        help="above 16 open streams, wake the streams' readers at most this often a second in "
        "all (a stream then gets several tokens in one chunk, spending less host time per "
        "token); 0: every step's tokens go out at once",
    )
    parser.add_argument(
        "--engine-process",
        action=argparse.BooleanOptionalAction,
        default=ServerConfig.engine_process,
        help="run the engine in a child process, so that its Python and the HTTP event loop's "
        "do not share one GIL (more tokens/s at many streams); default: on for one CUDA "
        "device, off on the CPU, with --cpu-experts and under tensor parallelism",
    )
    parser.add_argument(
        "--api-key",
        action="append",
        default=None,
        metavar="KEY",
        help=f"require 'Authorization: Bearer KEY' (repeatable; also ${API_KEY_ENV})",
    )
    parser.add_argument(
        "--max-queue",
        type=int,
        default=ServerConfig.max_queue,
        help="sequences that may wait beyond those running; more get 429",
    )
    parser.add_argument(
        "--shutdown-timeout",
        type=float,
        default=ServerConfig.shutdown_timeout,
        help="seconds to drain in-flight requests on SIGTERM before aborting",
    )
    parser.add_argument(
        "--max-body-bytes",
        type=int,
        default=ServerConfig.max_body_bytes,
        help="largest request body; larger get 413",
    )
    parser.add_argument(
        "--no-ui", action="store_true", help="do not serve the Web UI (the chat page at /)"
    )


def resolve_model_argument(args: argparse.Namespace) -> None:
    """`tandem serve MODEL` and `--model MODEL` are the same; both, differing, is an error."""
    tag = getattr(args, "model_tag", None)
    if tag is not None and args.model is not None and tag != args.model:
        raise ValueError(f"the model is given twice: {tag!r} and --model {args.model!r}")
    args.model = args.model or tag


def _origins(values: list[str] | None) -> tuple[str, ...]:
    items = [o.strip() for v in values or [] for o in v.split(",")]
    return tuple(dict.fromkeys(o.rstrip("/") for o in items if o))


def server_config_from_args(
    args: argparse.Namespace, environ: Mapping[str, str] = os.environ
) -> ServerConfig:
    """The one place argv values and the environment become configuration."""
    keys = list(getattr(args, "api_key", None) or [])
    if environ.get(API_KEY_ENV):
        keys.append(environ[API_KEY_ENV])
    engine = engine_config_from_args(args)
    return ServerConfig(
        engine=engine,
        host=args.host,
        port=args.port,
        api_keys=tuple(dict.fromkeys(keys)),
        served_model_name=args.served_model_name,
        max_queue=args.max_queue,
        shutdown_timeout=args.shutdown_timeout,
        max_body_bytes=getattr(args, "max_body_bytes", ServerConfig.max_body_bytes),
        web_ui=not getattr(args, "no_ui", False),
        allowed_origins=_origins(getattr(args, "allowed_origins", None)),
        max_tokens_default=getattr(args, "max_tokens_default", ServerConfig.max_tokens_default)
        or None,
        stream_wakeups=getattr(args, "stream_wakeups", ServerConfig.stream_wakeups) or None,
        engine_process=getattr(args, "engine_process", ServerConfig.engine_process),
    )


@dataclass
class RunningServer:
    runner: web.AppRunner
    engine_loop: EngineLoop
    port: int

    async def shutdown(self, timeout: float) -> int:
        """Stop admitting, drain up to `timeout` s, abort the rest, close the server."""
        aborted = await self.engine_loop.drain(timeout)
        await self.runner.cleanup()
        return aborted


async def start_server(config: ServerConfig, engine: Any) -> RunningServer:
    """Start listening on config.host:config.port (0 picks a free port) around `engine`."""
    engine_loop = EngineLoop(
        engine,
        max_queue=config.max_queue,
        max_running=config.engine.scheduler.max_num_seqs,
        pacer=WakePacer(config.stream_wakeups),
    )
    runner = GuardedAppRunner(
        create_app(config, engine_loop),
        idle_timeout=config.idle_timeout_s,
        handler_cancellation=True,
        shutdown_timeout=5.0,
        access_log=None,
    )
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port)
    try:
        await site.start()
    except OSError as e:
        await runner.cleanup()
        raise PortUnavailableError(config.host, config.port, e) from None
    port = runner.addresses[0][1] if runner.addresses else config.port
    return RunningServer(runner, engine_loop, port)


async def serve_until_signal(config: ServerConfig, engine: Any) -> int:
    server = await start_server(config, engine)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    logger.info(
        "Tandem %s ready: serving %s on http://%s:%d (auth %s)",
        tandem_version(),
        config.served_model_name or engine.model_name,
        config.host,
        server.port,
        "on" if config.api_keys else "off",
        extra={"progress": True},
    )
    dead = asyncio.ensure_future(server.engine_loop.wait_dead())
    signalled = asyncio.ensure_future(stop.wait())
    await asyncio.wait((dead, signalled), return_when=asyncio.FIRST_COMPLETED)
    signalled.cancel()
    if dead.done():
        # In-flight streams have ended with a generic error and nothing is admitted; exit
        # non-zero so that a supervisor (Docker's restart policy, Kubernetes) restarts us.
        logger.error("the engine failed (see above); exiting with status %d", ENGINE_DEAD_EXIT)
        await server.runner.cleanup()
        return ENGINE_DEAD_EXIT
    dead.cancel()
    stop.clear()
    logger.warning(
        "shutting down: draining for up to %.1fs (signal again to abort now)",
        config.shutdown_timeout,
    )
    server.engine_loop.begin_drain()
    forced: list[int] = []

    async def abort_on_second_signal() -> None:
        # A second Ctrl-C / SIGTERM does not wait out the drain: abort what still runs now.
        await stop.wait()
        ids = server.engine_loop.request_ids()
        logger.warning("second signal: aborting %d request(s) now", len(ids))
        for request_id in ids:
            server.engine_loop.abort(request_id)
        forced.append(len(ids))

    forcer = asyncio.create_task(abort_on_second_signal())
    try:
        aborted = await server.shutdown(config.shutdown_timeout)
    finally:
        forcer.cancel()
    logger.warning("stopped (%d request(s) aborted)", aborted + sum(forced))
    return 0


def _asyncio_run(coro: Any) -> int:
    try:
        import uvloop
    except ImportError:  # no uvloop (e.g. Windows): the stdlib loop works too
        return asyncio.run(coro)
    return uvloop.run(coro)


def run_server(args: argparse.Namespace) -> int:
    """Entry point of `tandem serve`: load the engine, serve until SIGTERM, exit 0."""
    logging.basicConfig(
        stream=sys.stderr,
        level=logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    resolve_model_argument(args)
    config = server_config_from_args(args)
    check_port_free(config.host, config.port)  # before minutes of loading, not after
    from tandem.runtime.engine_process import EngineProcess, use_engine_process

    if use_engine_process(config.engine, config.engine_process):
        engine: Any = EngineProcess(config.engine)
        try:
            return _asyncio_run(serve_until_signal(config, engine))
        finally:
            engine.close()
    from tandem.runtime.engine import Engine  # lazy: the app layer itself never imports torch

    engine = Engine(config.engine)
    return _asyncio_run(serve_until_signal(config, engine))


class PortUnavailableError(ValueError):
    """The server cannot listen on host:port (in use, or not an address of this machine)."""

    def __init__(self, host: str, port: int, cause: OSError) -> None:
        reason = (
            "the address is already in use (another server? pick one with --port)"
            if cause.errno == errno.EADDRINUSE
            else cause.strerror or str(cause)
        )
        super().__init__(f"cannot listen on {host}:{port}: {reason}")


def check_port_free(host: str, port: int) -> None:
    """Raises PortUnavailableError if host:port cannot be bound now."""
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise PortUnavailableError(host, port, OSError(e.errno, e.strerror)) from None
    for family, type_, proto, _, addr in infos:
        with socket.socket(family, type_, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as aiohttp binds
            try:
                sock.bind(addr)
            except OSError as e:
                raise PortUnavailableError(host, port, e) from None

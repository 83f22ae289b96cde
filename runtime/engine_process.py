"""The engine in a process of its own: `EngineProcess` stands in for `Engine` in `EngineLoop`.

In one process the engine thread and the HTTP event loop share one GIL, so at hundreds of
streams the server's rate is one over the host CPU per token of both together. Here a child
process builds the `Engine` from its `EngineConfig` and steps it back to back as the offline
API does, applying adds and aborts between steps; each step goes back as one message (its
deltas as plain tuples, the engine's stats, whether work is left). This process only reads
those messages and serves HTTP. No HTTP here.

Protocol (a pipe each way; the child answers in order): parent → child `("add", token,
items)`, `("abort", ids)`, `("stop",)`; child → parent `("hello", info)` or `("error", text,
error)` once at start, then `("added", token, errors, stats, unfinished)` per add batch and
`("step", deltas, stats, unfinished)` per step, and `("fatal", text)` before a child that
failed exits. A child that reported unfinished work always sends another step message.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import pickle
import queue
import signal
import threading
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from tandem.runtime.config import EngineConfig
from tandem.runtime.sampling_params import SamplingParams, SamplingParamsError
from tandem.runtime.types import EngineStats, RequestDelta

log = logging.getLogger(__name__)

# One sequence to add: (request id, prompt token ids, params, priority, group).
AddItem = tuple[str, list[int], SamplingParams, int, "str | None"]


def use_engine_process(config: EngineConfig, choice: bool | None) -> bool:
    """`choice`, or where None (the default): on for one CUDA device, where the engine's host
    work per token is what limits a busy server; off on the CPU, where the engine's forward
    wants every core, with experts asked on the CPU pool (its threads take all cores but two,
    measured without this process's extra threads), and under tensor parallelism."""
    if choice is not None:
        return choice
    spec = config.model
    if spec.tensor_parallel_size != 1 or spec.cpu_experts or spec.expert_backend == "cpu_pool":
        return False
    from tandem.runtime.engine_setup import resolve_device

    try:
        return resolve_device(config.model.device).type == "cuda"
    except ValueError:  # no such device: the engine reports it, in this process
        return False


class EngineProcessError(RuntimeError):
    """The engine process failed to start, died, or reported a fatal error."""


def pack_delta(d: RequestDelta) -> tuple:
    """A `RequestDelta` as a plain tuple: pickles several times faster than the dataclass."""
    return (
        d.request_id, d.new_token_ids, d.new_text, d.finish_reason, d.stop_reason, d.logprobs,
        d.num_prompt_tokens, d.num_output_tokens, d.num_cached_tokens, d.error,
    )  # fmt: skip


def _pack_error(exc: BaseException) -> tuple:
    if isinstance(exc, SamplingParamsError):
        return ("params", exc.param, str(exc))
    try:
        return ("pickled", pickle.loads(pickle.dumps(exc)))
    except Exception:
        return ("value", type(exc).__name__, str(exc))


def _unpack_error(t: tuple | None) -> BaseException | None:
    if t is None:
        return None
    if t[0] == "params":
        return SamplingParamsError(t[1], t[2])
    if t[0] == "pickled":
        return t[1]
    return ValueError(t[2])


class EngineProcess:
    """`EngineLoop`'s engine, run in a child process (spawned: CUDA is initialised there only).

    Calls come from the loop's engine thread only (`add_requests`, `abort_request`, `step`,
    `has_unfinished_requests`), as they would on an `Engine`. `add_requests` waits for the
    child's answer (at most one step), so a bad request still fails its `submit()`.
    """

    def __init__(self, config: EngineConfig, *, start_timeout_s: float | None = None) -> None:
        ctx = mp.get_context("spawn")
        cmd_child, self._cmd = ctx.Pipe(duplex=False)  # parent -> child
        self._conn, out_child = ctx.Pipe(duplex=False)  # child -> parent
        level = logging.getLogger().getEffectiveLevel()
        self._proc = ctx.Process(
            target=_child_main,
            args=(cmd_child, out_child, config, level),
            name="tandem-engine",
            daemon=False,  # may start processes of its own (tensor-parallel ranks)
        )
        self._proc.start()
        cmd_child.close()
        out_child.close()
        # Stops the child when this object goes, at the latest at interpreter exit (before
        # multiprocessing joins its children, which would wait on a child waiting for us).
        self._finalizer = weakref.finalize(self, _stop_child, self._proc, self._cmd, self._conn)
        try:
            if start_timeout_s is not None and not self._conn.poll(start_timeout_s):
                raise EngineProcessError(f"the engine process did not start in {start_timeout_s} s")
            msg = self._recv()
        except BaseException:  # a timeout, Ctrl-C while the model loads: nothing to wait for
            self._proc.kill()
            self.close()
            raise
        if msg[0] != "hello":
            self.close()
            exc = _unpack_error(msg[2])
            if isinstance(exc, (ValueError, OSError)):  # bad settings: as the engine raises them
                raise exc
            raise EngineProcessError(f"the engine process failed to start: {msg[1]}")
        info = msg[1]
        self.tokenizer = info["tokenizer"]
        self.model_name: str = info["model_name"]
        self.max_model_len: int = info["max_model_len"]
        self._vocab_size: int = info["vocab_size"]
        self._eos_token_ids: tuple[int, ...] = info["eos_token_ids"]
        self._stats: EngineStats = info["stats"]
        self._unfinished = False
        self._pending: deque[tuple] = deque()  # step messages read while waiting for an ack
        self._next_token = 0
        self._grammar_compiler: Any = None
        self._closing = False
        # EngineLoop sets it: called (from a watcher thread) if the child dies while idle, too
        self.on_fatal: Callable[[str], None] | None = None
        threading.Thread(
            target=_watch_child, args=(self._proc, weakref.ref(self)), daemon=True,
            name="engine-process-watch",
        ).start()  # fmt: skip

    @property
    def grammar_compiler(self) -> Any:
        """This side's compiler: checks a grammar before admission (the child compiles its own
        when the request arrives)."""
        if self._grammar_compiler is None:
            from tandem.runtime.grammar import grammar_compiler_for

            self._grammar_compiler = grammar_compiler_for(
                self.tokenizer, self._vocab_size, self._eos_token_ids
            )
        return self._grammar_compiler

    # ---- the EngineLoop's calls (its engine thread) -------------------------------------
    def add_requests(self, items: Sequence[AddItem]) -> list[BaseException | None]:
        """Add sequences in one round trip -> per item, the error `Engine.add_request` raised
        (None: added)."""
        token = self._next_token
        self._next_token += 1
        self._send(("add", token, list(items)))
        while True:
            msg = self._recv()
            if msg[0] == "added" and msg[1] == token:
                self._stats, self._unfinished = msg[3], msg[4]
                return [_unpack_error(e) for e in msg[2]]
            self._pending.append(msg)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        *,
        group: str | None = None,
    ) -> None:
        (error,) = self.add_requests([(request_id, prompt_token_ids, params, priority, group)])
        if error is not None:
            raise error

    def abort_request(self, request_id: str) -> None:
        self._send(("abort", [request_id]))

    def has_unfinished_requests(self) -> bool:
        return self._unfinished or bool(self._pending)

    def step(self) -> list[RequestDelta]:
        """The deltas of the child's next step (blocks until it has sent one)."""
        fresh = not self._pending
        msg = self._recv() if fresh else self._pending.popleft()
        if msg[0] != "step":
            raise EngineProcessError(f"unexpected message from the engine process: {msg[0]}")
        if fresh:  # a step read while adding is older than the "added" answer: its state stood
            self._stats, self._unfinished = msg[2], msg[3]
        return [RequestDelta(*t) for t in msg[1]]

    def stats(self) -> EngineStats:
        return self._stats

    def close(self) -> None:
        """Stop the child (it finishes nothing more) and wait for it."""
        self._closing = True
        self._finalizer()

    # ---- pipe ---------------------------------------------------------------------------
    def _send(self, msg: tuple) -> None:
        try:
            self._cmd.send(msg)
        except OSError as exc:
            raise EngineProcessError(f"the engine process is gone ({exc})") from None

    def _recv(self) -> tuple:
        try:
            msg = self._conn.recv()
        except (EOFError, OSError):
            self._proc.join(5.0)
            raise EngineProcessError(
                f"the engine process exited (exit code {self._proc.exitcode})"
            ) from None
        if msg[0] == "fatal":
            raise EngineProcessError(f"the engine process failed: {msg[1]}")
        return msg


def _watch_child(proc: Any, owner: weakref.ref[EngineProcess]) -> None:
    """Tell the owner's `on_fatal` when the child exits without being asked to."""
    mp_connection.wait([proc.sentinel])
    engine = owner()
    if engine is not None and not engine._closing and engine.on_fatal is not None:
        engine.on_fatal(f"the engine process exited (exit code {proc.exitcode})")


def _stop_child(proc: Any, cmd: Any, out: Any, timeout_s: float = 30.0) -> None:
    if proc.is_alive():
        try:
            cmd.send(("stop",))
        except OSError:
            pass
        proc.join(timeout_s)
        if proc.is_alive():
            log.warning("the engine process did not stop in %.0f s: killing it", timeout_s)
            proc.kill()
            proc.join(5.0)
    cmd.close()
    out.close()


def _child_main(cmd_conn: Any, out_conn: Any, config: EngineConfig, log_level: int) -> None:
    """The engine process: build the engine, then apply commands and step until stopped."""
    # The parent alone decides when to stop (a terminal's Ctrl-C reaches the whole process
    # group: the parent drains; a child that died of it would fail every stream instead).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(
        level=log_level, format="%(asctime)s %(levelname)s %(name)s [engine]: %(message)s"
    )
    try:
        from tandem.runtime.engine import Engine

        engine = Engine(config)
    except BaseException as exc:  # noqa: BLE001 (reported to the parent, which raises)
        log.debug("the engine failed to start", exc_info=True)
        out_conn.send(("error", f"{type(exc).__name__}: {exc}", _pack_error(exc)))
        return
    info = {
        "tokenizer": engine.tokenizer,
        "model_name": engine.model_name,
        "max_model_len": engine.max_model_len,
        "vocab_size": engine.model_config.vocab_size,
        "eos_token_ids": tuple(engine.eos_token_ids),
        "stats": engine.stats(),
    }
    try:
        hello = pickle.dumps(("hello", info))
    except Exception as exc:  # e.g. a tokenizer that does not pickle
        text = f"its tokenizer or settings cannot reach the server process ({exc})"
        out_conn.send(("error", text, None))
        engine.close()
        return
    out_conn.send_bytes(hello)
    # Commands are read by a thread of their own, so that a parent blocked sending a large add
    # never waits on a child blocked sending a step the parent has not read yet.
    commands: queue.SimpleQueue[tuple] = queue.SimpleQueue()
    threading.Thread(
        target=_read_commands, args=(cmd_conn, commands), name="engine-commands", daemon=True
    ).start()
    try:
        _serve(commands, out_conn, engine)
    except OSError:  # the parent is gone: nobody is left to serve
        pass
    except BaseException as exc:  # noqa: BLE001
        log.exception("engine step failed; the engine process exits")
        try:
            out_conn.send(("fatal", f"{type(exc).__name__}: {exc}"))
        except OSError:
            pass
    finally:
        engine.close()


def _read_commands(conn: Any, commands: queue.SimpleQueue[tuple]) -> None:
    try:
        while True:
            commands.put(conn.recv())
    except (EOFError, OSError):  # the parent is gone
        commands.put(("stop",))


def _serve(commands: queue.SimpleQueue[tuple], out: Any, engine: Any) -> None:
    while True:
        # Idle: block for a command. Busy: take the commands already queued, then step.
        while True:
            if not engine.has_unfinished_requests():
                msg = commands.get()
            else:
                try:
                    msg = commands.get_nowait()
                except queue.Empty:
                    break
            if msg[0] == "stop":
                return
            if msg[0] == "abort":
                for request_id in msg[1]:
                    engine.abort_request(request_id)
            elif msg[0] == "add":
                errors = []
                for request_id, prompt, params, priority, group in msg[2]:
                    try:
                        engine.add_request(request_id, prompt, params, priority, group=group)
                        errors.append(None)
                    except Exception as exc:
                        errors.append(_pack_error(exc))
                out.send(
                    ("added", msg[1], errors, engine.stats(), engine.has_unfinished_requests())
                )
        deltas = engine.step()
        out.send(
            (
                "step",
                [pack_delta(d) for d in deltas],
                engine.stats(),
                engine.has_unfinished_requests(),
            )
        )

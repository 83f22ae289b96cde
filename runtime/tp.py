"""Tensor-parallel processes, rank 0's side: start ranks 1..N-1 (runtime/tp_worker.py), join
the torch.distributed group with them (NCCL on CUDA, gloo on the CPU), agree on start-up and
on the KV block count, broadcast each step's forward inputs as one packed int64 tensor, watch
the workers and stop them.
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tandem.models.batch import ForwardBatch, KVCache
from tandem.models.layers.parallel import TensorParallel, set_tp
from tandem.runtime.step_mirror import StepMirror

if TYPE_CHECKING:
    from tandem.runtime.config import EngineConfig

log = logging.getLogger(__name__)

STARTUP_TIMEOUT = timedelta(seconds=300)  # rendezvous and start-up collectives
STEP_TIMEOUT = timedelta(days=365)  # workers wait for the next step as long as the server idles
STEP, STOP = 1, 0
HEADER = 6  # cmd, tokens, seqs, block-table width, logits rows, window tables (0/1)


def set_process_env() -> None:
    """Variables every process Tandem starts runs with: NVLink multicast stays off (NCCL's
    NVLS collectives, and PyTorch's symmetric-memory multicast); spawned ranks inherit them."""
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"


def check_devices(device: torch.device, size: int) -> None:
    """One GPU per rank: refuse, before any process starts, more ranks than visible GPUs."""
    if device.type == "cuda" and torch.cuda.device_count() < size:
        raise ValueError(
            f"--tensor-parallel-size {size} needs {size} GPUs (one per rank); "
            f"{torch.cuda.device_count()} visible"
        )


def init_group(rank: int, size: int, device: torch.device) -> tuple[TensorParallel, object]:
    """Join the group (MASTER_ADDR/MASTER_PORT from the env, as torchrun sets them) and make it
    the one layers shard for. Returns it and the long-timeout group steps are broadcast on."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":  # rank r drives cuda:r unless told otherwise
        torch.cuda.set_device(device if device.index is not None else rank)
    dist.init_process_group(backend, rank=rank, world_size=size, timeout=STARTUP_TIMEOUT)
    steps = dist.new_group(list(range(size)), timeout=STEP_TIMEOUT, backend=backend)
    tp = TensorParallel(rank=rank, size=size, group=steps)
    set_tp(tp)
    return tp, steps


def agree(ok: bool, num_blocks: int, device: torch.device) -> tuple[bool, int]:
    """Start-up handshake: whether every rank loaded, and the smallest KV block count."""
    flags = torch.tensor([int(ok), num_blocks], dtype=torch.int64, device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)
    return bool(flags[0].item()), int(flags[1].item())


def pack_step(input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch):
    """(header, payload) int64 tensors describing one forward; with a window pool (GPT-OSS)
    the windowed layers' block tables (as wide as the main ones) and slots follow."""
    tables = batch.block_tables
    window = batch.window_block_tables is not None
    header = [
        STEP,
        input_ids.numel(),
        batch.num_seqs,
        tables.shape[1],
        batch.logits_indices.numel(),
        int(window),
    ]
    parts = [
        input_ids.long(),
        positions.long(),
        batch.query_start_loc.long(),
        batch.seq_lens.long(),
        tables.long().reshape(-1),
        batch.slot_mapping.long(),
        batch.logits_indices.long(),
    ]
    if window:
        assert batch.window_slot_mapping is not None
        assert batch.window_block_tables.shape == tables.shape
        parts += [batch.window_block_tables.long().reshape(-1), batch.window_slot_mapping.long()]
    payload = torch.cat(parts)
    return torch.tensor(header, dtype=torch.int64, device=payload.device), payload


def payload_size(header: list[int]) -> int:
    """int64 elements of the payload `header` announces."""
    _, t, s, width, n, window = header
    return 3 * t + 2 * s + 1 + s * width + n + (s * width + t if window else 0)


def unpack_step(
    header: list[int], payload: torch.Tensor, kv_cache: KVCache
) -> tuple[torch.Tensor, torch.Tensor, ForwardBatch]:
    _, t, s, width, n, window = header
    sizes = [t, t, s + 1, s, s * width, t, n] + ([s * width, t] if window else [])
    ids, pos, qsl, seq_lens, tables, slots, logits, *window_parts = payload.split(sizes)
    qsl_cpu = qsl.tolist()
    query_lens = [b - a for a, b in zip(qsl_cpu, qsl_cpu[1:], strict=False)]
    seq_lens_cpu = seq_lens.tolist()
    batch = ForwardBatch(
        query_start_loc=qsl.int(),
        seq_lens=seq_lens.int(),
        block_tables=tables.int().reshape(s, width),
        slot_mapping=slots.contiguous(),
        logits_indices=logits.contiguous(),
        query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens_cpu,
        kv_cache=kv_cache,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens_cpu),
    )
    if window_parts:
        window_tables, window_slots = window_parts
        batch.window_block_tables = window_tables.int().reshape(s, width)
        batch.window_slot_mapping = window_slots.contiguous()
    return ids.contiguous(), pos.contiguous(), batch


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TensorParallelGroup:
    """Rank 0's handle on the workers: started in the constructor, stopped by `close` (also at
    exit). Workers die with this process (PR_SET_PDEATHSIG) if it is killed."""

    def __init__(
        self, config: EngineConfig, model_config, device: torch.device, runner_options=None
    ) -> None:
        """`runner_options`: the CUDA runner's options, which every rank must share."""
        size = config.model.tensor_parallel_size
        check_devices(device, size)
        set_process_env()
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ["MASTER_PORT"] = str(_free_port())
        os.environ["WORLD_SIZE"] = str(size)
        ctx = mp.get_context("spawn")
        self.errors = ctx.SimpleQueue()
        self.device = device
        from tandem.runtime.tp_worker import worker_main

        self.procs = [
            ctx.Process(
                target=worker_main,
                args=(rank, size, config, model_config, self.errors, runner_options),
                name=f"tandem-tp{rank}",
                daemon=True,
            )
            for rank in range(1, size)
        ]
        for p in self.procs:
            p.start()
        self._closed = False
        self._agreed = False
        self._mirror: StepMirror | None = None
        self._watch: threading.Thread | None = None
        atexit.register(self.close)
        try:
            self.tp, self.steps = init_group(0, size, device)
        except BaseException:
            self.close()
            raise

    def agree(self, ok: bool, num_blocks: int) -> int:
        """The start-up handshake; raises one error naming each rank that failed."""
        self._agreed = True
        try:
            all_ok, blocks = agree(ok, num_blocks, self.device)
        except Exception as exc:  # a worker died without reporting
            all_ok, blocks = False, 0
            log.error("tensor-parallel start-up collective failed: %s", exc)
        if all_ok:
            return blocks
        reasons = self._worker_errors()
        self.close()
        if ok:
            raise RuntimeError(
                "tensor-parallel start-up failed: " + ("; ".join(reasons) or self._exit_codes())
            )
        return 0

    def abort(self) -> None:
        """Rank 0 failed to start: fail the handshake if it is still ahead, then stop."""
        if not self._agreed:
            self.agree(False, 0)
        self.close()

    def _worker_errors(self) -> list[str]:
        reasons: list[str] = []
        for _ in range(50):
            while not self.errors.empty():
                reasons.append(self.errors.get())
            if reasons or all(not p.is_alive() for p in self.procs):
                break
            threading.Event().wait(0.1)
        return reasons

    def _exit_codes(self) -> str:
        return ", ".join(f"rank {i + 1} exit code {p.exitcode}" for i, p in enumerate(self.procs))

    def broadcast_step(
        self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch
    ) -> None:
        header, payload = pack_step(input_ids, positions, batch)
        dist.broadcast(header, 0, group=self.steps)
        dist.broadcast(payload, 0, group=self.steps)

    def mirror(self, max_seqs: int, block_size: int) -> StepMirror:
        """Rank 0's end of the CUDA runner's step link (runtime/step_mirror.py)."""
        self._mirror = StepMirror(self.steps, 0, max_seqs, block_size, self.device)
        return self._mirror

    def watch(self, on_death: Callable[[str], None]) -> None:
        """Call `on_death(reason)` once, from a thread, if a worker exits before `close`."""

        def run() -> None:
            while not self._closed:
                for i, p in enumerate(self.procs):
                    if not p.is_alive() and not self._closed:
                        on_death(f"tensor-parallel rank {i + 1} exited (code {p.exitcode})")
                        return
                threading.Event().wait(0.2)

        self._watch = threading.Thread(target=run, name="tandem-tp-watch", daemon=True)
        self._watch.start()

    def close(self, broken: bool = False) -> None:
        """Tell the workers to stop, wait briefly, kill what is left. `broken`: a forward
        failed on this rank, so the workers may be inside one of its collectives, where a stop
        message would be read as that collective's data: kill them at once."""
        if self._closed:
            return
        self._closed = True
        if broken:
            for p in self.procs:
                p.kill()
        elif all(p.is_alive() for p in self.procs) and dist.is_initialized():
            try:
                if self._mirror is not None:  # a CUDA runner's workers read its header
                    stop = self._mirror.stop_header()
                else:
                    stop = torch.tensor(
                        [STOP] + [0] * (HEADER - 1), dtype=torch.int64, device=self.device
                    )
                dist.broadcast(stop, 0, group=self.steps)
            except Exception:  # a worker is gone: the kill below ends the rest
                pass
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        set_tp(TensorParallel())
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass

"""Stream-ordered jobs of the CPU expert pool (the CUDA path, capturable in a CUDA graph): the
`StreamJob` descriptor and the pool methods that make, enqueue and run such jobs."""

from __future__ import annotations

from typing import Any

import torch

from .build import load_extension
from .tensor_checks import _check_cpu_tensor, _non_negative_int, _overlaps


def cuda_host_funcs_error() -> str | None:
    """None when the CUDA driver's cuLaunchHostFunc can be used (stream-ordered jobs); else
    why not. The extension itself never needs CUDA."""
    return load_extension().cuda_driver_error() or None


def cuda_memops_error() -> str | None:
    """None when the CUDA driver's stream memory operations (cuStreamWriteValue32 and
    cuStreamWaitValue32) can be used (flag jobs); else why not."""
    return load_extension().cuda_memops_error() or None


FLAG_WORDS = 32  # int32 words of a flag job's pinned flags: go at [0], done at [16]


class StreamJob:
    """A fixed job descriptor of one layer over fixed host buffers (see
    `CpuExpertPool.stream_job`). Holds the buffers alive; its address is what a captured graph
    keeps, so it lives (inside the pool, which never frees it) as long as the pool."""

    def __init__(
        self,
        handle: int,
        layer_idx: int,
        tensors: tuple[torch.Tensor, ...],
        flags: torch.Tensor | None = None,
    ) -> None:
        self.handle = handle
        self.layer_idx = layer_idx
        self.hidden, self.topk_ids, self.topk_weights, self.out, self.num_tokens = tensors
        self.flags = flags  # [FLAG_WORDS] int32 pinned: a flag job (enqueue_go / done_wait)

    @property
    def capacity(self) -> int:
        return self.hidden.shape[0]


class StreamJobMethods:
    """Mixed into `CpuExpertPool`, which provides `_live()`, `_layer()`, `_pool` and
    `_stream_tensors`."""

    _pool: Any
    _stream_tensors: list

    def stream_job(
        self,
        layer_idx: int,
        hidden: torch.Tensor,  # [C, H] float32, host (pinned for async copies)
        topk_ids: torch.Tensor,  # [C, k] int64
        topk_weights: torch.Tensor,  # [C, k] float32
        out: torch.Tensor,  # [C, H] float32
        num_tokens: torch.Tensor,  # [1] int32: the rows of a call, written before its submit
        flags: bool = False,
    ) -> StreamJob:
        """A fixed descriptor of a call over these buffers for `enqueue_submit`/`enqueue_wait`.

        Every call reads `num_tokens[0]` when its submit host function runs (0 to C rows), so
        one job serves every token count. The buffers must stay at their addresses for as long
        as any stream or captured graph may run the job (the pool keeps them alive until it
        closes).

        flags=True makes a flag job instead, for `enqueue_go` / `enqueue_done_wait`: no host
        function; the pool's poller thread watches two pinned words that the stream writes
        and waits on (the row count travels in the go word; `num_tokens` is not read)."""
        self._live()
        _, _, H, _, _ = self._layer(layer_idx)
        _check_cpu_tensor("hidden", hidden, (torch.float32,), 2)
        _check_cpu_tensor("topk_ids", topk_ids, (torch.int64,), 2)
        _check_cpu_tensor("topk_weights", topk_weights, (torch.float32,), 2)
        _check_cpu_tensor("out", out, (torch.float32,), 2)
        _check_cpu_tensor("num_tokens", num_tokens, (torch.int32,), 1)
        C, k = topk_ids.shape
        if hidden.shape != (C, H) or out.shape != (C, H):
            raise ValueError(f"hidden and out must be [{C}, {H}], got {tuple(hidden.shape)}, "
                             f"{tuple(out.shape)}")  # fmt: skip
        if topk_weights.shape != (C, k) or C < 1 or k < 1:
            raise ValueError(f"topk_ids and topk_weights must be the same [C>=1, k>=1], got "
                             f"{tuple(topk_ids.shape)}, {tuple(topk_weights.shape)}")  # fmt: skip
        if num_tokens.numel() != 1:
            raise ValueError(f"num_tokens must have one element, got {num_tokens.numel()}")
        tensors = (hidden, topk_ids, topk_weights, out, num_tokens)
        names = ("hidden", "topk_ids", "topk_weights", "out", "num_tokens")
        for name, t in zip(names, tensors, strict=True):
            if not t.is_contiguous():
                raise ValueError(f"{name} must be contiguous")
        if _overlaps(out, hidden):
            raise ValueError("out must not overlap hidden")
        flag_words = None
        if flags:
            pin = torch.cuda.is_available()  # device-mapped where a GPU will write it
            flag_words = torch.zeros(FLAG_WORDS, dtype=torch.int32, pin_memory=pin)
        handle = self._pool.make_stream_job(
            layer_idx, *(t.data_ptr() for t in tensors), C, k,
            flag_words.data_ptr() if flag_words is not None else 0,
        )  # fmt: skip
        # the poller may read them (and a graph write them) until the pool is gone
        self._stream_tensors.append((*tensors, flag_words))
        return StreamJob(handle, layer_idx, tensors, flag_words)

    def enqueue_go(self, stream: int, job: StreamJob, rows: int) -> None:
        """Flag job: enqueues on `stream` a 4-byte write that tells the pool's poller to run
        `job` on its first `rows` rows (after a memory barrier: the copies queued before it
        have landed). Capturable; a graph replays it with the same `rows`."""
        self._flag_job(job, rows)
        self._live().enqueue_go(int(stream), job.handle, rows)

    def enqueue_done_wait(self, stream: int, job: StreamJob) -> None:
        """Flag job: enqueues a wait of `stream` until the poller has finished `job` (the GPU
        polls the done word; no host function, no host thread blocks), then resets it."""
        self._flag_job(job)
        self._live().enqueue_done_wait(int(stream), job.handle)

    def host_go(self, job: StreamJob, rows: int) -> None:
        """What `enqueue_go` does on the GPU, from this thread (tests without a GPU)."""
        self._flag_job(job, rows)
        self._live().host_go(job.handle, rows)

    def host_done_wait(self, job: StreamJob, timeout_s: float = 10.0) -> bool:
        """What `enqueue_done_wait` does on the GPU: False if the job did not finish in time."""
        self._flag_job(job)
        return bool(self._live().host_done_wait(job.handle, float(timeout_s)))

    def kick(self) -> None:
        """Flag jobs are coming: the poller spins (instead of napping) for `poll_spin_us`."""
        self._live().kick()

    @property
    def poll_spin_us(self) -> int:
        """How long the poller of flag jobs spins after the last job before it naps (50 us)
        between looks."""
        return self._live().poll_spin_us

    @poll_spin_us.setter
    def poll_spin_us(self, value: int) -> None:
        self._live().poll_spin_us = _non_negative_int("poll_spin_us", value)

    @property
    def flag_jobs_run(self) -> int:
        return int(self._live().flag_jobs_run)

    def _flag_job(self, job: StreamJob, rows: int | None = None) -> None:
        if job.flags is None:
            raise ValueError("not a flag job: make it with stream_job(..., flags=True)")
        if rows is not None and not 0 <= rows <= job.capacity:
            raise ValueError(f"rows must be in [0, {job.capacity}], got {rows}")

    def enqueue_submit(self, stream: int, job: StreamJob) -> None:
        """Enqueues on CUDA stream `stream` (a cudaStream_t as an int, e.g. torch's
        `current_stream().cuda_stream`) a host function that starts `job` on the pool with
        the rows its buffers hold when the stream reaches it. Returns at once. During stream
        capture it becomes a host node of the graph and runs at every replay. RuntimeError if
        the CUDA driver (libcuda.so.1) is missing or refuses the launch."""
        self._live().enqueue_submit(int(stream), job.handle)

    def enqueue_wait(self, stream: int, job: StreamJob) -> None:
        """Enqueues a host function that blocks `stream` until `job` is done, so work queued
        after it (the copy of `job.out` to the device) sees the result."""
        self._live().enqueue_wait(int(stream), job.handle)

    def run_stream_job(self, job: StreamJob) -> None:
        """Runs the submit and wait host functions here, in order (tests, no CUDA needed)."""
        self._live().run_stream_job(job.handle)

    def stream_stats(self) -> dict[str, int]:
        """Counters of the stream-ordered jobs that ran: calls, errors, tokens, pool_ns
        (submit to done), wait_ns (stream blocked in the wait), d2h_bytes, h2d_bytes."""
        return dict(self._live().stream_stats())

    def last_stream_error(self) -> str:
        """The message of the last failed stream job ("" if none). A failed job zeroes its
        output rows; the host functions cannot raise into the stream."""
        return self._live().last_stream_error()

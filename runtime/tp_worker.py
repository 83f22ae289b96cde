"""A tensor-parallel worker (ranks 1..N-1): loads its shard, sizes its KV cache, then runs one
forward per step that rank 0 broadcasts, taking part in the collectives; never sees a request."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import traceback
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def worker_main(
    rank: int, size: int, config: Any, model_config: Any, errors: Any, runner_options: Any = None
) -> None:
    """`runner_options`: rank 0's CUDA runner options (the same graphs must be captured)."""
    _die_with_parent()
    os.environ["RANK"] = str(rank)
    os.environ["LOCAL_RANK"] = str(rank)
    logging.basicConfig(stream=sys.stderr, level=logging.WARNING)
    from tandem.models.batch import KVCache
    from tandem.runtime.engine_setup import (
        load_engine_model,
        resolve_device,
        resolve_dtype,
        resolve_max_model_len,
        served_model_len,
        size_kv_cache,
    )
    from tandem.runtime.tp import agree, init_group, set_process_env

    set_process_env()
    spec = config.model
    device = resolve_device(spec.device)
    if device.type == "cuda":
        device = torch.device("cuda", rank)
    tp, steps = init_group(rank, size, device)
    dtype = resolve_dtype(spec.dtype, device)
    blocks, ok = 0, True
    try:
        model, model_config, _ = load_engine_model(spec, device, dtype, model_config)
        # sized as rank 0 sizes its cache (runtime/engine.py): the model's own length when
        # none was asked for is capped there by what the smallest cache holds
        requested = config.scheduler.max_model_len
        max_model_len = resolve_max_model_len(requested, model_config)
        fit_len = config.cache.block_size if requested is None else max_model_len
        layout = size_kv_cache(config, model, model_config, dtype, device, fit_len)
        blocks = layout.num_blocks
    except Exception as exc:
        ok = False
        errors.put(f"rank {rank}: {type(exc).__name__}: {exc}")
        traceback.print_exc()
    all_ok, blocks = agree(ok, blocks, device)
    if not all_ok:
        return
    kv_cache = KVCache.for_model(
        model_config, blocks, layout.block_size, dtype, device, size,
        num_window_blocks=layout.num_window_blocks,
    )  # fmt: skip
    if device.type == "cuda":
        max_model_len = served_model_len(requested, max_model_len, blocks, layout.block_size)
        _follow_cuda(
            model, model_config, kv_cache, device, config, max_model_len, runner_options, steps
        )
    else:
        _follow_cpu(model, kv_cache, device, steps)
    dist.destroy_process_group()


def _follow_cpu(model: Any, kv_cache: Any, device: torch.device, steps: Any) -> None:
    """Eager forwards of the steps rank 0's `ModelRunner` broadcasts (runtime/tp.py)."""
    from tandem.runtime.tp import HEADER, STOP, payload_size, unpack_step

    with torch.inference_mode():
        while True:
            header = torch.empty(HEADER, dtype=torch.int64, device=device)
            dist.broadcast(header, 0, group=steps)
            head = header.tolist()
            if head[0] == STOP:
                break
            payload = torch.empty(payload_size(head), dtype=torch.int64, device=device)
            dist.broadcast(payload, 0, group=steps)
            input_ids, positions, batch = unpack_step(head, payload, kv_cache)
            hidden = model(input_ids, positions, batch)
            if head[4]:
                model.compute_logits(hidden)


def _follow_cuda(
    model: Any, model_config: Any, kv_cache: Any, device: torch.device, config: Any,
    max_model_len: int, runner_options: Any, steps: Any,
) -> None:  # fmt: skip
    """A CUDA runner like rank 0's (same buckets, same captured graphs) fed by its mirror."""
    from tandem.runtime.cuda_runner import CudaModelRunner
    from tandem.runtime.step_mirror import StepMirror

    sched = config.scheduler
    runner = CudaModelRunner(
        model, model_config, kv_cache, device, getattr(model, "attn_backend", None),
        max_num_seqs=sched.max_num_seqs,
        max_num_batched_tokens=sched.max_num_batched_tokens,
        max_model_len=max_model_len,
        options=runner_options,
        tp_mirror=lambda seqs, block: StepMirror(steps, dist.get_rank(), seqs, block, device),
    )  # fmt: skip
    while runner.follow():
        pass

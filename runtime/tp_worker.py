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


def worker_main(rank: int, size: int, config: Any, model_config: Any, errors: Any) -> None:
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
        size_kv_cache,
    )
    from tandem.runtime.tp import (
        HEADER,
        STOP,
        agree,
        init_group,
        payload_size,
        set_process_env,
        unpack_step,
    )

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
    dist.destroy_process_group()

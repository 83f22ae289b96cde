"""Random weights of a real model shape, for benchmarks and tests without a checkpoint.

Fills an already-built model in place, on its own device and dtype (no host copy, no second
allocation): normal(0, 0.02) everywhere, 1.0 for every RMSNorm weight. Each parameter draws
from its own generator, seeded from `seed` and the parameter's name, so a parameter gets the
same values whether it is filled with the rest or on its own later (`select`: the hybrid
loader fills one MoE layer's host experts at a time, right before the pool converts them).
Large host tensors are filled in fixed chunks, each with its own generator, from a thread
pool: torch fills a CPU tensor on one thread, which for a Qwen3-30B-A3B shape (29 B expert
parameters) would take minutes. The chunking does not depend on the thread count, so the
values do not either.
"""

from __future__ import annotations

import os
import threading
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import nn

from tandem.models.layers.norm import RMSNorm

CHUNK = 1 << 24  # elements per host chunk (one generator each)
_MASK = (1 << 63) - 1


def _seed(*parts: int) -> int:
    """A 63-bit seed from integers (splitmix-style mixing, stable across runs)."""
    h = 0x9E3779B97F4A7C15
    for p in parts:
        h = (h ^ (p & _MASK)) * 0xBF58476D1CE4E5B9 & _MASK
        h ^= h >> 31
    return h


def _fill_normal(param: torch.Tensor, std: float, seed: int, pool: ThreadPoolExecutor | None):
    n = param.numel()
    if pool is None or param.device.type != "cpu" or n <= CHUNK or not param.is_contiguous():
        gen = torch.Generator(device=param.device).manual_seed(seed)
        param.normal_(0.0, std, generator=gen)
        return

    flat = param.view(-1)
    local = threading.local()  # a float32 chunk buffer per filling thread

    def chunk(i: int) -> None:
        gen = torch.Generator().manual_seed(_seed(seed, i))
        part = flat[i * CHUNK : (i + 1) * CHUNK]
        if part.dtype == torch.float32:
            part.normal_(0.0, std, generator=gen)
            return
        # 16-bit: draw in float32 and round. torch's 16-bit normal_ on the CPU is a scalar loop
        # (31 M values/s a thread on the device's Xeon, against 134 M for float32).
        buf = getattr(local, "buf", None)
        if buf is None:
            buf = local.buf = torch.empty(CHUNK, dtype=torch.float32)
        part.copy_(buf[: part.numel()].normal_(0.0, std, generator=gen))

    list(pool.map(chunk, range((n + CHUNK - 1) // CHUNK)))  # torch drops the GIL while it fills


@torch.no_grad()
def init_dummy_weights(
    model: nn.Module,
    seed: int = 0,
    std: float = 0.02,
    select: Callable[[str], bool] | None = None,
) -> None:
    """Fills every parameter (only those whose name `select` accepts, where given)."""
    norm_params = {id(m.weight) for m in model.modules() if isinstance(m, RMSNorm)}
    params = [
        (name, p)
        for name, p in model.named_parameters()  # any order: each has its own generator
        if select is None or select(name)
    ]
    big = any(p.device.type == "cpu" and p.numel() > CHUNK for _, p in params)
    pool = ThreadPoolExecutor(max(1, min(16, os.cpu_count() or 1))) if big else None
    try:
        for name, param in params:
            if id(param) in norm_params:
                param.fill_(1.0)
            elif param.numel():
                _fill_normal(param, std, _seed(seed, zlib.crc32(name.encode())), pool)
    finally:
        if pool is not None:
            pool.shutdown()

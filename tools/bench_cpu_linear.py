#!/usr/bin/env python3
"""The batch-invariant bf16 CPU linear per ISA against torch, on one layer's dense projections.

    taskset -c 0,1 python tools/bench_cpu_linear.py [--threads 2] [--rows 1 8 64 256]

The four projections of one SmolLM2-135M layer (qkv 576->960, o 576->576, gate_up 576->3072,
down 1536->576; 7 MB of bf16 weights), random weights, bf16 activations. Per M: microseconds
for all four (best of --repeats), torch's F.linear (its own bf16 GEMM: oneDNN, AMX where the CPU
has it) and the C++ pool's "bf16_vnni" path on each ISA given (avx512: VNNI dot products;
amx: tiles), and whether each row equals the same row computed alone (batch invariance).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tandem.ext.cpu import supported_isas  # noqa: E402
from tandem.ext.cpu.linear import CpuLinearPool, pack_weight  # noqa: E402

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (N, K)


def best_us(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 256])
    ap.add_argument("--isas", nargs="+", default=["avx512", "amx"])
    ap.add_argument("--repeats", type=int, default=15)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    isas = [i for i in a.isas if i in supported_isas()]
    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(n, k, generator=g).to(torch.bfloat16) for n, k in SHAPES]
    packed = [pack_weight(w, "bf16_vnni") for w in ws]
    pools = {i: CpuLinearPool(num_threads=a.threads, isa=i) for i in isas}
    print(f"threads {a.threads}, isas {isas}, supported {supported_isas()}")
    print("M, torch_us, " + ", ".join(f"{i}_us, {i}_invariant" for i in isas))
    for m in a.rows:
        xs = [torch.randn(m, k, generator=g).to(torch.bfloat16) for _, k in SHAPES]
        pairs = list(zip(xs, ws, packed, strict=True))
        row = [f"{best_us(lambda ps=pairs: [F.linear(x, w) for x, w, _ in ps], a.repeats):.0f}"]
        for pool in pools.values():
            us, same = measure(pool, pairs, a.repeats)
            row += [f"{us:.0f}", str(same)]
        print(f"{m}, " + ", ".join(row), flush=True)


def measure(pool: CpuLinearPool, pairs: list, repeats: int) -> tuple[float, bool]:
    """-> (best microseconds for the four projections, every row equal to itself alone)."""

    def run() -> list[torch.Tensor]:
        return [pool.linear(x, p) for x, _, p in pairs]

    us = best_us(run, repeats)
    full = run()
    alone = [
        torch.cat([pool.linear(x[i : i + 1], p) for i in range(x.shape[0])]) for x, _, p in pairs
    ]
    return us, all(torch.equal(f, s) for f, s in zip(full, alone, strict=True))


if __name__ == "__main__":
    main()

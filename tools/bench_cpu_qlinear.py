#!/usr/bin/env python3
"""GGUF-packed CPU linear: the int8-activation kernel against the float (bf16) one, same run.

    taskset -c 0,1 python tools/bench_cpu_qlinear.py [--threads 2] [--rows 1 8 64]

Shapes (random weights, packed by the project's quantizers, rows tiled so the bytes are
distinct): `down` is SmolLM2-135M's down projection (1536 -> 576, the only one of its
projections whose K is a multiple of 256, so the only one a k-quant file holds as Q4_K/Q6_K);
`layer` is one SmolLM2-1.7B layer's four projections (qkv 2048->6144, o 2048->2048, gate_up
2048->16384, down 8192->2048; 36 MB in Q4_K). Per type and M: microseconds for the set (best of
--repeats) on the int8 path and the float path, and the int8 path's weight bytes per second.
(On a CPU whose L3 holds the set, as the 480 MiB of the 2026-11-25 VM does, no memory floor
applies: compare with Q4_0's int8 rate in the same run.)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tandem.ext.cpu.qlinear import CpuQuantLinearPool  # noqa: E402
from tests.models.quant_cases import pack  # noqa: E402
from tools.bench_cpu_linear import best_us  # noqa: E402

SHAPES = {
    "down": [(576, 1536)],
    "layer": [(6144, 2048), (2048, 2048), (16384, 2048), (2048, 8192)],
}  # (N, K)


def packed(qtype: str, n: int, k: int, rng: np.random.Generator) -> torch.Tensor:
    seed_rows = 64
    w = rng.standard_normal((seed_rows, k)).astype(np.float32) * 0.05
    p = np.ascontiguousarray(pack(w, qtype))
    return torch.from_numpy(np.ascontiguousarray(np.tile(p, (-(-n // seed_rows), 1))[:n]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--types", nargs="+", default=["Q4_0", "Q4_K", "Q5_K", "Q6_K"])
    ap.add_argument("--shape", choices=list(SHAPES), default="layer")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--isa", default=None, help="as CpuQuantLinearPool takes it (avx2: AVX2 int8)")
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    ints = CpuQuantLinearPool(num_threads=a.threads, isa=a.isa, int8=True)
    floats = CpuQuantLinearPool(num_threads=a.threads, isa=a.isa, int8=False)
    print(f"threads {a.threads}, float isa {floats.isa}, int8 isa {ints.int8_isa or 'none'}")
    print("type, M, int8_path, float_us, int8_us, speedup, int8_GB/s")
    for qtype in a.types:
        ws = [(packed(qtype, n, k, rng), k) for n, k in SHAPES[a.shape]]
        nbytes = sum(w.numel() for w, _ in ws)
        for m in a.rows:
            xs = [torch.randn(m, k).to(torch.bfloat16) for _, k in ws]

            def run(pool: CpuQuantLinearPool, xs=xs, ws=ws, qtype=qtype) -> None:
                for (w, _), x in zip(ws, xs, strict=True):
                    pool.linear(x, w, qtype)

            f_us = best_us(lambda: run(floats), a.repeats)
            i_us = best_us(lambda: run(ints), a.repeats)
            print(
                f"{qtype}, {m}, {ints.int8_serves(qtype)}, {f_us:.0f}, {i_us:.0f}, "
                f"{f_us / i_us:.2f}, {nbytes / i_us / 1e3:.1f}"
            )


if __name__ == "__main__":
    main()

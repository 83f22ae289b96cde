#!/usr/bin/env python3
"""GPTQ int4 (group 128, with and without act-order) and FP8 e4m3 (128x128 blocks; per-channel)
linears on CUDA at the Llama-3-8B shape (random packed weights): the 32 layers' qkv / o /
gate_up / down projections as a decode step at 1 and 16 rows (one CUDA graph of every linear)
and as a 2,048-token prefill (dequantize-to-scratch + cuBLAS; FP8 per-channel also through
torch._scaled_mm), next to the floor (packed bytes at the device-to-device copy bandwidth
measured in the same run) and to the same shapes in bf16 through cuBLAS. Linears only.

    python tools/bench_hf_quant_gpu.py [--json out.json]
    python tools/bench_hf_quant_gpu.py --crossover 1,8,16,32,64   # GEMV / MMA / scratch / bf16
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_gguf_gpu import copy_bandwidth, graph_of, timed  # noqa: E402

from tandem.ext.cuda import hf_linear  # noqa: E402
from tandem.ext.cuda.hf_linear import fp8_scaled_mm  # noqa: E402
from tandem.models.quant.cuda import CudaQuantKernel  # noqa: E402
from tandem.models.quant.fp8 import Fp8Tensor  # noqa: E402
from tandem.models.quant.int4 import Int4Tensor  # noqa: E402

HIDDEN, INTER, Q, KV, LAYERS = 4096, 14336, 4096, 1024, 32
SHAPES = [(Q + 2 * KV, HIDDEN), (HIDDEN, Q), (2 * INTER, HIDDEN), (HIDDEN, INTER)]


def random_weight(fmt: str, n: int, k: int):
    dev = "cuda"
    if fmt.startswith("gptq"):
        codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=dev)
        scales = torch.full((n, k // 128), 0.002, dtype=torch.float16, device=dev)
        zeros = torch.randint(0, 16, (n, k // 128), dtype=torch.uint8, device=dev)
        perm = torch.randperm(k, device=dev).to(torch.int32) if fmt == "gptq-actorder" else None
        return Int4Tensor("gptq", codes, scales, zeros, 128, perm)
    data = torch.randint(0, 256, (n, k), dtype=torch.uint8, device=dev)
    data[(data & 0x7F) == 0x7F] = 0  # no NaN codes
    data = data.view(torch.float8_e4m3fn)
    if fmt == "fp8-block":
        return Fp8Tensor(data, torch.full((-(-n // 128), k // 128), 1e-3, device=dev), (128, 128))
    return Fp8Tensor(data, torch.full((n, 1), 1e-3, device=dev), (1, k))


def bench_format(fmt: str, bw: float, reps: int) -> dict:
    before = torch.cuda.memory_allocated()
    weights = [random_weight(fmt, n, k) for _ in range(LAYERS) for n, k in SHAPES]
    packed = sum(w.nbytes for w in weights)
    resident = torch.cuda.memory_allocated() - before
    kernel = CudaQuantKernel()
    check = weights[0]
    x = torch.randn(3, HIDDEN, device="cuda", dtype=torch.bfloat16)
    ref = x.float() @ check.dequantize().T
    rel = ((kernel(x, check).float() - ref).norm() / ref.norm()).item()
    out = {"format": fmt, "packed_bytes": packed, "resident_bytes": resident, "rel_err": rel}
    floor_s = packed / bw
    out["floor_s"] = floor_s
    for rows in (1, 16):
        xs = {k: torch.randn(rows, k, device="cuda", dtype=torch.bfloat16) for k in (HIDDEN, INTER)}

        def decode(xs=xs) -> None:
            for w in weights:
                kernel(xs[w.cols], w)

        step = timed(graph_of(decode), reps)
        out[f"decode{rows}_s"] = step
        out[f"decode{rows}_vs_floor"] = floor_s / step
    xp = {k: torch.randn(2048, k, device="cuda", dtype=torch.bfloat16) for k in (HIDDEN, INTER)}
    flops = 2 * 2048 * sum(w.rows * w.cols for w in weights)

    def prefill() -> None:
        for w in weights:
            kernel(xp[w.cols], w)

    out["prefill_s"] = timed(prefill, 3)
    out["prefill_tflops"] = flops / out["prefill_s"] / 1e12
    if fmt == "fp8-channel":
        scales = [w.scale.reshape(-1) for w in weights]

        def prefill_mm() -> None:
            for w, s in zip(weights, scales, strict=True):
                fp8_scaled_mm(xp[w.cols], w.data, s)

        out["prefill_scaled_mm_s"] = timed(prefill_mm, 3)
        out["prefill_scaled_mm_tflops"] = flops / out["prefill_scaled_mm_s"] / 1e12
    weights.clear()
    torch.cuda.empty_cache()
    return out


def bf16_step(reps: int):
    """rows -> seconds of the same linear stack in bf16 through cuBLAS (one layer's weights
    reused: the bytes of 32 layers would not fit beside the packed ones)."""
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for n, k in SHAPES]

    def run(rows: int) -> float:
        xs = {k: torch.randn(rows, k, device="cuda", dtype=torch.bfloat16) for k in (HIDDEN, INTER)}

        def step() -> None:
            for _ in range(LAYERS):
                for w in ws:
                    torch.nn.functional.linear(xs[w.shape[1]], w)

        return timed(graph_of(step), reps)

    return run


def crossover(fmt: str, rows_list: list[int], reps: int, bf16=None) -> list[dict]:
    """The decode step at each row count through the GEMV (up to 16 rows), the tensor-core
    kernel and dequantize + cuBLAS (and bf16 cuBLAS on the same shapes, if given)."""
    weights = [random_weight(fmt, n, k) for _ in range(LAYERS) for n, k in SHAPES]
    kernel = CudaQuantKernel()
    out = []
    for rows in rows_list:
        xs = {k: torch.randn(rows, k, device="cuda", dtype=torch.bfloat16) for k in (HIDDEN, INTER)}

        def step(xs=xs) -> None:
            for w in weights:
                kernel(xs[w.cols], w)

        row = {"format": fmt, "rows": rows}
        fid = hf_linear.INT4 if fmt.startswith("gptq") else hf_linear.FP8
        saved = hf_linear.GEMV_MAX_ROWS[fid], hf_linear.MMA_MIN_ROWS[fid], hf_linear.MMA_MAX_ROWS
        paths = [("mma_s", 0, 1, 64), ("dequant_cublas_s", 0, 1, 0)]
        if rows <= hf_linear.MAX_ROWS:
            paths.insert(0, ("gemv_s", 16, 1, 0))
        try:
            for path, limit, mma_min, mma_max in paths:
                hf_linear.GEMV_MAX_ROWS[fid] = limit
                hf_linear.MMA_MIN_ROWS[fid], hf_linear.MMA_MAX_ROWS = mma_min, mma_max
                row[path] = timed(graph_of(step), reps)
        finally:
            hf_linear.GEMV_MAX_ROWS[fid], hf_linear.MMA_MIN_ROWS[fid] = saved[:2]
            hf_linear.MMA_MAX_ROWS = saved[2]
        if bf16 is not None:
            row["bf16_s"] = bf16(rows)
        out.append(row)
        print(f"{fmt} M={rows}: " + ", ".join(f"{k[:-2]} {v * 1e3:.2f} ms" for k, v in row.items()
                                               if k.endswith("_s")))  # fmt: skip
    weights.clear()
    torch.cuda.empty_cache()
    return out


def bench_bf16(bw: float, reps: int) -> dict:
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for n, k in SHAPES]
    total = sum(w.numel() * 2 for w in ws) * LAYERS
    out = {"format": "bf16 (cuBLAS, one layer's weights reused)", "weight_bytes": total,
           "floor_s": total / bw}  # fmt: skip
    for rows in (1, 16, 2048):
        xs = {k: torch.randn(rows, k, device="cuda", dtype=torch.bfloat16) for k in (HIDDEN, INTER)}

        def run(xs=xs) -> None:
            for _ in range(LAYERS):
                for w in ws:
                    torch.nn.functional.linear(xs[w.shape[1]], w)

        key = "prefill_s" if rows == 2048 else f"decode{rows}_s"
        out[key] = timed(graph_of(run) if rows < 2048 else run, reps if rows < 2048 else 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--formats", default="gptq,gptq-actorder,fp8-block,fp8-channel")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "--crossover", default=None, help="row counts: GEMV / MMA / dequantize + cuBLAS / bf16"
    )
    args = ap.parse_args()
    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}  copy bandwidth {bw / 1e12:.2f} TB/s")
    if args.crossover:
        rows = [int(r) for r in args.crossover.split(",")]
        bf16_run, bf16_by_rows = bf16_step(args.reps), {}

        def bf16(m: int) -> float:
            if m not in bf16_by_rows:
                bf16_by_rows[m] = bf16_run(m)
            return bf16_by_rows[m]

        formats = args.formats.split(",")
        runs = [r for fmt in formats for r in crossover(fmt, rows, args.reps, bf16)]
        if args.json:
            Path(args.json).write_text(json.dumps({"copy_bw": bw, "crossover": runs}, indent=2))
        return
    runs = []
    for fmt in args.formats.split(","):
        r = bench_format(fmt, bw, args.reps)
        runs.append(r)
        extra = ""
        if "prefill_scaled_mm_s" in r:
            extra = f", _scaled_mm {r['prefill_scaled_mm_s'] * 1e3:.1f} ms"
        print(
            f"{fmt}: packed {r['packed_bytes'] / 1e9:.2f} GB (resident "
            f"{r['resident_bytes'] / 1e9:.2f}) rel.err {r['rel_err']:.1e} | floor "
            f"{r['floor_s'] * 1e3:.2f} ms | decode M=1 {r['decode1_s'] * 1e3:.2f} ms "
            f"({100 * r['decode1_vs_floor']:.0f}% of floor), M=16 {r['decode16_s'] * 1e3:.2f} ms"
            f" ({100 * r['decode16_vs_floor']:.0f}%) | prefill 2048 {r['prefill_s'] * 1e3:.1f} ms"
            f" ({r['prefill_tflops']:.0f} TFLOP/s){extra}"
        )
    r = bench_bf16(bw, args.reps)
    runs.append(r)
    print(
        f"bf16: floor {r['floor_s'] * 1e3:.2f} ms | decode M=1 {r['decode1_s'] * 1e3:.2f} ms, "
        f"M=16 {r['decode16_s'] * 1e3:.2f} ms | prefill 2048 {r['prefill_s'] * 1e3:.1f} ms"
    )
    if args.json:
        Path(args.json).write_text(json.dumps({"copy_bw": bw, "runs": runs}, indent=2))


if __name__ == "__main__":
    main()

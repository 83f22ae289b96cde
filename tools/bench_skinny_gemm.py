"""Decode-shaped GEMMs on CUDA: the skinny kernel (ext/cuda/skinny_gemm.cu) against torch's
F.linear (cuBLAS), for the weight shapes of the Llama-3 8B and 1B benchmarks, 1-8 rows of x.

Each timing replays a CUDA graph of `--chain` products on distinct weight copies (more bytes
than L2 holds, like consecutive layers of a model), so launch overhead and L2 hits do not
flatter either side. Printed: microseconds per product, weight GB/s, and the fraction of the
device-to-device copy bandwidth measured in the same run (the floor for a weight-streaming
product); parity is the max relative error of each output against a float32 product.

    python tools/bench_skinny_gemm.py [--shapes 8B,1B] [--rows 1,2,4,8] [--tiles 2,4 1,2 ...]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tandem.ext.cuda import skinny  # noqa: E402

SHAPES = {
    "8B": {
        "qkv": (6144, 4096),
        "o": (4096, 4096),
        "gate_up": (28672, 4096),
        "down": (4096, 14336),
        "lm_head": (128256, 4096),
    },
    "1B": {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192)},
}


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(10):
        b.copy_(a)
    e.record()
    torch.cuda.synchronize()
    return 2 * nbytes * 10 / (s.elapsed_time(e) / 1e3) / 1e9


def time_graph(fn, reps: int = 20) -> float:
    """Seconds per replay of a CUDA graph of fn()."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(reps):
        g.replay()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / 1e3 / reps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="8B,1B")
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument(
        "--tiles", nargs="*", default=None, help="R,U tiles to try (default: the kernel's choice)"
    )
    ap.add_argument(
        "--chain", type=int, default=0, help="products per graph (default: enough for 512 MB)"
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    bw = copy_bandwidth()
    print(f"device {torch.cuda.get_device_name()}  copy bandwidth {bw:.0f} GB/s")
    rows_list = [int(r) for r in args.rows.split(",")]
    results = []
    for shape in args.shapes.split(","):
        for name, (n, k) in SHAPES[shape].items():
            nbytes = n * k * 2
            chain = args.chain or max(4, min(64, (512 << 20) // nbytes))
            ws = [
                torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(chain)
            ]
            for m in rows_list:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                outs = [torch.empty(m, n, device="cuda", dtype=torch.bfloat16) for _ in ws]
                ref = x.float() @ ws[0].float().t()

                def run_torch(ws=ws, outs=outs, x=x):
                    for w, o in zip(ws, outs, strict=True):
                        torch.mm(x, w.t(), out=o)

                t_torch = time_graph(run_torch) / chain
                err_torch = ((outs[0].float() - ref).norm() / ref.norm()).item()
                tiles = (
                    [tuple(int(v) for v in t.split(",")) for t in args.tiles]
                    if args.tiles
                    else [skinny.tile_for(m)]
                )
                best = None
                for tile in tiles:

                    def run_skinny(tile=tile, ws=ws, outs=outs, x=x):
                        for w, o in zip(ws, outs, strict=True):
                            skinny.launch_skinny_gemm(x, w, o, tile)

                    t = time_graph(run_skinny) / chain
                    err = ((outs[0].float() - ref).norm() / ref.norm()).item()
                    row = {
                        "shape": shape,
                        "op": name,
                        "n": n,
                        "k": k,
                        "m": m,
                        "tile": list(tile),
                        "us": t * 1e6,
                        "gbs": nbytes / t / 1e9,
                        "floor_frac": nbytes / t / 1e9 / bw,
                        "err": err,
                        "torch_us": t_torch * 1e6,
                        "torch_gbs": nbytes / t_torch / 1e9,
                        "torch_err": err_torch,
                    }
                    results.append(row)
                    print(
                        f"{shape:3} {name:8} {n:6}x{k:<6} m={m} tile={tile}  skinny {t * 1e6:8.1f} us "
                        f"{row['gbs']:6.0f} GB/s ({row['floor_frac']:4.0%})  torch {t_torch * 1e6:8.1f} us "
                        f"{row['torch_gbs']:6.0f} GB/s  x{t_torch / t:4.2f}  err {err:.1e}/{err_torch:.1e}",
                        flush=True,
                    )
                    if best is None or t < best:
                        best = t
            ws = outs = None
            torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps({"copy_gbs": bw, "rows": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

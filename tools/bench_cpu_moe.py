"""Benchmark one MoE layer on the CPU expert pool against torch on the CPU, in the same run.

Default shape: Qwen3-30B-A3B (hidden 2048, expert intermediate 768, 128 experts, top-8).
For each weight format and token count it prints the time per call, the effective weight bytes
read per second (bytes of the experts the step touches / time) against a bandwidth floor, and
the time of a straightforward torch per-expert loop (bf16 weights) with the speedup. Each pool
result is checked against torch (relative error; int formats include their quantization error).
"floor ms" is the touched experts' bytes at --floor-gbps and "cap" torch's time over it: the
largest speed-up over torch that reading the weights from DRAM allows on this shape.
Successive calls cycle through --routings different random routings, so the experts a call
reads are mostly not in the last-level cache (a fixed routing would time the L3, not DRAM).

    python tools/bench_cpu_moe.py [--tokens 1 8 64 256] [--formats bf16 int8 int4]
        [--threads N] [--isa amx] [--floor-gbps GBPS] [--experts 128] [--json out.json]
        [--int-path auto|off|N] [--phases] [--peer-kt DIR]
        [--shape qwen3-30b-a3b|mixtral-8x7b|deepseek-v3] [--distinct-experts N]

--peer-kt DIR: also time KTransformers' own CPU MoE kernels (kt-kernel, fetched into DIR by
tools/peers/fetch_kt_kernel.sh; needs CUDA) on the same layer copies and routings: BF16 /
AMXINT8 / AMXINT4 against the pool's bf16 / int8 / int4, with "vs kt" = kt ms / pool ms, after
every pool run, its output checked against the pool's. One shape per process (kt-kernel caches
its pinned buffers by batch size alone).

--int-path: int8/int4 experts with >= N tokens multiply the quantized weights as integers
(VNNI / AMX int8; "auto": the pool's default, "off": never). --phases: per measurement, where
a call's time went (ms per call: route on the caller, then per phase the wall time as worker 0
sees it and the busy time summed over workers) and how many experts took the integer path.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tandem.ext.cpu import CpuExpertPool  # noqa: E402
from tools.peers.cpu_bandwidth import read_bandwidth_gbps  # noqa: E402

# One MoE layer of each model: hidden, expert intermediate, experts, top-k.
SHAPES = {
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "mixtral-8x7b": (4096, 14336, 8, 2),
    "deepseek-v3": (7168, 2048, 256, 8),
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shape", choices=SHAPES, default=None, help="sets the four below")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=768)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument(
        "--distinct-experts",
        type=int,
        default=0,
        help="draw this many random experts and repeat them to fill the layer (each copy its "
        "own memory): DeepSeek-V3's 11G parameters a layer take minutes to draw. 0: all",
    )
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 256])
    p.add_argument("--formats", nargs="+", default=["bf16", "int8", "int4"])
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--threads", type=int, default=None, help="pool threads (default: cpus - 1)")
    p.add_argument("--isa", default=None, help="force scalar|avx2|avx512|amx")
    p.add_argument(
        "--floor-gbps",
        type=float,
        default=None,
        help="CPU read bandwidth, GB/s (default: measured now by tools/peers/cpu_bandwidth.c "
        "at the pool's thread count)",
    )
    p.add_argument("--routings", type=int, default=16, help="routings cycled per token count")
    p.add_argument("--min-time", type=float, default=1.0, help="seconds per measurement")
    p.add_argument("--no-torch", action="store_true", help="skip the torch baseline")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.add_argument("--int-path", default="auto", help="auto | off | min tokens per expert")
    p.add_argument("--phases", action="store_true", help="print the per-phase breakdown")
    p.add_argument("--peer-kt", default=None, help="kt-kernel's files (fetch_kt_kernel.sh)")
    p.add_argument(
        "--layers",
        type=int,
        default=1,
        help="copies of the layer the calls rotate through (each routing on every copy): 8 "
        "keeps the weights read per cycle past a 300 MB L3, so 1 token reads from DRAM",
    )
    args = p.parse_args()
    if args.shape:
        args.hidden, args.inter, args.experts, args.topk = SHAPES[args.shape]
    return args


def random_experts(
    E: int, H: int, inter: int, distinct: int, g: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, 2I, H] gate rows then up rows and [E, H, I], bf16 as checkpoints ship them."""
    n = E if distinct <= 0 else min(distinct, E)
    w13 = (torch.randn(n, 2 * inter, H, generator=g) / H**0.5).to(torch.bfloat16)
    w2 = (torch.randn(n, H, inter, generator=g) / inter**0.5).to(torch.bfloat16)
    if n < E:
        reps = -(-E // n)
        w13 = w13.repeat(reps, 1, 1)[:E].contiguous()
        w2 = w2.repeat(reps, 1, 1)[:E].contiguous()
    return w13, w2


def time_call(fn, min_time: float, min_reps: int = 3) -> float:
    """Median seconds per call after one warm-up call; fn(i) gets the call number."""
    fn(0)
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < min_reps or time.perf_counter() - start < min_time:
        t0 = time.perf_counter()
        fn(len(times) + 1)
        times.append(time.perf_counter() - t0)
        if len(times) >= 1000:
            break
    return statistics.median(times)


PHASES = ("wake", "prep_x", "gate_up", "silu", "prep_act", "down", "reduce", "stall")


def phase_row(stats: dict) -> dict[str, float]:
    """ms per call: route, job, then wall/busy per phase; share of experts on the int path."""
    calls = max(1, stats["calls"])
    row = {"route_ms": stats["route_ns"] / calls / 1e6, "job_ms": stats["job_ns"] / calls / 1e6}
    for ph in PHASES:
        row[f"{ph}_wall_ms"] = stats["wall_ns"][ph] / calls / 1e6
        row[f"{ph}_busy_ms"] = stats["busy_ns"][ph] / calls / 1e6
    experts = stats["int_experts"] + stats["float_experts"]
    row["int_fraction"] = stats["int_experts"] / experts if experts else 0.0
    return row


def print_phases(row: dict[str, float], threads: int) -> None:
    parts = [f"route {row['route_ms']:.2f}"]
    for ph in PHASES:
        wall, busy = row[f"{ph}_wall_ms"], row[f"{ph}_busy_ms"]
        parts.append(f"{ph} {wall:.2f}/{busy / threads:.2f}")
    print(
        f"{'':>13} phases ms (wall/busy per thread): {' '.join(parts)}; "
        f"job {row['job_ms']:.2f}; int path {100 * row['int_fraction']:.0f}% of experts"
    )


def torch_moe(hidden, w13, w2, ids, weights) -> torch.Tensor:
    """Per-expert loop in the weights' dtype (the baseline a user would write)."""
    x = hidden.to(w13.dtype)
    out = torch.zeros(hidden.shape, dtype=torch.float32)
    inter = w13.shape[1] // 2
    for e in ids.unique().tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        gu = x[tok] @ w13[e].t()
        y = (F.silu(gu[:, :inter]) * gu[:, inter:]) @ w2[e].t()
        out.index_add_(0, tok, y.float() * weights[tok, slot, None])
    return out


def time_kt_peer(args, fmt: str, w13, w2, cases, rows: list[dict], pool_out: dict) -> None:
    """kt-kernel on the same layer copies and routings; adds kt_ms / vs_kt to the pool's rows
    and kt's relative difference from the pool's output (pool_out[T]: routing 0, copy 0)."""
    from tools.peers.kt_moe import KtMoeLayers

    threads = rows[0]["threads"] if rows else (args.threads or max(1, (os.cpu_count() or 2) - 1))
    kt = KtMoeLayers(
        args.peer_kt, fmt, w13, w2, args.topk, args.layers, threads, max(T for T, _, _ in cases)
    )
    print(f"{'kt':>5} {kt.method} ({kt.variant} build, {threads} threads) converted in "
          f"{kt.convert_s:.2f} s a layer")  # fmt: skip
    for (T, hidden, routings), row in zip(cases, rows, strict=True):
        staged = [kt.stage(hidden, *r) for r in routings]
        kt.forward(0, staged[0])
        ref = pool_out[T]
        row["kt_rel_diff_vs_pool"] = ((kt.last_output() - ref).norm() / ref.norm()).item()
        for i, s in enumerate(staged):  # warm every routing, as for the pool
            kt.forward(i % args.layers, s)
        times, start = [], time.perf_counter()
        while len(times) < 3 or time.perf_counter() - start < args.min_time:
            i = len(times)
            layer = (i // len(staged)) % args.layers
            times.append(kt.forward(layer, staged[i % len(staged)]))
        row["kt_method"], row["kt_ms"] = kt.method, 1e3 * statistics.median(times)
        row["vs_kt"] = row["kt_ms"] / row["pool_ms"]
        print(f"{'kt':>5} {T:>6} {'':>7} {row['kt_ms']:>9.3f}   pool {row['pool_ms']:.3f} ms: "
              f"{row['vs_kt']:.2f}x kt-kernel's speed; outputs differ by "
              f"{row['kt_rel_diff_vs_pool']:.1e}")  # fmt: skip
    kt.close()


def main() -> None:
    args = parse_args()
    E, H, inter, k = args.experts, args.hidden, args.inter, args.topk
    if args.floor_gbps is None:  # the floor at the rate the pool's threads can read right now
        threads = args.threads or max(1, (os.cpu_count() or 2) - 1)
        args.floor_gbps = read_bandwidth_gbps(threads)
        print(f"# CPU read bandwidth now: {args.floor_gbps:.1f} GB/s with {threads} threads "
              "(tools/peers/cpu_bandwidth.c)", flush=True)  # fmt: skip
    g = torch.Generator().manual_seed(0)
    w13, w2 = random_experts(E, H, inter, args.distinct_experts, g)
    cases = []
    for T in dict.fromkeys(args.tokens):  # a count given twice: one row (results keyed by it)
        hidden = torch.randn(T, H, generator=g)
        routings = [
            (
                torch.rand(T, E, generator=g).topk(k, dim=1).indices,  # distinct experts per token
                torch.softmax(torch.randn(T, k, generator=g), dim=1),
            )
            for _ in range(args.routings)
        ]
        cases.append((T, hidden, routings))

    torch_ms: dict[int, float] = {}
    torch_out: dict[int, torch.Tensor] = {}
    if not args.no_torch:
        for T, hidden, routings in cases:
            torch_out[T] = torch_moe(hidden, w13, w2, *routings[0])
            torch_ms[T] = 1e3 * time_call(
                lambda i, h=hidden, r=routings: torch_moe(h, w13, w2, *r[i % len(r)]),
                args.min_time,
            )

    results = []
    pool_out: dict[tuple[str, int], torch.Tensor] = {}
    print(
        f"MoE layer H={H} I={inter} E={E} top-{k}; torch {torch.__version__} with "
        f"{torch.get_num_threads()} threads; floor {args.floor_gbps:g} GB/s"
    )
    header = (
        f"{'fmt':>5} {'tokens':>6} {'experts':>7} {'pool ms':>9} {'GB/s':>7} {'floor%':>7} "
        f"{'torch ms':>9} {'speedup':>8} {'rel err':>8} {'floor ms':>9} {'cap':>7}"
    )
    for fmt in args.formats:
        int_min = {"auto": None, "off": 0}.get(args.int_path)
        if int_min is None and args.int_path != "auto":
            int_min = int(args.int_path)
        with CpuExpertPool(num_threads=args.threads, isa=args.isa, int_min_tokens=int_min) as pool:
            t0 = time.perf_counter()
            for layer in range(args.layers):
                pool.add_layer(layer, w13, w2, fmt, args.group_size)
            convert_s = (time.perf_counter() - t0) / args.layers
            info = pool.info()
            bytes_per_expert = info["bytes_per_format"][fmt] / (E * args.layers)
            if fmt == args.formats[0]:
                print(
                    f"pool: isa={info['isa']} int path={info['int_isa'] or 'none'} "
                    f"(from {info['int_min_tokens']} tokens/expert) packed rows="
                    f"{'on' if info['pack_rows'] else 'off'} threads={info['num_threads']} "
                    f"nodes={[n['node'] for n in info['numa_nodes']]}"
                )
                print(header)
            print(f"{fmt:>5} converted from bf16 in {convert_s:.2f} s a layer")
            for T, hidden, routings in cases:
                out = torch.empty_like(hidden)
                # every routing once first: the pool's buffers grow to the largest one's needs
                # here, not inside a timed call (that growth showed as "route" time)
                for r in routings:
                    pool.forward(0, hidden, *r, out)
                pool.reset_phase_stats()
                ms = 1e3 * time_call(
                    # call i: routing i % routings on copy (i // routings) % layers
                    lambda i, h=hidden, r=routings, o=out: pool.forward(
                        (i // len(r)) % args.layers, h, *r[i % len(r)], o
                    ),
                    args.min_time,
                )
                phases = phase_row(pool.phase_stats())
                active = statistics.mean(int(ids.unique().numel()) for ids, _ in routings)
                pool.forward(0, hidden, *routings[0], out)
                pool_out[fmt, T] = out.clone()
                gbps = active * bytes_per_expert / (ms * 1e-3) / 1e9
                # the weights read at the floor bandwidth: no call can be faster (caches aside),
                # so torch ms / floor ms caps the speed-up any kernel can show on this shape
                floor_ms = 1e3 * active * bytes_per_expert / (args.floor_gbps * 1e9)
                row = {
                    "format": fmt,
                    "tokens": T,
                    "active_experts": active,
                    "pool_ms": ms,
                    "weight_gbps": gbps,
                    "floor_fraction": gbps / args.floor_gbps,
                    "floor_ms": floor_ms,
                    "convert_s": convert_s,
                    "layers": args.layers,
                    "isa": info["isa"],
                    "int_isa": info["int_isa"],
                    "int_min_tokens": info["int_min_tokens"],
                    "pack_rows": info["pack_rows"],
                    "threads": info["num_threads"],
                    "phases": phases,
                }
                tms = torch_ms.get(T)
                if tms is not None:
                    ref = torch_out[T]
                    row["torch_ms"] = tms
                    row["speedup"] = tms / ms
                    row["speedup_cap"] = tms / floor_ms
                    row["rel_err_vs_torch_bf16"] = ((out - ref).norm() / ref.norm()).item()
                results.append(row)
                print(
                    f"{fmt:>5} {T:>6} {active:>7.1f} {ms:>9.3f} {gbps:>7.1f} "
                    f"{100 * gbps / args.floor_gbps:>6.1f}% "
                    f"{tms if tms is not None else float('nan'):>9.3f} "
                    f"{row.get('speedup', float('nan')):>7.2f}x "
                    f"{row.get('rel_err_vs_torch_bf16', float('nan')):>8.1e} "
                    f"{floor_ms:>9.3f} {row.get('speedup_cap', float('nan')):>6.2f}x"
                )
                if args.phases:
                    print_phases(phases, info["num_threads"])
    # kt-kernel after every pool run: its worker threads outlive its layers
    for fmt in args.formats if args.peer_kt else []:
        rows = [r for r in results if r["format"] == fmt]
        outs = {T: pool_out[fmt, T] for T, _, _ in cases}
        time_kt_peer(args, fmt, w13, w2, cases, rows, outs)
    if args.json:
        args.json.write_text(
            json.dumps(
                {"args": {k: str(v) for k, v in vars(args).items()}, "results": results}, indent=2
            )
        )


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""One MoE layer with every expert on the GPU, per token count and path of the "gpu" expert
backend (models/layers/gpu_experts.py): the decode kernels from the router's logits (`decode`:
route + sort, gate_up, down; routing included), the routed skinny kernels (`gemv`), the grouped
GEMMs (`grouped`, torch._grouped_mm) and the torch reference's per-expert loop (`torch`); the
last three start from routed ids (torch's router not timed).

Default shape: Qwen3-30B-A3B (hidden 2048, expert intermediate 768, 128 experts, top-8), bf16.
`--layers` copies of the layer's weights are cycled (4 x 1.2 GB by default), so a call does not
find its experts in the 50 MB L2 from the call before; every call also routes afresh. gemv and
grouped are timed as CUDA graphs of `--calls` calls (no launch overhead), torch eagerly.

Floor per token count: the bytes of the experts a step touches under uniform routing (E * (1 -
(1 - k/E)^T)) over the device's measured copy bandwidth, or the FLOPs over --tflops, whichever
is longer. `TANDEM_MOE_GEMV_TOKENS` (the backend's switch from gemv to grouped) should sit
where grouped starts to win.

    python tools/bench_gpu_moe.py [--tokens 1 2 4 8 16 32 64 128 256 2048] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tandem.ext.cuda import skinny  # noqa: E402
from tandem.models.layers.experts import TorchExpertBackend  # noqa: E402
from tandem.models.layers.gpu_experts import grouped_experts  # noqa: E402
from tools.bench_gpu import copy_bandwidth_gbps  # noqa: E402
from tools.bench_hybrid_moe import expert_bytes, touched_experts  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=768)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--layers", type=int, default=4, help="weight copies cycled")
    p.add_argument(
        "--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 256, 2048]
    )
    p.add_argument("--paths", nargs="+", default=["decode", "gemv", "grouped", "torch"])
    p.add_argument("--torch-max-tokens", type=int, default=2048)
    p.add_argument("--calls", type=int, default=16, help="calls per graph (and per timing)")
    p.add_argument("--reps", type=int, default=5, help="timings per cell; the median is kept")
    p.add_argument("--tflops", type=float, default=800.0, help="bf16 tensor-core rate (floor)")
    p.add_argument("--json", type=Path, default=None)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    dev, dt = torch.device("cuda"), torch.bfloat16
    H, inter, E, k = a.hidden, a.inter, a.experts, a.topk
    gbps = copy_bandwidth_gbps()
    one = expert_bytes(H, inter, "bf16")
    print(f"# {torch.cuda.get_device_name()}; layer: hidden {H}, inter {inter}, {E} experts "
          f"top-{k}, bf16, {a.layers} weight copies; copy bandwidth {gbps:.0f} GB/s", flush=True)  # fmt: skip
    g = torch.Generator(device=dev).manual_seed(0)
    w13 = [torch.randn(E, 2 * inter, H, device=dev, dtype=dt, generator=g) * 0.02 for _ in range(a.layers)]  # fmt: skip
    w2 = [torch.randn(E, H, inter, device=dev, dtype=dt, generator=g) * 0.02 for _ in range(a.layers)]  # fmt: skip
    ref = TorchExpertBackend()

    def call(path: str, x, ids, w, logits, i: int) -> torch.Tensor:
        layer = i % a.layers
        if path == "decode":
            return torch.ops.tandem.moe_decode_experts(x, logits, w13[layer], w2[layer], k, True)
        if path == "gemv":
            return torch.ops.tandem.moe_routed_experts(x, ids, w, w13[layer], w2[layer])
        if path == "grouped":
            return grouped_experts(x, ids, w, w13[layer], w2[layer])
        return ref.forward(layer, x, ids, w, w13[layer], w2[layer])

    rows, results = [], {}
    for t in a.tokens:
        xs = [torch.randn(t, H, device=dev, dtype=dt, generator=g) for _ in range(a.calls)]
        logits = [torch.randn(t, E, device=dev, generator=g).to(dt) for _ in range(a.calls)]
        routes = [torch.topk(torch.softmax(lg.float(), -1), k) for lg in logits]
        touched = touched_experts(E, k, t)
        flops = 2 * 3 * H * inter * t * k
        floor_ms = max(touched * one / (gbps * 1e9), flops / (a.tflops * 1e12)) * 1e3
        cell = {"touched_experts": touched, "floor_ms": floor_ms}
        for path in a.paths:
            if path == "torch" and t > a.torch_max_tokens:
                continue
            if path == "decode" and not skinny.moe_decode_supported(
                xs[0], logits[0], w13[0], w2[0], k
            ):
                continue

            def work(path=path, xs=xs, routes=routes, logits=logits) -> None:
                for i in range(a.calls):
                    call(path, xs[i], routes[i][1], routes[i][0], logits[i], i)

            try:
                work()  # compile, warm up
                torch.cuda.synchronize()
                replay = work
                if path != "torch":
                    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
                    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
                        work()
                    replay = graph.replay
                times = []
                for _ in range(a.reps):
                    s, e = (
                        torch.cuda.Event(enable_timing=True),
                        torch.cuda.Event(enable_timing=True),
                    )
                    s.record()
                    replay()
                    e.record()
                    e.synchronize()
                    times.append(s.elapsed_time(e) / a.calls)
                ms = sorted(times)[len(times) // 2]
                cell[path] = {"ms": ms, "GBps": touched * one / ms / 1e6, "floor": floor_ms / ms}
            except Exception as exc:  # noqa: BLE001 - a path that fails is reported
                cell[path] = {"error": f"{type(exc).__name__}: {exc}"}
        results[t] = cell
        parts = []
        for path in a.paths:
            c = cell.get(path)
            if c is None:
                parts.append("-")
            elif "error" in c:
                parts.append("error")
            else:
                parts.append(f"{c['ms']:.3f} ms ({c['GBps']:.0f} GB/s, {c['floor']:.0%})")
        rows.append(f"| {t} | {touched:.1f} | {floor_ms:.3f} | " + " | ".join(parts) + " |")
        print(f"# T={t}: " + json.dumps(cell, default=str), flush=True)
    print(f"\n| tokens | experts touched | floor ms | {' | '.join(a.paths)} |")
    print("|---" * (3 + len(a.paths)) + "|")
    print("\n".join(rows))
    if a.json:
        a.json.write_text(json.dumps({"args": vars(a) | {"json": str(a.json)}, "copy_gbps": gbps,
                                      "results": results}, indent=2, default=str))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

#!/usr/bin/env python3
"""GGUF-packed linears on CUDA at the Llama-3-8B shape (random packed weights of one type):
the 32 layers' qkv / o / gate_up / down projections and the lm_head, as a decode step at batch
1 (one CUDA graph of every linear) and as a 2,048-token prefill, next to the floor (packed bytes
per token at the device-to-device copy bandwidth measured in the same run) and to the same
shapes in bf16 through cuBLAS. Linears only: attention, norms and sampling are not in it.
4-bit types run in both layouts: "tile16" (the tensor-core GEMV the engine uses) and "rows"
(the row-per-warp GEMV).

    python tools/bench_gguf_gpu.py --types Q4_0,Q4_K [--json out.json]
    python tools/bench_gguf_gpu.py --gguf model.gguf [--profile] [--streams 16]

With --gguf: the file through Tandem's engine (weights packed): batch-1 decode, rate = new
tokens / (time(1 + new tokens) - time(1 token)) as tools/bench_offline.py measures it; a
2,048-token prefill; --streams N: N concurrent greedy streams' decode tok/s; --profile: the
top GPU kernels of 32 decode steps (torch.profiler).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tandem.ext.cuda import _loader, gguf_linear, gguf_tile  # noqa: E402, F401  (register ops)
from tandem.models.quant.tensor import GGUF_KEPT_TYPES, QuantizedTensor, ggml_block  # noqa: E402

HIDDEN, INTER, Q, KV, LAYERS, VOCAB = 4096, 14336, 4096, 1024, 32, 128256
SHAPES = [(Q + 2 * KV, HIDDEN), (HIDDEN, Q), (2 * INTER, HIDDEN), (HIDDEN, INTER)]


def random_packed(qtype: str, n: int, k: int) -> QuantizedTensor:
    """Random codes with sane fp16 scales (d 0.01, dmin 0.005) in every block."""
    block, size = ggml_block(qtype)
    data = torch.randint(0, 256, (n, k // block, size), dtype=torch.uint8, device="cuda")
    d = torch.tensor([0.01, 0.005], dtype=torch.float16).view(torch.uint8).cuda()
    if qtype == "Q6_K":
        data[..., 208:210] = d[:2]
        data[..., 192:208] = 32  # int8 sub-block scales
    elif qtype.endswith("_K"):
        data[..., 0:4] = d
    else:
        data[..., 0:2] = d[:2]
        if qtype == "Q4_1":
            data[..., 2:4] = d[2:]
    return QuantizedTensor(qtype, data.reshape(n, -1), k)


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(10):
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return 2 * nbytes / best  # read + write


def timed(fn, reps: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / reps


def graph_of(fn):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            fn()
    torch.cuda.synchronize()
    return g.replay


def linear(x: torch.Tensor, w: QuantizedTensor) -> torch.Tensor:
    if w.layout == "tile16":
        return torch.ops.tandem.gguf_tile_linear(x, w.data, w.type_id, w.cols)
    return torch.ops.tandem.gguf_linear(x, w.data, w.type_id, w.cols)


def sweep_variants(ws: list[QuantizedTensor], x: torch.Tensor, reps: int) -> dict:
    """Seconds per linear of the tile GEMV at each (warps, chunks in flight, PDL) setting."""
    out = torch.empty(1, ws[0].rows, device="cuda", dtype=x.dtype)
    r = {}
    for warps in (8, 16):
        for depth in (2, 4):
            for pdl in (True, False):
                _loader.PDL["on"] = pdl

                def fn(warps=warps, depth=depth) -> None:
                    for w in ws:
                        gguf_tile.launch_gemv(x, w.data, w.type_id, out, warps=warps, depth=depth)

                key = f"w{warps}d{depth}{'' if pdl else '-nopdl'}"
                r[key] = timed(graph_of(fn), reps) / len(ws)
    _loader.PDL["on"] = True
    return r


def bench_type(qtype: str, bw: float, reps: int, layout: str = "rows", sweep: bool = False) -> dict:
    before = torch.cuda.memory_allocated()
    weights = []
    for n, k in [s for _ in range(LAYERS) for s in SHAPES] + [(VOCAB, HIDDEN)]:
        w = random_packed(qtype, n, k)
        weights.append(w.as_tiles() if layout == "tile16" else w)
        del w
    packed = sum(w.nbytes for w in weights)
    resident = torch.cuda.memory_allocated() - before
    check = weights[0]
    x = torch.randn(3, HIDDEN, device="cuda", dtype=torch.bfloat16)
    got = linear(x, check).float()
    ref = x.float() @ check.dequantize().T
    rel = ((got - ref).norm() / ref.norm()).item()
    xs = {k: torch.randn(1, k, device="cuda", dtype=torch.bfloat16) for k in (HIDDEN, INTER)}

    def decode() -> None:
        for w in weights:
            linear(xs[w.cols], w)

    step = timed(graph_of(decode), reps)
    step_no_pdl = step_fold_flipped = None
    if layout == "tile16":
        _loader.PDL["on"] = False
        step_no_pdl = timed(graph_of(decode), reps)
        _loader.PDL["on"] = True
        tid, saved = weights[0].type_id, set(gguf_tile.FOLD_TYPES)
        gguf_tile.FOLD_TYPES ^= {tid}
        step_fold_flipped = timed(graph_of(decode), reps)
        gguf_tile.FOLD_TYPES = saved
    per_shape = []  # one linear of each shape alone, in a graph of 20 distinct layers' copies
    for i, (n, k) in enumerate(SHAPES + [(VOCAB, HIDDEN)]):
        ws = weights[i::4][:20] if i < 4 else weights[-1:]
        t = timed(graph_of(lambda ws=ws: [linear(xs[w.cols], w) for w in ws]), reps) / len(ws)
        row = {"n": n, "k": k, "s": t, "floor_s": ws[0].nbytes / bw}
        if sweep and layout == "tile16":
            row["variants"] = sweep_variants(ws, xs[k], reps)
        per_shape.append(row)
    xp = {k: torch.randn(2048, k, device="cuda", dtype=torch.bfloat16) for k in (HIDDEN, INTER)}

    def prefill() -> None:
        for w in weights:
            linear(xp[w.cols], w)

    pre = timed(prefill, 3)
    flops = 2 * 2048 * sum(w.rows * w.cols for w in weights)
    weights.clear()
    torch.cuda.empty_cache()
    floor_s = packed / bw
    return {
        "type": qtype,
        "layout": layout,
        "per_shape": per_shape,
        "packed_bytes": packed,
        "resident_bytes": resident,
        "rel_err_vs_dequant": rel,
        "decode_step_s": step,
        "decode_step_no_pdl_s": step_no_pdl,
        "decode_step_fold_flipped_s": step_fold_flipped,
        "decode_floor_s": floor_s,
        "decode_tok_s": 1 / step,
        "decode_floor_tok_s": 1 / floor_s,
        "decode_vs_floor": floor_s / step,
        "prefill_2048_s": pre,
        "prefill_tflops": flops / pre / 1e12,
    }


def bench_bf16(bw: float, reps: int) -> dict:
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for n, k in SHAPES]
    head = torch.randn(VOCAB, HIDDEN, device="cuda", dtype=torch.bfloat16) * 0.02
    per_layer = sum(w.numel() * 2 for w in ws)
    total = per_layer * LAYERS + head.numel() * 2
    xs = {k: torch.randn(1, k, device="cuda", dtype=torch.bfloat16) for k in (HIDDEN, INTER)}

    def decode() -> None:  # every layer's weights are distinct bytes in a real model; here one
        for _ in range(LAYERS):  # layer's set is reused, so its 0.4 GB may sit partly in L2
            for w in ws:
                torch.nn.functional.linear(xs[w.shape[1]], w)
        torch.nn.functional.linear(xs[HIDDEN], head)

    step = timed(graph_of(decode), reps)
    xp = {k: torch.randn(2048, k, device="cuda", dtype=torch.bfloat16) for k in (HIDDEN, INTER)}

    def prefill() -> None:
        for _ in range(LAYERS):
            for w in ws:
                torch.nn.functional.linear(xp[w.shape[1]], w)
        torch.nn.functional.linear(xp[HIDDEN], head)

    pre = timed(prefill, 3)
    flops = 2 * 2048 * (sum(w.numel() for w in ws) * LAYERS + head.numel())
    return {
        "type": "bf16 (cuBLAS)",
        "weight_bytes": total,
        "decode_step_s": step,
        "decode_tok_s": 1 / step,
        "decode_floor_tok_s": bw / total,
        "prefill_2048_s": pre,
        "prefill_tflops": flops / pre / 1e12,
    }


def _graph_step_s(llm) -> float:
    """GPU time of one replay of the batch-1 decode graph alone (no host work between)."""
    runner = llm.engine.runner
    g = runner._graphs[1].graph
    with torch.cuda.stream(runner.stream):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        g.replay()
        a.record()
        for _ in range(50):
            g.replay()
        b.record()
    b.synchronize()
    return a.elapsed_time(b) / 50 / 1e3


_KINDS = [("gemv", "gguf_tile_gemv"), ("norm", "rms_norm"), ("rope_kv", "rope"),
          ("attention", "paged"), ("attention", "decode"), ("add", "add"), ("add", "Add")]  # fmt: skip


def step_breakdown(llm, run) -> dict:
    """Per decode step: kernel time by kind from an eager profile (graphs set aside: a profile
    of a graph replay shows one opaque launch), the batch-1 graph's replay time and the
    engine's own step (1 / rate): replay minus kernel time = the graph's gaps between kernels;
    engine step minus replay = host work not hidden."""
    from torch.profiler import ProfilerActivity, profile

    runner = llm.engine.runner
    replay_s = _graph_step_s(llm)
    saved = dict(runner.graphs.graphs)
    runner.graphs.graphs.clear()

    def kernels(n: int) -> dict:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            run(n, [[1, 2, 3, 4, 5, 6, 7, 8]])
        acc: dict = {}
        for e in prof.key_averages():
            t = getattr(e, "self_device_time_total", None)
            if t is None:
                t = getattr(e, "self_cuda_time_total", 0)
            if t <= 0:
                continue
            kind = next((k for k, sub in _KINDS if sub in e.key), "other")
            s, c = acc.get(kind, (0.0, 0))
            acc[kind] = (s + t / 1e6, c + e.count)
        return acc

    try:
        run(9, [[1, 2, 3, 4, 5, 6, 7, 8]])
        long, short = kernels(33), kernels(1)
    finally:
        runner.graphs.graphs.update(saved)
    steps = 32
    per = {
        k: {"s": (v[0] - short.get(k, (0.0, 0))[0]) / steps,
            "kernels": (v[1] - short.get(k, (0.0, 0))[1]) / steps}
        for k, v in long.items()
    }  # fmt: skip
    total = sum(v["s"] for v in per.values())
    return {"per_step": per, "kernel_s": total, "graph_replay_s": replay_s,
            "graph_gaps_s": replay_s - total}  # fmt: skip


def fusion_ab(llm, run, new: int) -> dict:
    """Batch-1 graph replay and engine decode with programmatic dependent launch and the
    add+norm fusion each on and off (only the batch-1 graph recaptured per setting)."""
    from tandem.models.layers.norm import RMSNorm

    runner = llm.engine.runner
    fused = RMSNorm.add_norm

    def unfused(self, x, delta):
        if delta is None:
            return x, self(x)
        s = x + delta
        return s, self(s)

    out = {}
    runner.graphs.sizes = (1,)
    one = [[1, 2, 3, 4, 5, 6, 7, 8]]
    try:
        for name, pdl, add_norm in [("pdl+addnorm", True, fused), ("addnorm", False, fused),
                                    ("pdl", True, unfused), ("neither", False, unfused)]:  # fmt: skip
            _loader.PDL["on"] = pdl
            RMSNorm.add_norm = add_norm
            runner.graphs.graphs.clear()
            runner._capture_graphs()
            run(8, one)
            rate = new / (run(new + 1, one) - run(1, one))
            out[name] = {"graph_replay_s": _graph_step_s(llm), "decode_tok_s": rate}
    finally:
        _loader.PDL["on"] = True
        RMSNorm.add_norm = fused
    return out


def bench_engine(
    path: str,
    bw: float,
    new: int = 128,
    streams: int = 0,
    profile: str | None = None,
    breakdown: bool = False,
) -> dict:
    import time

    from tandem.models.quant.experts import PackedExperts
    from tandem.models.quant.linear import quant_modules, quantized_bytes
    from tandem.runtime import LLM, SamplingParams

    t = time.perf_counter()
    llm = LLM(path, device="cuda", max_model_len=4096)
    load_s = time.perf_counter() - t
    model = llm.engine.model
    dense = sum(p.numel() * p.element_size() for p in model.parameters())
    # read per token: every packed matrix but the embedding table (one row gathered); of a MoE
    # layer's stacked experts (w13/w2) only top_k / num_experts
    embed = sum(m.table.nbytes for m in quant_modules(model) if hasattr(m, "table") and m.table)
    cfg = model.config
    dense_experts = sum(
        p.numel() * p.element_size()
        for n, p in model.named_parameters()
        if n.endswith((".w13", ".w2"))
    )
    packed_experts = sum(m.nbytes for m in model.modules() if isinstance(m, PackedExperts))
    experts = dense_experts + packed_experts
    active = experts * cfg.num_experts_per_tok / cfg.num_experts if cfg.num_experts else 0
    read_bytes = quantized_bytes(model) - embed + dense - dense_experts + active

    def run(n: int, prompts: list[list[int]]) -> float:
        p = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        t = time.perf_counter()
        out = llm.generate(prompts, p)
        assert all(len(o.token_ids) == n for o in out)
        return time.perf_counter() - t

    one = [[1, 2, 3, 4, 5, 6, 7, 8]]
    run(8, one)
    rate = new / (run(new + 1, one) - run(1, one))
    long = [[(7 * i) % 1000 + 300 for i in range(2048)]]
    run(1, long)
    prefill = 2048 / min(run(1, [[p[0] + r, *p[1:]] for p in long]) for r in range(1, 3))
    r = {"gguf": path, "load_s": load_s, "read_bytes": read_bytes,
         "resident_bytes": quantized_bytes(model) + dense + packed_experts,
         "packed_expert_bytes": packed_experts, "decode_tok_s": rate,
         "floor_tok_s": bw / read_bytes, "prefill_2048_tok_s": prefill}  # fmt: skip
    calls = getattr(getattr(model, "expert_backend", None), "calls", None)
    if calls is not None:
        r["expert_calls"] = dict(calls)  # which expert paths ran (decode steps replay graphs)
    if streams:
        many = [[11 + i, 2, 3, 4, 5, 6, 7, 8] for i in range(streams)]
        run(8, many)
        r["streams"] = streams
        r["streams_decode_tok_s"] = streams * new / (run(new + 1, many) - run(1, many))
    if breakdown:
        r["breakdown"] = step_breakdown(llm, run)
        r["ab"] = fusion_ab(llm, run, new)
    if profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            run(33, one)
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30)
        Path(profile).write_text(table)
    return r


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--gguf", default=None, help="a GGUF file: batch-1 decode through the engine")
    ap.add_argument("--types", default="Q4_0,Q4_K")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", default=None)
    ap.add_argument("--streams", type=int, default=0, help="with --gguf: N concurrent streams")
    ap.add_argument("--profile", default=None, help="with --gguf: write the kernel table here")
    ap.add_argument("--breakdown", action="store_true",
                    help="with --gguf: where a decode step goes, and the fusions on/off")  # fmt: skip
    ap.add_argument("--sweep", action="store_true", help="tile GEMV settings per shape")
    args = ap.parse_args()
    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}  copy bandwidth {bw / 1e12:.2f} TB/s")
    if args.gguf:
        r = bench_engine(
            args.gguf, bw, streams=args.streams, profile=args.profile, breakdown=args.breakdown
        )
        print(
            f"{Path(args.gguf).name}: resident {r['resident_bytes'] / 1e9:.2f} GB, read per token"
            f" {r['read_bytes'] / 1e9:.2f} GB, load {r['load_s']:.0f} s, batch-1 decode"
            f" {r['decode_tok_s']:.1f} tok/s, floor {r['floor_tok_s']:.0f} tok/s"
            f" ({100 * r['decode_tok_s'] / r['floor_tok_s']:.0f}%), prefill 2048:"
            f" {r['prefill_2048_tok_s']:.0f} tok/s"
            + (
                f", {r['streams']} streams: {r['streams_decode_tok_s']:.0f} tok/s"
                if args.streams
                else ""
            )
        )
        if args.breakdown:
            b = r["breakdown"]
            print(
                f"step breakdown: graph replay {b['graph_replay_s'] * 1e3:.3f} ms, engine step"
                f" {1e3 / r['decode_tok_s']:.3f} ms, kernels {b['kernel_s'] * 1e3:.3f} ms, gaps"
                f" {b['graph_gaps_s'] * 1e3:.3f} ms | "
                + ", ".join(
                    f"{k}: {v['s'] * 1e3:.3f} ms / {v['kernels']:.0f} kernels"
                    for k, v in sorted(b["per_step"].items(), key=lambda kv: -kv[1]["s"])
                )
            )
            print(
                "A/B (batch-1 graph replay ms, engine tok/s): "
                + ", ".join(
                    f"{k}: {v['graph_replay_s'] * 1e3:.3f} ms, {v['decode_tok_s']:.1f}"
                    for k, v in r["ab"].items()
                )
            )
        if args.json:
            Path(args.json).write_text(json.dumps({"copy_bw": bw, "engine": r}, indent=2))
        return
    runs = []
    for qtype in args.types.split(","):
        if qtype not in GGUF_KEPT_TYPES:
            raise SystemExit(f"unknown type {qtype}")
        layouts = ["tile16", "rows"] if gguf_tile.type_id_of(qtype) is not None else ["rows"]
        for layout in layouts:
            r = bench_type(qtype, bw, args.reps, layout, sweep=args.sweep)
            runs.append(r)
            print(
                f"{qtype} {layout}: packed {r['packed_bytes'] / 1e9:.2f} GB (resident"
                f" {r['resident_bytes'] / 1e9:.2f}) rel.err {r['rel_err_vs_dequant']:.1e} | decode"
                f" {r['decode_step_s'] * 1e3:.2f} ms = {r['decode_tok_s']:.0f} tok/s, floor"
                f" {r['decode_floor_tok_s']:.0f} tok/s ({100 * r['decode_vs_floor']:.0f}% of floor)"
                f" | prefill 2048: {r['prefill_2048_s'] * 1e3:.1f} ms, {r['prefill_tflops']:.0f}"
                " TFLOP/s\n  per linear (n x k: us, % of its floor): "
                + ", ".join(
                    f"{p['n']}x{p['k']}: {p['s'] * 1e6:.1f} ({100 * p['floor_s'] / p['s']:.0f}%)"
                    for p in r["per_shape"]
                )
            )
            if r["decode_step_no_pdl_s"]:
                print(
                    f"  decode step without PDL: {r['decode_step_no_pdl_s'] * 1e3:.2f} ms; with"
                    f" the offset fold {'off' if qtype != 'Q4_0' else 'on'}:"
                    f" {r['decode_step_fold_flipped_s'] * 1e3:.2f} ms"
                )
            for p in r["per_shape"]:
                if "variants" in p:
                    print(f"  {p['n']}x{p['k']} us: " + ", ".join(
                        f"{k} {v * 1e6:.1f}" for k, v in p["variants"].items()))  # fmt: skip
    r = bench_bf16(bw, args.reps)
    runs.append(r)
    print(
        f"bf16 cuBLAS: decode {r['decode_step_s'] * 1e3:.2f} ms = {r['decode_tok_s']:.0f} tok/s"
        f" (floor {r['decode_floor_tok_s']:.0f}) | prefill 2048: {r['prefill_2048_s'] * 1e3:.1f} ms,"
        f" {r['prefill_tflops']:.0f} TFLOP/s"
    )
    if args.json:
        Path(args.json).write_text(json.dumps({"copy_bw": bw, "runs": runs}, indent=2))


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""GGUF-packed linears on CUDA at the Llama-3-8B shape (random packed weights of one type):
the 32 layers' qkv / o / gate_up / down projections and the lm_head, as a decode step at batch
1 (one CUDA graph of every linear) and as a 2,048-token prefill, next to the floor (packed bytes
per token at the device-to-device copy bandwidth measured in the same run) and to the same
shapes in bf16 through cuBLAS. Linears only: attention, norms and sampling are not in it.

    python tools/bench_gguf_gpu.py --types Q4_0,Q4_K [--json out.json]
    python tools/bench_gguf_gpu.py --gguf model.gguf     # the whole model through the engine

With --gguf: batch-1 decode of the file through Tandem's engine (weights packed), rate = new
tokens / (time(1 + new tokens) - time(1 token)), as tools/bench_offline.py measures it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tandem.ext.cuda import gguf_linear  # noqa: E402, F401  (registers torch.ops.tandem.gguf_linear)
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


def bench_type(qtype: str, bw: float, reps: int) -> dict:
    before = torch.cuda.memory_allocated()
    weights = [random_packed(qtype, n, k) for _ in range(LAYERS) for n, k in SHAPES]
    weights.append(random_packed(qtype, VOCAB, HIDDEN))
    packed = sum(w.nbytes for w in weights)
    resident = torch.cuda.memory_allocated() - before
    check = weights[0]
    x = torch.randn(3, HIDDEN, device="cuda", dtype=torch.bfloat16)
    got = torch.ops.tandem.gguf_linear(x, check.data, check.type_id, HIDDEN).float()
    ref = x.float() @ check.dequantize().T
    rel = ((got - ref).norm() / ref.norm()).item()
    xs = {k: torch.randn(1, k, device="cuda", dtype=torch.bfloat16) for k in (HIDDEN, INTER)}

    def decode() -> None:
        for w in weights:
            torch.ops.tandem.gguf_linear(xs[w.cols], w.data, w.type_id, w.cols)

    step = timed(graph_of(decode), reps)
    xp = {k: torch.randn(2048, k, device="cuda", dtype=torch.bfloat16) for k in (HIDDEN, INTER)}

    def prefill() -> None:
        for w in weights:
            torch.ops.tandem.gguf_linear(xp[w.cols], w.data, w.type_id, w.cols)

    pre = timed(prefill, 3)
    flops = 2 * 2048 * sum(w.rows * w.cols for w in weights)
    weights.clear()
    torch.cuda.empty_cache()
    floor_s = packed / bw
    return {
        "type": qtype,
        "packed_bytes": packed,
        "resident_bytes": resident,
        "rel_err_vs_dequant": rel,
        "decode_step_s": step,
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


def bench_engine(path: str, bw: float, new: int = 128) -> dict:
    import time

    from tandem.models.quant.linear import quantized_bytes
    from tandem.runtime import LLM, SamplingParams

    t = time.perf_counter()
    llm = LLM(path, device="cuda", max_model_len=1024)
    load_s = time.perf_counter() - t
    model = llm.engine.model
    weight_bytes = quantized_bytes(model) + sum(
        p.numel() * p.element_size() for p in model.parameters()
    )

    def run(n: int) -> float:
        p = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        t = time.perf_counter()
        out = llm.generate([[1, 2, 3, 4, 5, 6, 7, 8]], p)
        assert len(out[0].token_ids) == n
        return time.perf_counter() - t

    run(8)
    rate = new / (run(new + 1) - run(1))
    return {"gguf": path, "load_s": load_s, "weight_bytes": weight_bytes,
            "decode_tok_s": rate, "floor_tok_s": bw / weight_bytes}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--gguf", default=None, help="a GGUF file: batch-1 decode through the engine")
    ap.add_argument("--types", default="Q4_0,Q4_K")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}  copy bandwidth {bw / 1e12:.2f} TB/s")
    if args.gguf:
        r = bench_engine(args.gguf, bw)
        print(
            f"{Path(args.gguf).name}: weights {r['weight_bytes'] / 1e9:.2f} GB, load {r['load_s']:.0f} s,"
            f" batch-1 decode {r['decode_tok_s']:.1f} tok/s, floor {r['floor_tok_s']:.0f} tok/s"
            f" ({100 * r['decode_tok_s'] / r['floor_tok_s']:.0f}%)"
        )
        if args.json:
            Path(args.json).write_text(json.dumps({"copy_bw": bw, "engine": r}, indent=2))
        return
    runs = []
    for qtype in args.types.split(","):
        if qtype not in GGUF_KEPT_TYPES:
            raise SystemExit(f"unknown type {qtype}")
        r = bench_type(qtype, bw, args.reps)
        runs.append(r)
        print(
            f"{qtype}: packed {r['packed_bytes'] / 1e9:.2f} GB (resident {r['resident_bytes'] / 1e9:.2f})"
            f" rel.err {r['rel_err_vs_dequant']:.1e} | decode {r['decode_step_s'] * 1e3:.2f} ms"
            f" = {r['decode_tok_s']:.0f} tok/s, floor {r['decode_floor_tok_s']:.0f} tok/s"
            f" ({100 * r['decode_vs_floor']:.0f}% of floor) | prefill 2048: "
            f"{r['prefill_2048_s'] * 1e3:.1f} ms, {r['prefill_tflops']:.0f} TFLOP/s"
        )
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

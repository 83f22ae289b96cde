#!/usr/bin/env python3
"""Packed MoE experts on the GPU (the gpu expert backend's packed paths, ext/cuda/moe_quant.py)
against the same layers in bf16 (the backend's existing kernels), per step size: LAYERS
distinct layers of random packed experts (so L2 does not hold them), routed at random, timed
as one CUDA graph (decode sizes) or eagerly; floor = the touched experts' packed bytes at the
copy bandwidth measured in the same process. Also the resident bytes against the packed bytes.

    python tools/bench_packed_experts.py --shape qwen3-30b-a3b --type Q4_0
    python tools/bench_packed_experts.py --shape gpt-oss-120b --type MXFP4   # biases + clamp
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tandem.models.layers.experts import ClampedSwiGLU, ExpertBias  # noqa: E402
from tandem.models.layers.gpu_experts import GpuExpertBackend  # noqa: E402
from tandem.models.quant.experts import (  # noqa: E402
    PackedExperts,
    PackedExpertWeight,
    expert_names,
)
from tandem.models.quant.tensor import ggml_block  # noqa: E402
from tools.bench_gguf_gpu import copy_bandwidth, graph_of, timed  # noqa: E402

SHAPES = {  # hidden, expert intermediate, experts, top-k, biases
    "qwen3-30b-a3b": (2048, 768, 128, 8, False),
    "gpt-oss-120b": (2880, 2880, 128, 4, True),
}


def random_experts(qtype: str, hidden: int, inter: int, num: int) -> PackedExperts:
    """Random codes with sane scales in every block (the values do not matter for timing)."""
    experts = PackedExperts(expert_names("l.", 0, num), qtype, hidden, inter).cuda()
    _, size = ggml_block(qtype)
    for data, scales in ((experts.data13, experts.scales13), (experts.data2, experts.scales2)):
        data.random_(0, 256)
        if scales is not None:  # planes: codes and scales apart
            if qtype == "MXFP4":
                scales.fill_(118)  # e8m0: 2^-10 (x the doubled e2m1 values)
            else:
                scales.view(torch.float16).fill_(0.005)
            continue
        blocks = data.view(-1, size)
        if qtype == "Q6_K":
            blocks[:, 208:210] = torch.tensor([0.01], dtype=torch.float16).view(torch.uint8).cuda()
        else:  # d (and dmin / m) at the block's start
            d = torch.tensor([0.005, 0.001], dtype=torch.float16).view(torch.uint8).cuda()
            n = 4 if qtype.endswith("_K") or qtype == "Q4_1" else 2
            blocks[:, :n] = d[:n]
    return experts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    ap.add_argument("--type", default="Q4_0")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--tokens", default="1,2,4,8,16,32,64,128,300,1024")
    ap.add_argument("--bf16", action="store_true", help="also the same layers in bf16")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    hidden, inter, num, top_k, biased = SHAPES[args.shape]
    bw = copy_bandwidth()
    layers = [random_experts(args.type, hidden, inter, num) for _ in range(args.layers)]
    packed_bytes = layers[0].nbytes
    bias = None
    if biased:
        bias = ExpertBias(
            torch.randn(num, 2 * inter, device="cuda", dtype=torch.bfloat16) * 0.1,
            torch.randn(num, hidden, device="cuda", dtype=torch.bfloat16) * 0.1,
            ClampedSwiGLU(1.702, 7.0),
        )
    dense = []
    if args.bf16:
        for experts in layers[: max(1, min(args.layers, 64 * 2**30 // (8 * packed_bytes)))]:
            dense.append(experts.dequantize(torch.bfloat16))
    print(f"# {args.shape} {args.type}: {args.layers} layers of {num} experts, top-{top_k}; "
          f"{packed_bytes / 1e6:.1f} MB packed a layer; copy bandwidth {bw / 1e12:.2f} TB/s")  # fmt: skip
    rows = []
    for t in [int(x) for x in args.tokens.split(",")]:
        g = torch.Generator("cuda").manual_seed(t)
        x = torch.randn(t, hidden, device="cuda", dtype=torch.bfloat16, generator=g)
        logits = torch.randn(t, num, device="cuda", generator=g).bfloat16()
        w, ids = torch.topk(torch.softmax(logits.float(), -1), top_k, dim=-1)
        w = w / w.sum(-1, keepdim=True)
        touched = torch.unique(ids).numel()
        floor_s = args.layers * touched * packed_bytes / num / bw
        row = {"tokens": t, "touched_experts": touched, "floor_us": floor_s * 1e6}
        views = [(PackedExpertWeight(e, "13"), PackedExpertWeight(e, "2")) for e in layers]
        paths = [("gemv", 1 << 30), ("grouped", 0)]
        if t <= 16 and bias is None:
            paths.insert(0, ("decode", 1 << 30))  # from the router's logits, as the engine runs
        for name, limit in paths:
            backend = GpuExpertBackend(packed_gemv_max_tokens=limit)

            def step(backend=backend, name=name, x=x, ids=ids, w=w, logits=logits, views=views):
                for w13, w2 in views:
                    if name == "decode":
                        backend.forward_logits(0, x, logits, top_k, True, w13, w2)
                    else:
                        backend.forward(0, x, ids, w, w13, w2, bias=bias)

            fn = graph_of(step) if t <= 64 else step
            row[f"{name}_us"] = timed(fn, 10 if t <= 64 else 3) * 1e6
            if name == "decode":
                assert backend.calls["qdecode"] > 0, backend.calls
        if dense:
            backend = GpuExpertBackend()

            def step_bf16(backend=backend, x=x, ids=ids, w=w, logits=logits) -> None:
                for i in range(args.layers):  # the backend's own decode kernels where they take it
                    w13, w2 = dense[i % len(dense)]
                    out = None
                    if bias is None:
                        out = backend.forward_logits(0, x, logits, top_k, True, w13, w2)
                    if out is None:
                        backend.forward(0, x, ids, w, w13, w2, bias=bias)

            fn = graph_of(step_bf16) if t <= 64 else step_bf16
            row["bf16_us"] = timed(fn, 10 if t <= 64 else 3) * 1e6
        rows.append(row)
        cells = " ".join(f"{k}={v:.1f}" for k, v in row.items() if k.endswith("_us"))
        print(f"tokens={t:5d} touched={touched:3d} {cells} "
              f"(best {row['floor_us'] / min(row[k] for k in row if k.startswith(('decode', 'gemv'))):.0%} of floor)")  # fmt: skip
    resident = sum(e.nbytes for e in layers)
    stats = {"shape": args.shape, "type": args.type, "bw": bw, "packed_bytes_per_layer":
             packed_bytes, "resident_bytes": resident, "rows": rows}  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(stats, indent=1))


if __name__ == "__main__":
    main()

"""MLA decode kernel benchmark (ext/cuda/mla.py) against its memory floor and the torch
reference (ext/mla_ref.py), all in one run.

DeepSeek-V3 shapes by default: 128 heads, kv_lora_rank 512, rope 64, bf16, block 16. Floor =
latent bytes read (batch x context x 576 x 2) / device-to-device copy bandwidth measured in
this run. Kernel time is a CUDA-graph replay (no launch gaps); small cases rotate over several
caches and block tables so the 50 MB L2 does not hold the latent rows between calls.

    python3 tools/bench_mla.py [--heads 128] [--batches 1 16 64 128] [--contexts 1024 8192 32768]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics

import torch

from tandem.ext.cuda import mla_attention_cuda
from tandem.ext.cuda.mla import SM90_HEADS, SM90_TILE, choose_kernel, plan_mla, rows_per_cta
from tandem.ext.mla_ref import mla_attention_ref

L, R, BS = 512, 64, 16
DTYPE = torch.bfloat16


def time_ms(fn, iters: int, warmup: int = 2) -> float:
    """Median of per-iteration CUDA-event times (ms)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def measure_copy_bw() -> float:
    """Device-to-device copy bandwidth (bytes read + written per second), 2 GiB buffers."""
    src = torch.empty(1 << 30, dtype=torch.int16, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), 10)
    return 2 * (1 << 30) * 2 / (ms * 1e-3)


def graph_ms(fn, iters: int) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return time_ms(graph.replay, iters)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def bench_decode(
    heads: int,
    batch: int,
    ctx: int,
    copy_bw: float,
    iters: int,
    kernel: str = "auto",
    ref_ms: float | None = None,
) -> dict:
    """One decode shape; `ref_ms`: the torch reference's time if already measured."""
    latent_bytes = batch * ctx * (L + R) * 2
    rot = max(1, min(16, math.ceil(256e6 / latent_bytes)))
    blocks_per_seq = ctx // BS
    num_blocks = batch * blocks_per_seq * rot
    cache = torch.randn(num_blocks, BS, L + R, device="cuda", dtype=DTYPE)
    perm = torch.randperm(num_blocks, device="cuda").int().view(rot, batch, blocks_per_seq)
    tables = [perm[r].contiguous() for r in range(rot)]
    q_lat = torch.randn(batch, heads, L, device="cuda", dtype=DTYPE)
    q_rope = torch.randn(batch, heads, R, device="cuda", dtype=DTYPE)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    out = torch.empty_like(q_lat)
    scale = (128 + R) ** -0.5

    def ours_all():
        for t in tables:
            mla_attention_cuda(
                q_lat, q_rope, cache, qsl, seq_lens, t, scale, ctx, out=out, kernel=kernel
            )

    ours_all()
    ref = mla_attention_ref(q_lat, q_rope, cache, [1] * batch, [ctx] * batch, tables[-1], scale)
    err = rel_err(out, ref)
    kernel_ms = graph_ms(ours_all, iters) / rot
    if ref_ms is None:
        ref_ms = time_ms(
            lambda: mla_attention_ref(
                q_lat, q_rope, cache, [1] * batch, [ctx] * batch, tables[0], scale
            ),  # fmt: skip
            max(2, iters // 10),
            warmup=1,
        )
    flops = batch * ctx * heads * 2 * (2 * L + R)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    sm90 = choose_kernel(kernel, L, R, heads, 0) is not None
    hm, tile = (SM90_HEADS, SM90_TILE) if sm90 else (rows_per_cta(heads), 32)
    _, parts = plan_mla(batch, heads // hm, ctx, sms, tile)
    floor_us = latent_bytes / copy_bw * 1e6
    return dict(
        kernel="sm90" if sm90 else "portable", heads=heads, batch=batch, ctx=ctx, parts=parts, kernel_us=kernel_ms * 1e3,
        floor_us=floor_us, pct_floor=100 * floor_us / (kernel_ms * 1e3),
        tflops=flops / (kernel_ms * 1e-3) / 1e12, ref_us=ref_ms * 1e3,
        speedup=ref_ms / kernel_ms, err=err,
    )  # fmt: skip


def bench_extend(heads: int, tokens: int, iters: int, kernel: str = "auto") -> dict:
    """One prefill chunk of `tokens` tokens with no prefix (causal), kernel vs reference."""
    nb = tokens // BS
    cache = torch.randn(nb, BS, L + R, device="cuda", dtype=DTYPE)
    table = torch.randperm(nb, device="cuda").int()[None]
    q_lat = torch.randn(tokens, heads, L, device="cuda", dtype=DTYPE)
    q_rope = torch.randn(tokens, heads, R, device="cuda", dtype=DTYPE)
    qsl = torch.tensor([0, tokens], dtype=torch.int32, device="cuda")
    sl = torch.tensor([tokens], dtype=torch.int32, device="cuda")
    out = torch.empty_like(q_lat)
    scale = (128 + R) ** -0.5
    ours = time_ms(
        lambda: mla_attention_cuda(
            q_lat, q_rope, cache, qsl, sl, table, scale, tokens, out=out, kernel=kernel
        ),
        iters,
    )
    ref_ms = time_ms(
        lambda: mla_attention_ref(q_lat, q_rope, cache, [tokens], [tokens], table, scale), 2, 1
    )
    ref = mla_attention_ref(q_lat, q_rope, cache, [tokens], [tokens], table, scale)
    flops = tokens * (tokens + 1) / 2 * heads * 2 * (2 * L + R)
    return dict(
        kernel=kernel, heads=heads, tokens=tokens, kernel_us=ours * 1e3, tflops=flops / (ours * 1e-3) / 1e12,
        ref_us=ref_ms * 1e3, err=rel_err(out, ref),
    )  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", type=int, nargs="+", default=[128])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 128])
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192, 32768])
    ap.add_argument("--kernels", nargs="+", default=["auto"], help="auto, sm90, portable")
    ap.add_argument("--extend-tokens", type=int, default=2048)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--json", default=None)
    ap.add_argument("--skip-ref", action="store_true", help="do not time the torch reference")
    args = ap.parse_args()
    torch.manual_seed(0)
    copy_bw = measure_copy_bw()
    print(f"device {torch.cuda.get_device_name(0)}; d2d copy {copy_bw / 1e12:.2f} TB/s")
    print(f"{'kernel':>8} {'H':>4} {'batch':>5} {'ctx':>6} {'parts':>5} {'kernel us':>10} "
          f"{'floor us':>9} {'%floor':>7} {'TFLOP/s':>8} {'torch ref us':>13} {'x ref':>7} {'rel err':>8}")  # fmt: skip
    rows, ref_times = [], {}
    for heads, batch, ctx, kernel in itertools.product(
        args.heads, args.batches, args.contexts, args.kernels
    ):
        ref = float("nan") if args.skip_ref else ref_times.get((heads, batch, ctx))
        r = bench_decode(heads, batch, ctx, copy_bw, args.iters, kernel, ref)
        ref_times[(heads, batch, ctx)] = r["ref_us"] / 1e3
        rows.append(r)
        print(f"{r['kernel']:>8} {heads:>4} {batch:>5} {ctx:>6} {r['parts']:>5} "
              f"{r['kernel_us']:>10.1f} {r['floor_us']:>9.1f} {r['pct_floor']:>6.1f}% "
              f"{r['tflops']:>8.1f} {r['ref_us']:>13.0f} {r['speedup']:>6.1f}x "
              f"{r['err']:>8.1e}", flush=True)  # fmt: skip
        torch.cuda.empty_cache()
    ext = []
    if args.extend_tokens:
        for heads, kernel in itertools.product(args.heads, args.kernels):
            e = bench_extend(heads, args.extend_tokens, max(3, args.iters // 5), kernel)
            ext.append(e)
            print(f"extend {kernel} H{heads} {e['tokens']} tokens: kernel {e['kernel_us']:.0f} us "
                  f"({e['tflops']:.0f} TFLOP/s causal), torch ref {e['ref_us']:.0f} us, "
                  f"rel err {e['err']:.1e}", flush=True)  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(copy_bw=copy_bw, decode=rows, extend=ext), f, indent=1)


if __name__ == "__main__":
    main()

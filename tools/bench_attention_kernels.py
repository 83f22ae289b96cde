"""Decode-attention kernel benchmark: ext/cuda paged_decode vs torch (gather + SDPA), one run.

Llama-3-8B head shapes (32 query heads, 8 KV heads, head_dim 128, bf16, block 16) at batch
1/64/256 and contexts 512/4k/32k. Prints per call: kernel time (CUDA-graph replay, so no
launch gaps), eager time per call (Python and launch overhead included), achieved KV-read
bandwidth against the 3.0 TB/s device-copy figure (ARCHITECTURE.md), the torch reference time
and the ratio, and the relative error of ours against the reference. Small cases rotate over
several block tables and caches so the 50 MB L2 does not hold the KV between calls.
Also one extend (prefill) line against SDPA's causal flash path on contiguous K/V.

    python3 tools/bench_attention_kernels.py [--batches 1 64 256] [--contexts 512 4096 32768]
"""

from __future__ import annotations

import argparse
import math
import statistics

import torch
import torch.nn.functional as F

from tandem.ext.cuda import paged_decode, paged_extend
from tandem.ext.cuda.kernels import plan_decode

COPY_BW = 3.0e12  # bytes/s, device-to-device copy on the lent H100 (reads + writes)
H, KVH, D, BS = 32, 8, 128, 16
DTYPE = torch.bfloat16


def time_ms(fn, iters: int, warmup: int = 3) -> float:
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
    return 2 * src.numel() * 2 / (ms * 1e-3)


def ref_decode(q, k_cache, v_cache, bt, ctx, scale, max_gather_bytes=4 << 30):
    """torch reference: gather each sequence's KV from the paged cache, then SDPA (GQA)."""
    batch = q.shape[0]
    per_seq = ctx * KVH * D * 2 * 2
    step = max(1, min(batch, max_gather_bytes // per_seq))
    outs = []
    for s in range(0, batch, step):
        idx = bt[s : s + step].long()
        k = k_cache[idx].view(idx.shape[0], ctx, KVH, D).transpose(1, 2)
        v = v_cache[idx].view(idx.shape[0], ctx, KVH, D).transpose(1, 2)
        o = F.scaled_dot_product_attention(
            q[s : s + step, :, None, :], k, v, scale=scale, enable_gqa=True
        )
        outs.append(o[:, :, 0, :])
    return torch.cat(outs)


def bench_decode(batch: int, ctx: int, iters: int) -> dict:
    kv_bytes = batch * ctx * KVH * D * 2 * 2
    rot = max(1, min(32, math.ceil(256e6 / kv_bytes)))  # copies that together overflow L2
    blocks_per_seq = ctx // BS
    num_blocks = batch * blocks_per_seq * rot
    k_cache = torch.randn(num_blocks, BS, KVH, D, device="cuda", dtype=DTYPE)
    v_cache = torch.randn(num_blocks, BS, KVH, D, device="cuda", dtype=DTYPE)
    bts = torch.randperm(num_blocks, device="cuda").int().view(rot, batch, blocks_per_seq)
    bts = [bts[r].contiguous() for r in range(rot)]
    q = torch.randn(batch, H, D, device="cuda", dtype=DTYPE)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)
    scale = D**-0.5

    # correctness against the reference on rotation 0
    out.fill_(float("nan"))
    paged_decode(q, k_cache, v_cache, seq_lens, bts[0], scale, out=out, max_seq_len=ctx)
    ref = ref_decode(q, k_cache, v_cache, bts[0], ctx, scale).float()
    err = ((out.float() - ref).norm() / ref.norm()).item()

    def ours_all():
        for r in range(rot):
            paged_decode(q, k_cache, v_cache, seq_lens, bts[r], scale, out=out, max_seq_len=ctx)

    eager_ms = time_ms(ours_all, iters) / rot
    graph_ms = math.nan
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            ours_all()
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            ours_all()
        graph_ms = time_ms(graph.replay, iters) / rot
    except Exception as e:  # report, keep the eager number
        print(f"  graph capture failed: {e!r}")
    kernel_ms = graph_ms if graph_ms == graph_ms else eager_ms

    def ref_all():
        for r in range(rot):
            ref_decode(q, k_cache, v_cache, bts[r], ctx, scale)

    ref_ms = time_ms(ref_all, max(3, iters // 4), warmup=1) / rot
    part_len, num_parts = plan_decode(
        batch, KVH, H // KVH, ctx, torch.cuda.get_device_properties(0).multi_processor_count
    )
    bw = kv_bytes / (kernel_ms * 1e-3)
    return dict(
        batch=batch,
        ctx=ctx,
        parts=num_parts,
        kernel_us=kernel_ms * 1e3,
        eager_us=eager_ms * 1e3,
        floor_us=kv_bytes / COPY_BW * 1e6,
        bw=bw,
        ref_us=ref_ms * 1e3,
        err=err,
    )


def bench_extend(tokens: int, iters: int) -> None:
    """One prefill of `tokens` tokens, no prefix; vs SDPA causal on contiguous K/V."""
    nb = tokens // BS
    k_cache = torch.randn(nb, BS, KVH, D, device="cuda", dtype=DTYPE)
    v_cache = torch.randn(nb, BS, KVH, D, device="cuda", dtype=DTYPE)
    bt = torch.randperm(nb, device="cuda").int()[None]
    q = torch.randn(tokens, H, D, device="cuda", dtype=DTYPE)
    qsl = torch.tensor([0, tokens], dtype=torch.int32, device="cuda")
    sl = torch.tensor([tokens], dtype=torch.int32, device="cuda")
    scale = D**-0.5
    out = torch.empty_like(q)
    ours = time_ms(
        lambda: paged_extend(q, k_cache, v_cache, qsl, sl, bt, tokens, scale, out=out), iters
    )
    k = k_cache[bt[0].long()].view(tokens, KVH, D).transpose(0, 1)[None]
    v = v_cache[bt[0].long()].view(tokens, KVH, D).transpose(0, 1)[None]
    qt = q.transpose(0, 1)[None]
    ref = time_ms(
        lambda: F.scaled_dot_product_attention(
            qt, k, v, is_causal=True, scale=scale, enable_gqa=True
        ),
        iters,
    )
    ro = (
        F.scaled_dot_product_attention(qt, k, v, is_causal=True, scale=scale, enable_gqa=True)[0]
        .transpose(0, 1)
        .float()
    )
    err = ((out.float() - ro).norm() / ro.norm()).item()
    flops = 4 * H * D * tokens * tokens / 2
    print(
        f"extend T={tokens}: ours {ours * 1e3:8.1f} us ({flops / ours / 1e9:6.1f} TFLOP/s)  "
        f"SDPA causal (contiguous KV) {ref * 1e3:8.1f} us ({flops / ref / 1e9:6.1f} TFLOP/s)  "
        f"ours/SDPA time {ours / ref:5.2f}  rel err {err:.1e}"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 4096, 32768])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--extend-tokens", type=int, default=4096)
    args = ap.parse_args()
    global COPY_BW
    torch.manual_seed(0)
    name = torch.cuda.get_device_name()
    measured = measure_copy_bw()
    print(f"device: {name}  shapes: H={H} KVH={KVH} D={D} block={BS} {DTYPE}")
    print(f"device copy measured here: {measured / 1e12:.2f} TB/s (H100 figure: 3.0 TB/s)")
    if "H100" not in name:  # compare with this device's own copy, not the H100 figure
        COPY_BW = measured
    print(
        f"floor = KV bytes / {COPY_BW / 1e12:.2f} TB/s; %copy = KV-read BW / that; ref = gather+SDPA"
    )
    hdr = (
        f"{'batch':>5} {'ctx':>6} {'parts':>5} {'kernel us':>10} {'eager us':>9} {'floor us':>9} "
        f"{'GB/s':>7} {'%copy':>6} {'ref us':>10} {'ref/ours':>8} {'rel err':>8}"
    )
    rows = []
    for batch in args.batches:
        for ctx in args.contexts:
            r = bench_decode(batch, ctx, args.iters)
            rows.append(r)
            torch.cuda.empty_cache()  # the previous case's caches are garbage now
            print(f"  done batch {batch} ctx {ctx}", flush=True)
    print(hdr)
    for r in rows:
        print(
            f"{r['batch']:>5} {r['ctx']:>6} {r['parts']:>5} {r['kernel_us']:>10.1f} {r['eager_us']:>9.1f} "
            f"{r['floor_us']:>9.1f} {r['bw'] / 1e9:>7.0f} {100 * r['bw'] / COPY_BW:>5.0f}% "
            f"{r['ref_us']:>10.1f} {r['ref_us'] / r['kernel_us']:>8.1f} {r['err']:>8.1e}"
        )
    if args.extend_tokens:
        bench_extend(args.extend_tokens, args.iters)


if __name__ == "__main__":
    main()

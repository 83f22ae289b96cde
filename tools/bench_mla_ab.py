"""A/B of the Hopper MLA kernel: this tree's `mla_sm90.cu` against another build of it (a cubin
made from another revision) on the same caches, interleaved, over several rounds, as % of the
floor of tools/bench_mla.py. DeepSeek-V3 shape (H = 128, L = 512, R = 64, bf16, block 16).

    git show main:ext/cuda/mla_sm90.cu > /tmp/base.cu
    nvcc -arch=sm_90a -cubin -O3 -std=c++17 --use_fast_math -I ext/cuda -o /tmp/base.cubin /tmp/base.cu
    python3 tools/bench_mla_ab.py --base-cubin /tmp/base.cubin [--rounds 2]

The base build runs without cluster merges (its kernel name is `--base-name`), as main's did.
"""

from __future__ import annotations

import argparse
import math

import torch
from bench_mla import graph_ms, measure_copy_bw, rel_err  # tools/ is the script's directory

import tandem.ext.cuda.mla as M
from tandem.ext.cuda import mla_attention_cuda
from tandem.ext.mla_ref import mla_attention_ref

L, R, BS, H = 512, 64, 16, 128
CELLS = ((16, 8192), (16, 32768), (32, 8192), (64, 8192), (64, 32768), (128, 8192), (128, 32768))


def select(which: str, base_cubin: str, base_name: str, ours: tuple) -> None:
    """Point the launcher at the base cubin (no clusters) or back at this tree's kernel."""
    if which == "base":
        M._sm90_module = lambda index: base_cubin
        M.SM90_CLUSTERS = ()
        M.sm90_kernel_name = lambda dtype, cluster: base_name
    else:
        M._sm90_module, M.SM90_CLUSTERS, M.sm90_kernel_name = ours


def cell(batch: int, ctx: int, copy_bw: float, order: list[str], args, ours, res: dict) -> None:
    latent_bytes = batch * ctx * (L + R) * 2
    rot = max(1, min(16, math.ceil(256e6 / latent_bytes)))
    nb = batch * (ctx // BS) * rot
    cache = torch.randn(nb, BS, L + R, device="cuda", dtype=torch.bfloat16)
    perm = torch.randperm(nb, device="cuda").int().view(rot, batch, ctx // BS)
    tables = [perm[r].contiguous() for r in range(rot)]
    q_lat = torch.randn(batch, H, L, device="cuda", dtype=torch.bfloat16)
    q_rope = torch.randn(batch, H, R, device="cuda", dtype=torch.bfloat16)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    sl = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    out = torch.empty_like(q_lat)
    scale = (128 + R) ** -0.5
    ref = mla_attention_ref(q_lat, q_rope, cache, [1] * batch, [ctx] * batch, tables[-1], scale)
    floor_us = latent_bytes / copy_bw * 1e6

    def run_all() -> None:
        for t in tables:
            mla_attention_cuda(q_lat, q_rope, cache, qsl, sl, t, scale, ctx, out=out,
                               kernel="sm90")  # fmt: skip

    for which in order:
        select(which, args.base_cubin, args.base_name, ours)
        out.fill_(float("nan"))
        run_all()
        err = rel_err(out, ref)
        us = graph_ms(run_all, args.iters) / rot * 1e3
        res.setdefault((batch, ctx, which), []).append(100 * floor_us / us)
        print(f"b{batch:>4} ctx {ctx:>6} {which:>4}: {us:9.1f} us {100 * floor_us / us:5.1f}% "
              f"of {floor_us:.1f} us, rel err {err:.1e}", flush=True)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-cubin", required=True)
    ap.add_argument("--base-name", default="mla90_bf16")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--iters", type=int, default=30)
    args = ap.parse_args()
    torch.manual_seed(0)
    ours = (M._sm90_module, M.SM90_CLUSTERS, M.sm90_kernel_name)
    copy_bw = measure_copy_bw()
    print(f"device {torch.cuda.get_device_name(0)}; d2d copy {copy_bw / 1e12:.2f} TB/s")
    res: dict = {}
    for rnd in range(args.rounds):
        for batch, ctx in CELLS:
            order = ["base", "ours"] if rnd % 2 == 0 else ["ours", "base"]
            cell(batch, ctx, copy_bw, order, args, ours, res)
            torch.cuda.empty_cache()
    print("% of floor, min-max over the rounds:", " ".join(f"b{b}/{c}" for b, c in CELLS))
    for which in ("base", "ours"):
        row = [f"{min(res[(b, c, which)]):.1f}-{max(res[(b, c, which)]):.1f}" for b, c in CELLS]
        print(f"{which:>4} " + " ".join(row))


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Where an offline throughput run's time goes, step by step (GPU machine).

    python tools/trace_steps.py --shape 8B --num 256 --input-len 256 --output-len 256

Runs `LLM.generate` on random bf16 weights of a bench_gpu.py shape with CUDA timing events
around every step the runner launches, then prints the run's output tok/s and, per kind of
step (decode at a graph bucket, prefill-only, mixed prefill + decode), how many there were,
their tokens and sequences, and their GPU time; the rest of the wall time is host time the
GPU waited for. Also the KV blocks, preemptions and runner counters, and with
--profile-buckets the per-kernel GPU time of those decode graphs.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tandem.models.loader import apply_fast_linears, build_model  # noqa: E402
from tandem.models.loader.dummy import init_dummy_weights  # noqa: E402
from tandem.runtime.config import CacheConfig, EngineConfig, ModelSpec, SchedulerConfig  # noqa: E402
from tandem.runtime.cuda_runner import CudaRunnerOptions  # noqa: E402
from tandem.runtime.llm import LLM  # noqa: E402
from tandem.runtime.sampling_params import SamplingParams  # noqa: E402
from tandem.runtime.types import SchedulerOutput  # noqa: E402
from tools.bench_gpu import profile_graph, random_prompts, shape_config  # noqa: E402


def step_kind(sched: SchedulerOutput) -> str:
    prefill = sum(s.num_tokens for s in sched.seqs if s.num_tokens > 1 or not s.sample)
    if not prefill:
        return f"decode {len(sched.seqs)}"
    if prefill == sched.num_batched_tokens:
        return "prefill"
    return "mixed"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--shape", default="8B")
    ap.add_argument("--num", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--compile", default=None, help="torch.compile mode of the decode graphs")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument(
        "--profile-buckets", default="", help="comma list: per-kernel table of those decode graphs"
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    cfg = shape_config(args.shape)
    model = build_model(cfg, dtype=torch.bfloat16, device="cuda", attn_backend="cupy")
    init_dummy_weights(model, seed=0)
    apply_fast_linears(model, "cuda", torch.bfloat16)
    ec = EngineConfig(
        model=ModelSpec(model=f"llama-{args.shape}-dummy", device="cuda", dtype="bfloat16"),
        cache=CacheConfig(block_size=16, gpu_memory_utilization=args.gpu_memory_utilization),
        scheduler=SchedulerConfig(
            max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
            max_num_batched_tokens=args.max_num_batched_tokens,
        ),
    )  # fmt: skip
    opts = CudaRunnerOptions(compile_mode=args.compile)
    llm = LLM(engine_config=ec, model_module=model, model_config=cfg, runner_options=opts)
    eng, runner = llm.engine, llm.engine.runner
    print(f"{args.shape}: {eng.layout.num_blocks} KV blocks of {ec.cache.block_size} tokens, "
          f"graph buckets {runner.graphs.sizes}", flush=True)  # fmt: skip

    kinds: list[str] = []
    launch = runner.launch

    def traced_launch(sched: SchedulerOutput):
        kinds.append(step_kind(sched))
        return launch(sched)

    runner.launch = traced_launch
    greedy = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    llm.generate(random_prompts(8, args.input_len, 8), SamplingParams(max_tokens=4))  # warm-up
    results = []
    for rnd in range(args.rounds):
        kinds.clear()
        runner.step_events.clear()
        runner.record_step_events = True
        stats0 = eng.stats()
        t0 = time.perf_counter()
        outs = llm.generate(random_prompts(args.num, args.input_len, 7 + rnd), greedy)
        wall = time.perf_counter() - t0
        torch.cuda.synchronize()
        runner.record_step_events = False
        n_out = sum(len(o.token_ids) for o in outs)
        stats = eng.stats()
        gpu = [a.elapsed_time(b) / 1e3 for a, b, _ in runner.step_events]
        by: dict[str, list[float]] = collections.defaultdict(list)
        for kind, t in zip(kinds, gpu, strict=True):
            by[kind].append(t)
        busy = sum(gpu)
        row = {
            "out_tok_s": n_out / wall, "wall_s": wall, "gpu_busy_s": busy, "steps": len(gpu),
            "preemptions": stats.num_preemptions - stats0.num_preemptions,
            "kinds": {k: {"steps": len(v), "gpu_s": sum(v)} for k, v in by.items()},
        }  # fmt: skip
        results.append(row)
        print(f"round {rnd}: {n_out} tokens in {wall:.2f} s = {n_out / wall:.0f} out tok/s; "
              f"{len(gpu)} steps, GPU busy {busy:.2f} s ({busy / wall:.0%} of wall), "
              f"preemptions {row['preemptions']}")  # fmt: skip
        for kind, v in sorted(by.items(), key=lambda kv: -sum(kv[1])):
            print(f"  {kind:>12}: {len(v):4d} steps, GPU {sum(v):6.3f} s, "
                  f"{sum(v) / len(v) * 1e3:7.2f} ms/step")  # fmt: skip
    for bs in [int(b) for b in args.profile_buckets.split(",") if b]:
        if bs in runner.graphs.graphs:  # replays the inputs the bucket's last step left
            print(f"decode graph, bucket {bs}:")
            profile_graph(runner.graphs.graphs[bs].graph, runner.stream, 5)
    c = runner.counters
    print(f"counters: graph {c.graph_steps}, eager {c.eager_steps}, fallbacks {dict(c.fallbacks)}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rounds": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

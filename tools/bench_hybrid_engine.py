#!/usr/bin/env python3
"""Batch-1 decode of the hybrid MoE through the engine (runtime.llm.LLM: scheduler, runner,
sampler, detokenizer; no HTTP), with the GPU's time per step split into the step itself and
the gap before the next one (CUDA events around every step). Sits between the model runner
(tools/bench_hybrid_moe.py, no engine) and `tandem serve` (tools/device/gpu-serving.sh SHAPE=30B-A3B)
to say which layer costs the time one adds over the other.

The model: a Qwen3-30B-A3B config (tools/bench_hybrid_moe.py's, --layers of them) with random
weights, every routed expert on the CPU pool in --format. Decode rate = N / (time(prompt + N + 1
tokens) - time(prompt + 1 token)), greedy, ignore_eos.

    python tools/bench_hybrid_engine.py [--format int4] [--prompt 2048] [--new 128] [--json F]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tandem.models.hf_export import to_hf_config_dict  # noqa: E402
from tandem.runtime.config import CacheConfig, EngineConfig, ModelSpec, SchedulerConfig  # noqa: E402
from tandem.runtime.llm import LLM  # noqa: E402
from tandem.runtime.sampling_params import SamplingParams  # noqa: E402
from tools.bench_hybrid_moe import model_config  # noqa: E402
from tools.bench_hybrid_moe import parse_args as model_args  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--format", default="int4", choices=["bf16", "int8", "int4"])
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--prompt", type=int, default=2048)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--device", default="cuda")
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args(argv)
    cfg = model_config(model_args(["--layers", str(a.layers)]))
    tmp = Path(tempfile.mkdtemp(prefix="hybrid-engine-"))
    (tmp / "config.json").write_text(json.dumps(to_hf_config_dict(cfg)))
    t0 = time.perf_counter()
    ec = EngineConfig(
        model=ModelSpec(
            model=str(tmp),
            load_format="dummy",
            device=a.device,
            dtype="bfloat16",
            cpu_experts="all",
            cpu_expert_format=a.format,
        ),  # fmt: skip
        cache=CacheConfig(block_size=16, num_blocks=-(-(a.prompt + a.new + 16) // 16) * 2 + 8),
        scheduler=SchedulerConfig(
            max_num_seqs=4,
            max_model_len=a.prompt + a.new + 16,
            max_num_batched_tokens=max(2048, a.prompt),
        ),  # fmt: skip
    )
    llm = LLM(engine_config=ec)
    load_s = time.perf_counter() - t0
    gen = torch.Generator().manual_seed(11)

    def run(n: int) -> float:
        ids = torch.randint(300, cfg.vocab_size, (a.prompt,), generator=gen).tolist()
        t = time.perf_counter()
        out = llm.generate([ids], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == n
        return time.perf_counter() - t

    run(4)  # warm-up: prefill shapes, graphs
    t1 = min(run(1) for _ in range(2))
    runner = getattr(llm.engine, "runner", None)
    events = runner is not None and hasattr(runner, "step_events")
    if events:
        runner.step_events.clear()
        runner.record_step_events = True
    tn = run(a.new + 1)
    rate = a.new / (tn - t1)
    res = {"load_s": load_s, "decode_b1_tok_s": rate, "ms_per_token": 1e3 / rate}
    if events:
        runner.record_step_events = False
        torch.cuda.synchronize()
        ev = runner.step_events
        busy, gaps = [], []
        for (_, prev_end, _), (start, end, graph) in zip(ev, ev[1:], strict=False):
            if graph:
                gaps.append(prev_end.elapsed_time(start))
                busy.append(start.elapsed_time(end))
        if busy:
            busy.sort()
            gaps.sort()
            res |= {
                "graph_steps": len(busy),
                "step_ms_p50": busy[len(busy) // 2],
                "gap_ms_p50": gaps[len(gaps) // 2],
                "gap_ms_mean": sum(gaps) / len(gaps),
            }
    print(f"# hybrid engine ({a.format}, {a.layers} layers, {a.prompt}-token prompt): "
          + json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in res.items()}),
          flush=True)  # fmt: skip
    if a.json:
        a.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(a).items()}, **res}))
    llm.engine.model.expert_backend.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

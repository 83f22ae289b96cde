#!/usr/bin/env python3
"""GPU benchmark: Tandem on CUDA vs HF transformers in the same process, random bf16 weights of
real shapes ("1B" = Llama-3.2-1B, "8B" = Llama-3-8B; no checkpoint travels).

    python tools/bench_gpu.py [--shapes 1B,8B] [--hf-shapes 1B] [--json out.json]

Workloads (as in issue 4):
  batch-1 decode: 128-token prompt, 256 new tokens, greedy. Decode rate = 256 /
      (time(prompt + 257 tokens) - time(prompt + 1 token)), prefill excluded alike for every
      engine; printed next to the floor = measured device copy bandwidth / weight bytes read
      per step (every weight but the embedding table), and the fraction achieved.
  throughput: 256 requests x (256 prompt, 256 new tokens) submitted at once; output tok/s.
HF peers: static cache + torch.compile (auto-compile of `generate`) and the dynamic cache at
batch 1; continuous batching `generate_batch` for the throughput workload (padded `generate`
where that API is missing, and it says so). Sections past `--deadline-s` are skipped, loudly.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import sys
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tandem.models.config import ModelConfig  # noqa: E402
from tandem.models.hf_export import to_hf_config_dict  # noqa: E402
from tandem.models.loader import apply_fast_linears, build_model  # noqa: E402
from tandem.models.loader.dummy import init_dummy_weights  # noqa: E402
from tandem.runtime.config import CacheConfig, EngineConfig, ModelSpec, SchedulerConfig  # noqa: E402
from tandem.runtime.cuda_runner import CudaRunnerOptions  # noqa: E402
from tandem.runtime.llm import LLM  # noqa: E402
from tandem.runtime.sampling_params import SamplingParams  # noqa: E402

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
SHAPES = {
    "1B": dict(hidden_size=2048, num_hidden_layers=16, intermediate_size=8192, head_dim=64,
               tie_word_embeddings=True, rope_scaling={**LLAMA3_ROPE, "factor": 32.0},
               max_position_embeddings=131072),
    "8B": dict(hidden_size=4096, num_hidden_layers=32, intermediate_size=14336, head_dim=128,
               tie_word_embeddings=False, rope_scaling=None, max_position_embeddings=8192),
}  # fmt: skip
PROMPT, NEW = 128, 256
TP_REQS, TP_IN, TP_OUT = 256, 256, 256

T0 = time.monotonic()
RESULTS: dict = {}


def shape_config(name: str) -> ModelConfig:
    s = SHAPES[name]
    return ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=128256, num_attention_heads=32,
        num_key_value_heads=8, rms_norm_eps=1e-5, rope_theta=500000.0, **s,
    )  # fmt: skip


def say(*a) -> None:
    print(f"[{time.monotonic() - T0:6.1f}s]", *a, flush=True)


def save(path: str | None) -> None:
    if path:
        Path(path).write_text(json.dumps(RESULTS, indent=2, default=str))


def random_prompts(n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1000, 120000, (n, length), generator=g).tolist()


def copy_bandwidth_gbps(num_bytes: int = 2 << 30) -> float:
    """Device-to-device copy, bytes read + written, median of 20 (events)."""
    src = torch.empty(num_bytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(20):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    times.sort()
    del src, dst
    torch.cuda.empty_cache()
    return 2 * num_bytes / times[len(times) // 2] / 1e9


def weight_bytes(model: torch.nn.Module, cfg: ModelConfig) -> tuple[int, int]:
    """(all weight bytes, bytes read per decode step: all but the embedding table, unless tied)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = cfg.vocab_size * cfg.hidden_size * 2
    return total, total if cfg.tie_word_embeddings else total - embed


def timed(fn) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t


# ------------------------------------------------------------------------------------ Tandem


def profile_graph(graph, stream, reps: int) -> list[dict]:
    """Per-kernel GPU time of `reps` replays of a captured graph (torch.profiler, CUPTI):
    where one decode step's time goes. Printed as a table; returned for the JSON."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        with torch.cuda.stream(stream):
            for _ in range(reps):
                graph.replay()
        torch.cuda.synchronize()
    rows = []
    for ev in prof.key_averages():
        t = getattr(ev, "self_device_time_total", None) or getattr(ev, "self_cuda_time_total", 0)
        if t > 0:
            rows.append({"name": ev.key[:90], "count": ev.count // reps, "us": t / reps})
    rows.sort(key=lambda r: -r["us"])
    total = sum(r["us"] for r in rows)
    say(f"  per-kernel GPU time of one step ({reps} replays), total {total:.0f} us:")
    for r in rows[:40]:
        say(f"  {r['us']:8.1f} us  {r['us'] / total:5.1%}  x{r['count']:<4} {r['name']}")
    return rows


def bench_tandem(name: str, bw: float, args, compile_mode: str | None) -> dict:
    cfg = shape_config(name)
    res: dict = {}
    t = time.perf_counter()
    model = build_model(cfg, dtype=torch.bfloat16, device="cuda", attn_backend="cupy")
    init_dummy_weights(model, seed=0)
    apply_fast_linears(model, "cuda", torch.bfloat16)  # as load_model does
    res["skinny_linears"] = sum(type(m).__name__ == "SkinnyLinear" for m in model.modules())
    total, read = weight_bytes(model, cfg)
    res["weight_gb"], res["read_gb"] = total / 1e9, read / 1e9
    opts = CudaRunnerOptions(compile_mode=compile_mode, nvtx=False)
    ec = EngineConfig(
        model=ModelSpec(model=f"llama-{name}-dummy", device="cuda", dtype="bfloat16"),
        cache=CacheConfig(block_size=16, gpu_memory_utilization=args.gpu_memory_utilization),
        scheduler=SchedulerConfig(
            max_num_seqs=256, max_model_len=args.max_model_len, max_num_batched_tokens=8192
        ),
    )
    llm = LLM(engine_config=ec, model_module=model, model_config=cfg, runner_options=opts)
    eng = llm.engine
    res["init_s"] = time.perf_counter() - t
    res["kv_blocks"] = eng.layout.num_blocks
    name = name + (f"+compile({compile_mode})" if compile_mode else "")
    say(f"tandem {name}: weights {total / 1e9:.2f} GB (read/step {read / 1e9:.2f} GB), "
        f"{eng.layout.num_blocks} KV blocks, ready in {res['init_s']:.1f}s")  # fmt: skip

    greedy = dict(temperature=0.0, ignore_eos=True)
    seeds = iter(range(100, 1000))

    def run(n_new: int) -> None:
        out = llm.generate(
            random_prompts(1, PROMPT, next(seeds)), SamplingParams(max_tokens=n_new, **greedy)
        )
        assert len(out[0].token_ids) == n_new

    def set_overlap(on: bool) -> None:  # only while idle: the scheduler holds no step
        assert not eng.has_unfinished_requests()
        eng.overlap = eng.scheduler.async_mode = on

    run(8)  # warm-up: prefill shapes, cupy kernels
    for mode in args.overlap_modes:
        set_overlap(mode == "on")
        run(8)
        t1 = min(timed(lambda: run(1)) for _ in range(2))
        tn = min(timed(lambda: run(NEW + 1)) for _ in range(2))
        rate = NEW / (tn - t1)
        floor = bw * 1e9 / read
        r = res.setdefault(mode, {})
        r["b1_tok_s"], r["b1_floor_tok_s"], r["b1_fraction"] = rate, floor, rate / floor
        r["b1_step_ms"] = 1e3 / rate
        say(f"tandem {name} overlap {mode} batch-1 decode: {rate:.1f} tok/s ({1e3 / rate:.2f} "
            f"ms/token), floor {floor:.1f} tok/s -> {rate / floor:.1%} of floor")  # fmt: skip
    g = eng.runner._graphs.get(1)
    if g is not None:  # GPU time of one batch-1 decode step alone: the rest is host overhead
        with torch.cuda.stream(eng.runner.stream):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(50):
                g.graph.replay()
            b.record()
        b.synchronize()
        res["b1_graph_ms"] = a.elapsed_time(b) / 50
        say(f"tandem {name} batch-1 graph replay alone: {res['b1_graph_ms']:.2f} ms/step "
            f"({1e3 / res['b1_graph_ms']:.0f} steps/s), skinny linears {res['skinny_linears']}")  # fmt: skip
        if args.profile:
            res["b1_kernels"] = profile_graph(g.graph, eng.runner.stream, args.profile)
    if "b64" not in args.sections and "tp" not in args.sections:
        llm = eng = model = g = None
        torch._dynamo.reset()
        gc.collect()
        torch.cuda.empty_cache()
        return res

    for mode in args.overlap_modes if "b64" in args.sections else ():
        # GPU idle per decode step at batch 64 (CUDA events)
        set_overlap(mode == "on")
        runner = eng.runner
        runner.step_events.clear()
        runner.record_step_events = True
        llm.generate(random_prompts(64, PROMPT, 5), SamplingParams(max_tokens=128, **greedy))
        runner.record_step_events = False
        torch.cuda.synchronize()
        ev = runner.step_events
        gaps, busy = [], []
        for (_, prev_end, _), (start, end, is_graph) in zip(ev, ev[1:], strict=False):
            if is_graph:
                gaps.append(prev_end.elapsed_time(start))
                busy.append(start.elapsed_time(end))
        runner.step_events.clear()
        runner = ev = None  # the engine must be freeable for the next shape
        gaps.sort()
        idle = sum(gaps) / (sum(gaps) + sum(busy))
        r = res.setdefault(mode, {})
        r["b64_idle_fraction"], r["b64_step_ms"] = idle, (sum(gaps) + sum(busy)) / len(gaps)
        r["b64_gap_ms_p50"], r["b64_gap_ms_max"] = gaps[len(gaps) // 2], gaps[-1]
        say(
            f"tandem {name} overlap {mode} batch-64 decode: GPU idle {idle:.1%} of each step "
            f"({len(gaps)} graph steps, {r['b64_step_ms']:.2f} ms/step, gap p50 "
            f"{r['b64_gap_ms_p50'] * 1e3:.0f} us, max {r['b64_gap_ms_max'] * 1e3:.0f} us)"
        )

    params = SamplingParams(max_tokens=TP_OUT, **greedy)
    llm.generate(random_prompts(8, TP_IN, 8), SamplingParams(max_tokens=4, **greedy))  # warm-up
    for i, mode in enumerate(args.overlap_modes if "tp" in args.sections else ()):
        # New prompts each mode: a second run of the same ones would find every full block
        # of every prompt in the prefix cache and skip most of the prefill.
        prompts = random_prompts(TP_REQS, TP_IN, 7 + 1000 * i)
        set_overlap(mode == "on")
        steps0, hits0 = eng.stats().num_steps, eng.stats().prefix_cache_hits
        t = time.perf_counter()
        outs = llm.generate(prompts, params)
        el = time.perf_counter() - t
        n_out = sum(len(o.token_ids) for o in outs)
        assert n_out == TP_REQS * TP_OUT, n_out
        r = res.setdefault(mode, {})
        r["tp_tok_s"], r["tp_s"] = n_out / el, el
        r["tp_steps"] = eng.stats().num_steps - steps0
        r["tp_prefix_hit_tokens"] = eng.stats().prefix_cache_hits - hits0
        assert r["tp_prefix_hit_tokens"] == 0, "the throughput prompts hit the prefix cache"
        say(f"tandem {name} overlap {mode} {TP_REQS}x({TP_IN} in, {TP_OUT} out): "
            f"{n_out / el:.0f} output tok/s ({el:.2f}s, {r['tp_steps']} steps)")  # fmt: skip
    c = eng.runner.counters
    res["counters"] = {"graph_steps": c.graph_steps, "eager_steps": c.eager_steps,
                       "fallbacks": dict(c.fallbacks)}  # fmt: skip
    say(f"tandem {name} counters {res['counters']}")
    llm = eng = model = g = None  # free the device for the next engine
    torch._dynamo.reset()  # compiled code holds the model
    gc.collect()
    torch.cuda.empty_cache()
    return res


# ---------------------------------------------------------------------------------------- HF


def hf_model(name: str):
    import transformers as hf

    d = to_hf_config_dict(shape_config(name))
    d.pop("rope_scaling", None)
    if shape_config(name).rope_scaling:
        d["rope_parameters"] = {"rope_theta": 500000.0, **shape_config(name).rope_scaling}
    else:
        d["rope_parameters"] = {"rope_type": "default", "rope_theta": 500000.0}
    cfg = hf.LlamaConfig(**{k: v for k, v in d.items() if k not in ("architectures", "model_type")})
    cfg.eos_token_id = None
    cfg.pad_token_id = 0
    cfg._attn_implementation = "sdpa"
    with torch.device("cuda"):
        model = hf.LlamaForCausalLM(cfg)  # random normal(0, 0.02) init, on the device
    model = model.to(torch.bfloat16).eval().requires_grad_(False)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def hf_batch1(model, static: bool) -> float:
    seeds = iter(range(2000, 3000))
    kw = dict(do_sample=False, pad_token_id=0)
    if static:
        kw["cache_implementation"] = "static"
    else:
        kw["disable_compile"] = True

    def run(n_new: int) -> None:
        ids = torch.tensor(random_prompts(1, PROMPT, next(seeds)), device="cuda")
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n_new,
                             min_new_tokens=n_new, **kw)  # fmt: skip
        assert out.shape[1] == PROMPT + n_new, out.shape

    run(NEW + 1)  # warm-up (static: compiles and captures for this cache length)
    t1 = min(timed(lambda: run(1)) for _ in range(2))
    tn = timed(lambda: run(NEW + 1))
    return NEW / (tn - t1)


def hf_throughput(model) -> tuple[float, str]:
    from transformers import GenerationConfig

    prompts = random_prompts(TP_REQS, TP_IN, 7)
    gc_ = GenerationConfig(
        max_new_tokens=TP_OUT, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    if hasattr(model, "generate_batch"):
        model.generate_batch(random_prompts(4, TP_IN, 8), generation_config=GenerationConfig(
            max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=0))  # fmt: skip
        t = time.perf_counter()
        outs = model.generate_batch(prompts, generation_config=gc_)
        el = time.perf_counter() - t
        n = sum(len(o.generated_tokens) for o in outs.values())
        return n / el, f"generate_batch ({n} tokens)"
    ids = torch.tensor(prompts, device="cuda")
    t = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=TP_OUT,
                         min_new_tokens=TP_OUT, do_sample=False, pad_token_id=0)  # fmt: skip
    el = time.perf_counter() - t
    return (out.shape[1] - TP_IN) * TP_REQS / el, "padded generate (no generate_batch)"


def bench_hf(name: str, args) -> dict:
    res: dict = {}
    model = hf_model(name)
    for short, key, fn in (
        ("tp", "hf_tp_tok_s", lambda: hf_throughput(model)),
        ("static_compile", "hf_static_compile_b1_tok_s", lambda: (hf_batch1(model, True), "")),
        ("dynamic", "hf_dynamic_b1_tok_s", lambda: (hf_batch1(model, False), "")),
    ):
        if short in args.skip_hf:
            continue
        if time.monotonic() - T0 > args.deadline_s:
            say(f"HF {name} {key}: SKIPPED (past the {args.deadline_s}s deadline)")
            continue
        try:
            t = time.perf_counter()
            val, note = fn()
            res[key] = val
            if note:
                res[key + "_how"] = note
            say(f"HF {name} {key}: {val:.1f} tok/s {note} (section {time.perf_counter() - t:.0f}s)")
        except Exception as e:
            res[key + "_error"] = f"{type(e).__name__}: {e}"
            say(f"HF {name} {key}: FAILED {type(e).__name__}: {e}")
            traceback.print_exc()
        torch._dynamo.reset()
        gc.collect()
        torch.cuda.empty_cache()
    model = None
    gc.collect()
    torch.cuda.empty_cache()
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="1B,8B")
    ap.add_argument("--hf-shapes", default="1B")
    ap.add_argument("--skip-hf", default="", help="comma list of: tp, static_compile, dynamic")
    ap.add_argument(
        "--compile-modes",
        default="none,default",
        help="comma list of torch.compile modes for Tandem's decode graphs; none: eager",
    )
    ap.add_argument(
        "--overlap-modes",
        default="off,on",
        help="comma list of off/on: overlap scheduling, each on the same engine",
    )
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--deadline-s", type=float, default=330.0)
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "--sections",
        default="b1,b64,tp",
        type=lambda v: set(v.split(",")),
        help="Tandem sections: b1 (batch-1 decode), b64 (GPU idle at batch 64), tp (256x256)",
    )
    ap.add_argument(
        "--profile", type=int, default=0, help="per-kernel table of N batch-1 graph replays"
    )
    args = ap.parse_args()
    args.skip_hf = [s for s in args.skip_hf.split(",") if s]
    args.overlap_modes = [m for m in args.overlap_modes.split(",") if m]
    import transformers

    props = torch.cuda.get_device_properties(0)
    RESULTS["meta"] = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": props.name, "sms": props.multi_processor_count,
        "torch": torch.__version__, "transformers": transformers.__version__,
        "python": platform.python_version(), "compile_modes": args.compile_modes,
        "max_model_len": args.max_model_len, "argv": sys.argv[1:],
    }  # fmt: skip
    say("meta", RESULTS["meta"])
    bw = copy_bandwidth_gbps()
    RESULTS["copy_bw_gbps"] = bw
    say(f"device copy bandwidth (read + write): {bw:.0f} GB/s")
    modes = [None if m == "none" else m for m in args.compile_modes.split(",")]
    hf_shapes = [s for s in args.hf_shapes.split(",") if s]
    for name in [s for s in args.shapes.split(",") if s]:  # each shape's peers right after it
        for mode in modes:
            key = f"tandem_{name}" + (f"_{mode}" if mode else "")
            if time.monotonic() - T0 > args.deadline_s:
                say(f"{key}: SKIPPED (past the {args.deadline_s}s deadline)")
                continue
            try:
                RESULTS[key] = bench_tandem(name, bw, args, mode)
            except Exception as e:
                RESULTS[key] = {"error": f"{type(e).__name__}: {e}"}
                say(f"{key}: FAILED {type(e).__name__}: {e}")
                traceback.print_exc()
            save(args.json)
        if name in hf_shapes:
            RESULTS[f"hf_{name}"] = bench_hf(name, args)
            save(args.json)

    print("\n== summary (same device call) ==")
    print(f"copy bandwidth {bw:.0f} GB/s; {RESULTS['meta']['device']}")
    for key in [k for k in RESULTS if k.startswith("tandem_")]:
        name = key.removeprefix("tandem_")
        h = RESULTS.get(f"hf_{name.split('_')[0]}", {})
        for mode in args.overlap_modes:
            t = RESULTS[key].get(mode, {})
            tag = f"{name} overlap {mode}"
            if "b1_tok_s" in t:
                line = (f"{tag} batch-1: tandem {t['b1_tok_s']:.1f} tok/s, floor "
                        f"{t['b1_floor_tok_s']:.1f} ({t['b1_fraction']:.1%})")  # fmt: skip
                for k, label in (("hf_static_compile_b1_tok_s", "HF static+compile"),
                                 ("hf_dynamic_b1_tok_s", "HF dynamic")):  # fmt: skip
                    if k in h:
                        line += f"; {label} {h[k]:.1f} (x{t['b1_tok_s'] / h[k]:.2f})"
                print(line)
            if "b64_idle_fraction" in t:
                print(f"{tag} batch-64 decode: GPU idle {t['b64_idle_fraction']:.1%} per step "
                      f"({t['b64_step_ms']:.2f} ms/step)")  # fmt: skip
            if "tp_tok_s" in t:
                line = f"{tag} {TP_REQS}x({TP_IN},{TP_OUT}): tandem {t['tp_tok_s']:.0f} out tok/s"
                if "hf_tp_tok_s" in h:
                    line += (f"; HF {h.get('hf_tp_tok_s_how', '')} {h['hf_tp_tok_s']:.0f}"
                             f" (x{t['tp_tok_s'] / h['hf_tp_tok_s']:.1f})")  # fmt: skip
                print(line)
    save(args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())

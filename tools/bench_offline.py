#!/usr/bin/env python3
"""Offline decode benchmark: Tandem vs HF transformers (and llama.cpp when installed).

    python tools/bench_offline.py [--model M] [--new-tokens 128] [--concurrency 16]
    python tools/bench_offline.py --model ./upcycled --no-hf --dtypes bfloat16 \
        --cpu-experts all --cpu-expert-format int4      # a MoE with its experts on the pool
    python tools/bench_offline.py --dtypes bfloat16 --no-hf \
        --llama-bench /work/peer-build/llama.cpp-cpu/bin/llama-bench   # the CPU peer, same run

Prints batch-1 decode tokens/s and the aggregate at N concurrent sequences for Tandem and HF
transformers' `generate` on the same dequantized weights, per dtype (float32 and bfloat16 by
default), llama-cpp-python on the same GGUF file if it is importable, and llama.cpp's own
`llama-bench` with `--llama-bench PATH` (`tools/peers/llama_cpp.sh build-cpu`); next to the
memory-bandwidth floor (weight bytes / measured read bandwidth) measured in the run.
Decode rate = new tokens / (time(1 + new tokens) - time(1 token)), the same for every engine,
so prefill is excluded alike.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tandem.models.hf_export import to_hf_config_dict  # noqa: E402
from tandem.models.hub import resolve_model  # noqa: E402
from tandem.runtime import LLM, SamplingParams  # noqa: E402
from tandem.runtime.startup import resident_bytes  # noqa: E402
from tools.peers import cpu_bandwidth  # noqa: E402

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def read_bandwidth_gbps(num_bytes: int = 2 << 30) -> float:
    """Memory read bandwidth with torch's thread count: the rate decode streams weights at best
    (tools/peers/cpu_bandwidth.c: vector loads, first-touched by the readers)."""
    return cpu_bandwidth.read_bandwidth_gbps(torch.get_num_threads(), gigabytes=num_bytes / 1e9)


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def bench_tandem(llm: LLM, prompt_ids: list[int], new: int, conc: int) -> tuple[float, float]:
    def run(n_seqs: int, max_tokens: int) -> None:
        p = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        outs = llm.generate([prompt_ids] * n_seqs, p)
        assert all(len(o.token_ids) == max_tokens for o in outs)

    # Prefix caching would make the 16 identical prompts cheaper than HF's; vary the prompts.
    run(1, 4)  # warm-up
    b1 = new / (timed(lambda: run(1, new + 1)) - timed(lambda: run(1, 1)))
    prompts = [[(t + i) % 1000 + 10 for t in prompt_ids] for i in range(conc)]

    def run_many(max_tokens: int) -> None:
        p = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        llm.generate(prompts, p)

    agg = conc * new / (timed(lambda: run_many(new + 1)) - timed(lambda: run_many(1)))
    return b1, agg


def bench_tandem_prefill(llm: LLM, num_tokens: int = 128, reps: int = 3) -> float:
    """Prefill tokens/s of a `num_tokens` prompt (time of one generated token), best of `reps`;
    each prompt new to the prefix cache. llama-bench's `-p 128 -n 0` is the peer."""
    best = float("inf")
    p = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for r in range(reps):
        ids = [(7 * i + 31 * r) % 40000 + 100 for i in range(num_tokens)]
        best = min(best, timed(lambda ids=ids: llm.generate([ids], p)))
    return num_tokens / best


def bench_hf(
    path: Path, llm: LLM, prompt_ids: list[int], new: int, conc: int, dtype: torch.dtype
) -> tuple[float, float]:
    import transformers

    from tandem.models.loader.gguf import load_gguf_weights

    cfg = transformers.AutoConfig.for_model(**to_hf_config_dict(llm.engine.model_config))
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    sd = dict(load_gguf_weights(path, dtype))
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected and all("lm_head" in m for m in missing), (missing, unexpected)
    model.tie_weights()
    model.eval()

    def gen(ids: torch.Tensor, n: int) -> None:
        with torch.inference_mode():
            model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=0,
            )

    one = torch.tensor([prompt_ids])
    gen(one, 4)
    b1 = new / (timed(lambda: gen(one, new + 1)) - timed(lambda: gen(one, 1)))
    many = torch.tensor([[(t + i) % 1000 + 10 for t in prompt_ids] for i in range(conc)])
    agg = conc * new / (timed(lambda: gen(many, new + 1)) - timed(lambda: gen(many, 1)))
    return b1, agg


def bench_llama_cpp(path: Path, prompt_ids: list[int], new: int) -> float | None:
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    llm = Llama(model_path=str(path), n_ctx=1024, n_threads=os.cpu_count(), verbose=False)

    def gen(n: int) -> None:
        llm.reset()
        toks = 0
        for _ in llm.generate(prompt_ids, temp=0.0, reset=True):
            toks += 1
            if toks >= n:
                break

    gen(4)
    return new / (timed(lambda: gen(new + 1)) - timed(lambda: gen(1)))


def bench_llama_bench(exe: str, path: Path, new: int, threads: int) -> dict[str, float]:
    """llama.cpp's own `llama-bench` on the same file (`tools/peers/llama_cpp.sh build-cpu`):
    batch-1 decode of `new` tokens and a 128-token prefill, 3 repetitions each; tokens/s."""
    import subprocess

    res: dict[str, float] = {}
    for key, args in (
        ("decode", ["-p", "0", "-n", str(new)]),
        ("prefill", ["-p", "128", "-n", "0"]),
    ):
        cmd = [exe, "-m", str(path), "-t", str(threads), "-r", "3", "-o", "json", *args]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed: {proc.stderr[-2000:]}")
        res[key] = float(json.loads(proc.stdout)[0]["avg_ts"])
    return res


def rss_bytes() -> int:
    """Resident set size of this process (Linux; 0 elsewhere)."""
    return resident_bytes()[0]


def make_llm(args: argparse.Namespace, dtype_name: str, quantization: str = "auto") -> LLM:
    if args.cpu_experts is None:
        return LLM(args.model, dtype=dtype_name, device="cpu", quantization=quantization)
    from tandem.runtime.config import EngineConfig, ModelSpec

    spec = ModelSpec(
        model=args.model,
        dtype=dtype_name,
        device="cpu",
        cpu_experts=args.cpu_experts,
        cpu_expert_format=args.cpu_expert_format,
    )
    return LLM(engine_config=EngineConfig(model=spec))


def pool_bytes_per_token(llm: LLM) -> int:
    """Expert bytes one token reads from the CPU pool (top-k of each layer's E experts)."""
    backend = getattr(llm.engine.model, "expert_backend", None)
    pool = getattr(backend, "_pool", None)
    if pool is None:
        return 0
    mc = llm.engine.model_config
    total = sum(pool.info()["bytes_per_format"].values())
    return int(total * mc.num_experts_per_tok / mc.num_experts)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default=None)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument(
        "--quantizations",
        default="auto",
        help="comma list: auto (a GGUF's weights served packed) and/or none (dequantized)",
    )
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--json", default=None, help="write results to this file")
    ap.add_argument(
        "--llama-bench",
        default=None,
        help="path of llama.cpp's llama-bench: run it on the same file after Tandem",
    )
    ap.add_argument("--cpu-experts", default=None, help="MoE: experts on the CPU pool (all|N)")
    ap.add_argument("--cpu-expert-format", default="auto", choices=["auto", "bf16", "int8", "int4"])
    args = ap.parse_args()

    torch.manual_seed(0)
    path = resolve_model(args.model)
    bw = read_bandwidth_gbps()
    res: dict = {
        "model": str(path),
        "threads": torch.get_num_threads(),
        "read_gbps": bw,
        "new_tokens": args.new_tokens,
        "concurrency": args.concurrency,
        "runs": {},
    }
    print(f"model {path.name}  threads {res['threads']}  read bandwidth {bw:.1f} GB/s")
    print(
        f"{'engine':<26}{'batch-1 tok/s':>14}{f'{args.concurrency} concurrent':>16}"
        f"{'floor b1':>10}{'b1/floor':>10}"
    )
    from tandem.models.quant.linear import quantized_bytes

    for dtype_name, quant in [
        (d, q) for d in args.dtypes.split(",") for q in args.quantizations.split(",")
    ]:
        dtype = getattr(torch, dtype_name)
        rss0 = rss_bytes()
        t = time.perf_counter()
        llm = make_llm(args, dtype_name, quant)
        load_s = time.perf_counter() - t
        rss_load = rss_bytes() - rss0
        prompt_ids = llm.tokenizer.encode(PROMPT)
        weight_bytes = sum(p.numel() * p.element_size() for p in llm.engine.model.parameters())
        weight_bytes += pool_bytes_per_token(llm) + quantized_bytes(llm.engine.model)
        floor = bw * 1e9 / weight_bytes
        run = {"load_s": load_s, "weight_bytes": weight_bytes, "floor_tok_s": floor}
        run["rss_after_load"], run["rss_load_growth"] = rss_bytes(), rss_load
        run["rss_peak"], run["file_bytes"] = resident_bytes()[1], path.stat().st_size
        if quant != "auto":
            dtype_name = f"{dtype_name}-{quant}"
        run["tandem_b1"], run["tandem_agg"] = bench_tandem(
            llm, prompt_ids, args.new_tokens, args.concurrency
        )
        run["tandem_prefill_128"] = bench_tandem_prefill(llm)
        print(
            f"{'tandem ' + dtype_name:<26}{run['tandem_b1']:>14.1f}{run['tandem_agg']:>16.1f}"
            f"{floor:>10.1f}{run['tandem_b1'] / floor:>10.2f}"
            f"   prefill 128: {run['tandem_prefill_128']:.1f} tok/s"
        )
        if not args.no_hf:
            run["hf_b1"], run["hf_agg"] = bench_hf(
                path, llm, prompt_ids, args.new_tokens, args.concurrency, dtype
            )
            print(
                f"{'hf transformers ' + dtype_name:<26}{run['hf_b1']:>14.1f}{run['hf_agg']:>16.1f}"
                f"{floor:>10.1f}{run['hf_b1'] / floor:>10.2f}"
            )
            print(
                f"  ratio tandem/hf {dtype_name}: batch-1 {run['tandem_b1'] / run['hf_b1']:.2f}x, "
                f"{args.concurrency} concurrent {run['tandem_agg'] / run['hf_agg']:.2f}x"
            )
        print(
            f"  tandem {dtype_name}: {args.concurrency}-concurrent / batch-1 = "
            f"{run['tandem_agg'] / run['tandem_b1']:.2f}x; load {load_s:.2f}s; weights "
            f"{weight_bytes / 1e6:.1f} MB; RSS after load {run['rss_after_load'] / 1e6:.0f} MB "
            f"(+{rss_load / 1e6:.0f} MB by the load = {rss_load / run['file_bytes']:.2f}x the "
            f"file's {run['file_bytes'] / 1e6:.1f} MB; peak {run['rss_peak'] / 1e6:.0f} MB)"
        )
        res["runs"][dtype_name] = run
        del llm
    lc = bench_llama_cpp(path, prompt_ids, args.new_tokens)
    res["llama_cpp_b1"] = lc
    if lc:
        q_floor = bw * 1e9 / path.stat().st_size
        print(
            f"{'llama.cpp (Q4_1 GGUF)':<26}{lc:>14.1f}{'-':>16}{q_floor:>10.1f}{lc / q_floor:>10.2f}"
        )
    if args.llama_bench:
        lb = bench_llama_bench(args.llama_bench, path, args.new_tokens, res["threads"])
        res["llama_bench"] = lb
        q_floor = bw * 1e9 / path.stat().st_size
        print(
            f"{'llama-bench (same file)':<26}{lb['decode']:>14.1f}{'-':>16}{q_floor:>10.1f}"
            f"{lb['decode'] / q_floor:>10.2f}   prefill 128: {lb['prefill']:.1f} tok/s"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()

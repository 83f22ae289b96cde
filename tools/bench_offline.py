#!/usr/bin/env python3
"""Offline decode benchmark: Tandem vs HF transformers (and llama.cpp when installed).

    python tools/bench_offline.py [--model M] [--new-tokens 128] [--concurrency 16]

Prints batch-1 decode tokens/s and the aggregate at N concurrent sequences for Tandem, HF
transformers' float32 `generate` on the same dequantized weights, and llama-cpp-python on the
same GGUF file if it is importable; next to the memory-bandwidth floor measured in the run.
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

from models.hf_export import to_hf_config_dict  # noqa: E402
from models.hub import resolve_model  # noqa: E402
from runtime import LLM, SamplingParams  # noqa: E402

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def copy_bandwidth_gbps(num_bytes: int = 512 << 20) -> float:
    src = torch.empty(num_bytes // 4, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return 2 * num_bytes / best / 1e9  # read + write


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


def bench_hf(path: Path, llm: LLM, prompt_ids: list[int], new: int, conc: int) -> tuple[float, float]:
    import transformers

    from models.loader.gguf import load_gguf_weights

    cfg = transformers.AutoConfig.for_model(**to_hf_config_dict(llm.engine.model_config))
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    sd = dict(load_gguf_weights(path, torch.float32))
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected and all("lm_head" in m for m in missing), (missing, unexpected)
    model.tie_weights()
    model.eval()

    def gen(ids: torch.Tensor, n: int) -> None:
        with torch.inference_mode():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                           min_new_tokens=n, do_sample=False, pad_token_id=0)

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--json", default=None, help="write results to this file")
    args = ap.parse_args()

    torch.manual_seed(0)
    path = resolve_model(args.model)
    t = time.perf_counter()
    llm = LLM(args.model, dtype="float32", device="cpu")
    load_s = time.perf_counter() - t
    prompt_ids = llm.tokenizer.encode(PROMPT)
    mc = llm.engine.model_config
    weight_bytes = sum(p.numel() * p.element_size() for p in llm.engine.model.parameters())
    bw = copy_bandwidth_gbps()
    floor = bw * 1e9 / weight_bytes
    res: dict = {"model": str(path), "threads": torch.get_num_threads(), "load_s": load_s,
                 "weight_bytes": weight_bytes, "copy_gbps": bw, "floor_tok_s": floor,
                 "prompt_tokens": len(prompt_ids), "new_tokens": args.new_tokens,
                 "concurrency": args.concurrency, "arch": mc.architecture}
    res["tandem_b1"], res["tandem_agg"] = bench_tandem(llm, prompt_ids, args.new_tokens, args.concurrency)
    if not args.no_hf:
        res["hf_b1"], res["hf_agg"] = bench_hf(path, llm, prompt_ids, args.new_tokens, args.concurrency)
    res["llama_cpp_b1"] = bench_llama_cpp(path, prompt_ids, args.new_tokens)

    print(f"model {path.name}  threads {res['threads']}  load {load_s:.2f}s  "
          f"weights {weight_bytes / 1e6:.0f} MB fp32")
    print(f"floor: {bw:.1f} GB/s copy bandwidth / weight bytes = {floor:.1f} tok/s at batch 1")
    print(f"{'engine':<22}{'batch-1 tok/s':>15}{f'{args.concurrency} concurrent tok/s':>24}")
    print(f"{'tandem (fp32)':<22}{res['tandem_b1']:>15.1f}{res['tandem_agg']:>24.1f}")
    if "hf_b1" in res:
        print(f"{'hf transformers fp32':<22}{res['hf_b1']:>15.1f}{res['hf_agg']:>24.1f}")
        print(f"ratio tandem/hf: batch-1 {res['tandem_b1'] / res['hf_b1']:.2f}x, "
              f"{args.concurrency} concurrent {res['tandem_agg'] / res['hf_agg']:.2f}x")
    if res["llama_cpp_b1"]:
        print(f"{'llama.cpp (Q4_1)':<22}{res['llama_cpp_b1']:>15.1f}{'-':>24}")
    print(f"tandem {args.concurrency}-concurrent / batch-1: {res['tandem_agg'] / res['tandem_b1']:.2f}x; "
          f"batch-1 at {100 * res['tandem_b1'] / floor:.0f}% of floor")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()

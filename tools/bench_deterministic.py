#!/usr/bin/env python3
"""Cost of `--deterministic`: decode tokens/s at batch 1 and 64, with and without, same process.

    python tools/bench_deterministic.py [--shape 1B|8B] [--new-tokens 64] [--json out.json]

Random bf16 weights of a Llama shape (load_format dummy). Decode rate = batch * new tokens /
(time(1 + new tokens) - time(1 token)), so prefill is excluded. Also checks what the mode is
for: 8 prompts' greedy tokens alone vs inside the batch of 64 (equal in deterministic mode;
reported, not asserted, without it).
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tandem.models.config import ModelConfig  # noqa: E402
from tandem.models.hf_export import to_hf_config_dict  # noqa: E402
from tandem.runtime import LLM, SamplingParams  # noqa: E402

SHAPES = {
    "1B": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8, head_dim=64),
    "8B": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=8, head_dim=128),
}  # fmt: skip


def _model_dir(shape: str) -> str:
    path = Path(tempfile.mkdtemp(prefix=f"det_{shape}_"))
    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=128256,
                      max_position_embeddings=4096, **SHAPES[shape])  # fmt: skip
    (path / "config.json").write_text(json.dumps(to_hf_config_dict(cfg)))
    return str(path)


def _greedy(llm: LLM, prompts: list[list[int]], new: int) -> list[list[int]]:
    p = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    return [list(o.token_ids) for o in llm.generate(prompts, p)]


def _decode_rate(llm: LLM, prompts: list[list[int]], new: int) -> float:
    _greedy(llm, prompts, 2)  # warm
    t0 = time.perf_counter()
    _greedy(llm, prompts, 1)
    t1 = time.perf_counter()
    _greedy(llm, prompts, 1 + new)
    t2 = time.perf_counter()
    return len(prompts) * new / ((t2 - t1) - (t1 - t0))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="1B", choices=sorted(SHAPES))
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    model = _model_dir(a.shape)
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 128000) for _ in range(rng.randint(16, 48))] for _ in range(64)]
    results = {}
    for det in (False, True):
        llm = LLM(model, load_format="dummy", device="cuda", deterministic=det,
                  num_kv_blocks=2048, max_num_seqs=64, max_model_len=1024)  # fmt: skip
        r = {
            "b1_tok_s": _decode_rate(llm, prompts[:1], a.new_tokens),
            "b64_tok_s": _decode_rate(llm, prompts, a.new_tokens),
        }
        batched = _greedy(llm, prompts, 16)
        alone = [_greedy(llm, [p], 16)[0] for p in prompts[:8]]
        r["alone_equals_batched"] = sum(x == y for x, y in zip(alone, batched[:8], strict=True))
        results["deterministic" if det else "default"] = r
        print(("deterministic" if det else "default"), r, flush=True)
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    d, n = results["deterministic"], results["default"]
    print(f"{a.shape}: batch-1 {n['b1_tok_s']:.1f} -> {d['b1_tok_s']:.1f} tok/s "
          f"({d['b1_tok_s'] / n['b1_tok_s']:.2f}x); batch-64 {n['b64_tok_s']:.0f} -> "
          f"{d['b64_tok_s']:.0f} tok/s ({d['b64_tok_s'] / n['b64_tok_s']:.2f}x); "
          f"alone == batched: {n['alone_equals_batched']}/8 default, "
          f"{d['alone_equals_batched']}/8 deterministic")  # fmt: skip
    if a.json:
        Path(a.json).write_text(json.dumps({"shape": a.shape, **results}, indent=2))


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""CPU decode tokens/s at batch 1 and 8 on random bf16 weights of SmolLM2-135M's shape.

    taskset -c 0,1 python tools/bench_cpu_decode_shape.py [--new-tokens 32] [--threads 2]

Needs no checkpoint (load_format dummy), so it runs where the default model's file is not
(the GPU machine's CPU). Decode rate = batch * new / (time(1 + new) - time(1)), best of two.
Prints which attention backend and linear format ran.
"""

from __future__ import annotations

import argparse
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    d = Path(tempfile.mkdtemp(prefix="smollm2_shape_"))
    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=49152, hidden_size=576,
                      intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                      num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
                      tie_word_embeddings=True, rope_theta=100000.0)  # fmt: skip
    (d / "config.json").write_text(json.dumps(to_hf_config_dict(cfg)))
    llm = LLM(str(d), load_format="dummy", device="cpu", dtype="bfloat16", max_model_len=1024)
    rng = random.Random(0)
    prompts = [[rng.randrange(300, 49000) for _ in range(17)] for _ in range(8)]

    def run(ps: list[list[int]], n: int) -> float:
        p = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        t = time.perf_counter()
        llm.generate(ps, p)
        return time.perf_counter() - t

    out = {}
    for b in (1, 8):
        run(prompts[:b], 2)
        best = 0.0
        for _ in range(2):
            t1, tn = run(prompts[:b], 1), run(prompts[:b], 1 + a.new_tokens)
            best = max(best, b * a.new_tokens / (tn - t1))
        out[f"b{b}_tok_s"] = round(best, 1)
    layer = llm.engine.model.layers[0].self_attn
    print(json.dumps({**out, "attention": layer.backend.name, "qkv": layer.qkv_proj.extra_repr()}))


if __name__ == "__main__":
    main()

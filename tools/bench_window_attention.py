#!/usr/bin/env python3
"""Sliding-window + sink attention on CUDA: the cupy kernels against the torch reference (the
path windowed models took before) in the same process, random bf16 data.

    python tools/bench_window_attention.py [--layers 12] [--json out.json]

1. One layer's attention at gpt-oss-120b's shape (64 query heads, 8 KV heads, head_dim 64,
   window 128, sinks): decode at batch 1 and 32 over 8,192 tokens of context, and a 2,048-token
   prefill chunk after 6,144 cached; kernel windowed, kernel full (what a full layer costs),
   torch reference windowed. CUDA-graph replay for the decode kernels.
2. End to end: a GPT-OSS-shaped model (hidden 2880, the 120b's attention, `--layers` layers
   alternating windowed/full, 4 experts all active on the GPU), batch-1 greedy decode of 128
   tokens after a 1,024-token prompt: cupy attention with decode CUDA graphs against the torch
   attention backend (eager, the old automatic choice).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tandem.ext.attention_ref import paged_attention  # noqa: E402
from tandem.ext.cuda import paged_attention_cuda  # noqa: E402

H, KVH, D, WINDOW, BS = 64, 8, 64, 128, 16
DTYPE = torch.bfloat16


def time_ms(fn, iters: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def graphed(fn):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def bench_layer(batch: int, prefix: int, query: int) -> dict:
    ctx = prefix + query
    nb = -(-ctx // BS)
    k_cache = torch.randn(batch * nb + 1, BS, KVH, D, device="cuda", dtype=DTYPE)
    v_cache = torch.randn_like(k_cache)
    bt = (torch.randperm(batch * nb, device="cuda").int() + 1).view(batch, nb)
    q = torch.randn(batch * query, H, D, device="cuda", dtype=DTYPE)
    qsl = torch.arange(batch + 1, device="cuda", dtype=torch.int32) * query
    sl = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    sinks = torch.randn(H, device="cuda", dtype=DTYPE)
    scale = D**-0.5
    out = torch.empty_like(q)

    def kernel(window):
        return lambda: paged_attention_cuda(
            q, k_cache, v_cache, qsl, sl, bt, query, scale, out=out, max_seq_len=ctx,
            window=window, sinks=sinks,
        )  # fmt: skip

    def ref():
        return paged_attention(
            q, k_cache, v_cache, [query] * batch, [ctx] * batch, bt, scale, window=WINDOW,
            sinks=sinks,
        )  # fmt: skip

    kernel(WINDOW)()
    err = ((out.float() - ref().float()).norm() / ref().float().norm()).item()
    decode = query == 1
    win = graphed(kernel(WINDOW)) if decode else kernel(WINDOW)
    full = graphed(kernel(None)) if decode else kernel(None)
    return dict(
        batch=batch, prefix=prefix, query=query, err=err,
        windowed_us=time_ms(win, 200 if decode else 20) * 1e3,
        full_us=time_ms(full, 200 if decode else 20) * 1e3,
        torch_ref_us=time_ms(ref, 10 if decode else 3, warmup=1) * 1e3,
    )  # fmt: skip


def gpt_oss_config(layers: int):
    from tandem.models.config import ModelConfig

    return ModelConfig(
        architecture="GptOssForCausalLM", vocab_size=201088, hidden_size=2880,
        intermediate_size=2880, moe_intermediate_size=2880, num_hidden_layers=layers,
        num_attention_heads=H, num_key_value_heads=KVH, head_dim=D,
        max_position_embeddings=4096, sliding_window=WINDOW,
        sliding_layers=tuple(range(0, layers, 2)), attention_sinks=True, attention_bias=True,
        o_proj_bias=True, moe_bias=True, swiglu_limit=7.0, num_experts=4, num_experts_per_tok=4,
        rms_norm_eps=1e-5, rope_theta=150000.0,
    )  # fmt: skip


def set_attention_backend(model: torch.nn.Module, backend) -> None:
    for module in model.modules():
        if hasattr(module, "attn_backend"):
            module.attn_backend = backend
        if hasattr(module, "sinks") and hasattr(module, "backend"):  # attention layers
            module.backend = backend


def decode_rate(llm, prompt: list[int], sampling_params) -> float:
    """Batch-1 greedy decode tok/s: 128 tokens, the prompt's prefill subtracted."""

    def run(n: int) -> float:
        params = sampling_params(max_tokens=n, temperature=0.0, ignore_eos=True)
        t = time.perf_counter()
        llm.generate([prompt], params)
        return time.perf_counter() - t

    run(4)
    first, full = run(1), run(129)
    return 128 / (full - first)


def bench_model(layers: int) -> dict:
    from tandem.models.attention_backend import get_attention_backend
    from tandem.models.loader import apply_fast_linears, build_model
    from tandem.models.loader.dummy import init_dummy_weights
    from tandem.runtime.config import CacheConfig, EngineConfig, ModelSpec, SchedulerConfig
    from tandem.runtime.cuda_runner import CudaRunnerOptions
    from tandem.runtime.llm import LLM
    from tandem.runtime.sampling_params import SamplingParams

    config = gpt_oss_config(layers)
    model = build_model(
        config, dtype=DTYPE, device="cuda", attn_backend="cupy", expert_backend="gpu"
    )
    init_dummy_weights(model, seed=0)
    results = {}
    prompt = torch.randint(1, config.vocab_size, (1024,)).tolist()
    for name in ("torch", "cupy"):
        set_attention_backend(model, get_attention_backend(name))
        # the skinny linears in both runs; with cupy also the fused decode attention prologue
        apply_fast_linears(model, "cuda", DTYPE)
        ec = EngineConfig(
            model=ModelSpec(model="gpt-oss-shape", device="cuda", dtype="bfloat16"),
            cache=CacheConfig(block_size=BS, num_blocks=2048),
            scheduler=SchedulerConfig(max_num_seqs=8, max_model_len=4096),
        )
        llm = LLM(
            engine_config=ec, model_module=model, model_config=config,
            runner_options=CudaRunnerOptions(cuda_graphs=name == "cupy"),
        )  # fmt: skip
        results[name] = dict(
            decode_tok_s=decode_rate(llm, prompt, SamplingParams),
            graph_steps=llm.engine.runner.counters.graph_steps,
            fallbacks=dict(llm.engine.runner.counters.fallbacks),
        )
        del llm
        torch.cuda.empty_cache()
    return results


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    rows = [bench_layer(1, 8191, 1), bench_layer(32, 8191, 1), bench_layer(1, 6144, 2048)]
    print(f"{'batch':>5} {'prefix':>6} {'query':>5} {'windowed us':>12} {'full us':>9} "
          f"{'torch ref us':>12} {'err':>8}")  # fmt: skip
    for r in rows:
        print(
            f"{r['batch']:>5} {r['prefix']:>6} {r['query']:>5} {r['windowed_us']:>12.1f} "
            f"{r['full_us']:>9.1f} {r['torch_ref_us']:>12.1f} {r['err']:>8.1e}"
        )
    model = bench_model(args.layers)
    for name, r in model.items():
        print(f"model {name}: {r['decode_tok_s']:.1f} tok/s batch-1 decode "
              f"(graph steps {r['graph_steps']}, fallbacks {r['fallbacks']})")  # fmt: skip
    speedup = model["cupy"]["decode_tok_s"] / model["torch"]["decode_tok_s"]
    print(f"cupy / torch attention, end to end: {speedup:.2f}x")
    assert all(r["err"] < 2e-2 for r in rows), rows
    assert math.isfinite(speedup)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(layer=rows, model=model), indent=1))


if __name__ == "__main__":
    main()

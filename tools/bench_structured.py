#!/usr/bin/env python3
"""What a grammar-constrained request costs per decode step, at batch 1 and 64.

    python tools/bench_structured.py [--device cpu|cuda] [--tokenizer tokenizer.json]

A random-weight Llama (hidden 256, 4 layers; the vocabulary of the tokenizer: SmolLM2's 49152
when given its tokenizer.json, else a synthetic one) decodes B sequences for a fixed number
of steps in three mixes: all free (the peer), one constrained row plus B-1 free, all rows
constrained (JSON objects of a schema one after another, EOS banned: never complete). Prints
the engine step time of each (CUDA: the mean over the run; CPU: the median step) and,
separately, the host mask build (llguidance) and the masking on the device for k rows. On
CUDA the engine runs its overlap scheduler and decode graphs; a step with a constrained row
waits for the previous one (see docs).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tandem.models.config import ModelConfig  # noqa: E402
from tandem.models.loader import build_model  # noqa: E402
from tandem.models.loader.dummy import init_dummy_weights  # noqa: E402
from tandem.models.tokenizer import Tokenizer  # noqa: E402
from tandem.runtime.config import CacheConfig, EngineConfig, ModelSpec, SchedulerConfig  # noqa: E402
from tandem.runtime.engine import Engine  # noqa: E402
from tandem.runtime.grammar import apply_bitmask, fill_bitmask  # noqa: E402
from tandem.runtime.sampling_params import GrammarSpec, SamplingParams  # noqa: E402

# JSON objects of this schema, one after another without end: EOS is banned by logit_bias,
# so a constrained row decodes for the whole measurement.
ITEM = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "n": {"type": "integer"},
                   "tags": {"type": "array", "items": {"enum": ["x", "y", "z"]}}},
    "required": ["name", "n", "tags"],
    "additionalProperties": False,
}  # fmt: skip
GRAMMAR = "start: item+\nitem: %json " + json.dumps(ITEM)


def load_tokenizer(path: str | None, vocab: int) -> Tokenizer:
    if path is None:
        return Tokenizer.synthetic(vocab)
    from tokenizers import Tokenizer as RustTokenizer

    return Tokenizer(RustTokenizer.from_file(path), eos_token="<|im_end|>")


def make_engine(tok: Tokenizer, device: str, max_seqs: int) -> Engine:
    cfg = ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=tok.vocab_size, hidden_size=256,
        intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, max_position_embeddings=1024,
        eos_token_ids=tok.eos_token_ids,
    )  # fmt: skip
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    kw = {"attn_backend": "cupy"} if device == "cuda" else {}
    model = build_model(cfg, dtype=dtype, device=device, **kw)
    init_dummy_weights(model, seed=0, std=0.5)
    ec = EngineConfig(
        model=ModelSpec(model="bench", device=device, dtype=str(dtype).split(".")[-1]),
        cache=CacheConfig(block_size=16, num_blocks=max_seqs * 40 + 64),
        scheduler=SchedulerConfig(max_num_seqs=max_seqs, max_model_len=1024,
                                  max_num_batched_tokens=4096),
    )  # fmt: skip
    return Engine(ec, model_module=model, model_config=cfg, tokenizer=tok)


def step_ms(engine: Engine, batch: int, constrained: int, steps: int, warmup: int) -> float:
    spec = GrammarSpec("grammar", GRAMMAR)
    engine.grammar_compiler.compile(spec)
    total = warmup + steps + 4
    no_eos = tuple((t, -100.0) for t in engine.eos_token_ids)
    for i in range(batch):
        g, bias = (spec, no_eos) if i < constrained else (None, ())
        p = SamplingParams(max_tokens=total, temperature=1.0, seed=i, ignore_eos=True,
                           grammar=g, logit_bias=bias)  # fmt: skip
        engine.add_request(f"r{i}", [1, 2, 3, 4, 5, 6, 7, 8], p)
    for _ in range(warmup):
        engine.step()
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    if engine.device.type == "cuda":  # a sync per step would undo the overlap: the mean
        sync()
        t = time.perf_counter()
        for _ in range(steps):
            engine.step()
        sync()
        ms = (time.perf_counter() - t) / steps * 1e3
    else:  # the median per step: robust to a busy host's stalls
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t)
        ms = statistics.median(times) * 1e3
    running = engine.scheduler.num_running
    assert running == batch, f"{batch - running} rows ended early: the figure would be wrong"
    for i in range(batch):
        engine.abort_request(f"r{i}")
    while engine.has_unfinished_requests():
        engine.step()
    return ms


def mask_ms(engine: Engine, k: int, reps: int = 20) -> tuple[float, float]:
    """-> (host mask build for k rows, masking k rows of [64, V] logits), ms each."""
    compiled = engine.grammar_compiler.compile(GrammarSpec("grammar", GRAMMAR))
    matchers = [compiled.new_matcher() for _ in range(k)]
    prefix = engine.tokenizer.encode('{"name":"ab')
    for m in matchers:
        for t in prefix:
            m.accept(t)
        assert m.error is None, m.error
    words = matchers[0].mask_words
    host = torch.empty(k, words, dtype=torch.int32, pin_memory=engine.device.type == "cuda")
    t = time.perf_counter()
    for _ in range(reps):
        fill_bitmask(matchers, host)
    build = (time.perf_counter() - t) / reps * 1e3
    logits = torch.randn(64, engine.model_config.vocab_size, device=engine.device)
    rows = None if k == logits.shape[0] else torch.arange(k, device=engine.device)
    dev_mask = host.to(engine.device)
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    apply_bitmask(logits, rows, dev_mask)
    sync()
    t = time.perf_counter()
    for _ in range(reps):
        apply_bitmask(logits, rows, dev_mask)
    sync()
    return build, (time.perf_counter() - t) / reps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tokenizer", help="a tokenizer.json (default: synthetic, --vocab ids)")
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    tok = load_tokenizer(args.tokenizer, args.vocab)
    engine = make_engine(tok, args.device, 64)
    name = (
        torch.cuda.get_device_name() if args.device == "cuda" else f"cpu x{torch.get_num_threads()}"
    )
    print(f"device {name}; vocab {tok.vocab_size}; overlap {engine.overlap}")
    for batch in (int(b) for b in args.batches.split(",")):
        free = step_ms(engine, batch, 0, args.steps, args.warmup)
        one = step_ms(engine, batch, 1, args.steps, args.warmup)
        every = step_ms(engine, batch, batch, args.steps, args.warmup)
        build1, apply1 = mask_ms(engine, 1)
        build_b, apply_b = mask_ms(engine, batch)
        print(
            f"batch {batch:3d}: step ms free {free:.3f} | one constrained {one:.3f} "
            f"(+{one - free:.3f}) | all constrained {every:.3f} (+{every - free:.3f}) | "
            f"mask build 1 row {build1:.3f}, {batch} rows {build_b:.3f} | "
            f"mask apply 1 row {apply1:.3f}, {batch} rows {apply_b:.3f}"
        )
    counters = getattr(engine.runner, "counters", None)
    if counters is not None:
        print(f"graph steps {counters.graph_steps}, eager steps {counters.eager_steps}")


if __name__ == "__main__":
    main()

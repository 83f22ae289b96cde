#!/usr/bin/env python3
"""`tandem serve` against the offline engine on one workload, in one command.

    python tools/bench_serve_vs_offline.py                        # host-bound tiny model, CPU
    python tools/bench_serve_vs_offline.py --model DIR --device cuda --concurrency 64,256 \\
        --input-len 256 --output-len 256                          # e.g. the 1B dummy shape

For each concurrency C: N prompts of random token ids (input-len each, ignore_eos, greedy,
output-len tokens each) run once through `LLM.generate` with max_num_seqs=C (in a subprocess,
so its memory is gone before the server starts), then through a `tandem serve` started with
the same engine settings, driven by an in-process client holding C streamed completions open
(SSE, usage chunk counted). Prints output tokens/s of both and serve/offline, and the server's
host time per output token from its /metrics counters over the measured run: the engine
thread inside step() (wall, CPU), blocked behind the event loop, and the event loop's CPU. The default
model is tiny (vocab 512, one layer of width 32) so that the forward is nearly free and the host
path (scheduler, detokenizer, loop, SSE) dominates.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512,
    "num_attention_heads": 2, "num_key_value_heads": 1, "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0, "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2,
    "torch_dtype": "float32", "hidden_size": 32, "num_hidden_layers": 1, "head_dim": 16,
    "intermediate_size": 64, "tie_word_embeddings": True, "max_position_embeddings": 4096,
}  # fmt: skip


def prompts(num: int, input_len: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    hi = min(vocab, 30000)
    return [[rng.randrange(3, hi) for _ in range(input_len)] for _ in range(num)]


def run_offline(args: argparse.Namespace, conc: int, vocab: int) -> float:
    """Output tokens/s of LLM.generate over the workload (after a small warm-up)."""
    from tandem import LLM, SamplingParams

    llm = LLM(
        str(args.model), load_format="dummy", device=args.device, dtype=args.dtype,
        max_num_seqs=conc, max_num_batched_tokens=args.max_num_batched_tokens,
    )  # fmt: skip
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0.0)
    work = prompts(args.num_prompts or 2 * conc, args.input_len, vocab)
    llm.generate(prompts(min(conc, 8), args.input_len, vocab, seed=1), params)
    t0 = time.perf_counter()
    outs = llm.generate(work, params)
    dt = time.perf_counter() - t0
    return sum(len(o.outputs[0].token_ids) for o in outs) / dt


HOST_COUNTERS = {  # /metrics counters (seconds) printed per output token
    "engine_step": "tandem:engine_step_seconds_total",
    "engine_step_cpu": "tandem:engine_step_cpu_seconds_total",
    "engine_ahead_wait": "tandem:engine_ahead_wait_seconds_total",
    "loop_cpu": "tandem:loop_cpu_seconds_total",
    "loop_dispatch": "tandem:loop_dispatch_seconds_total",
}


def _counters(text: str) -> dict[str, float]:
    values = {}
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        name = name.partition("{")[0]
        if name in HOST_COUNTERS.values() or name == "tandem:num_steps_total":
            values[name] = float(value)
    return values


async def _client(
    url: str, model: str, work: list[list[int]], conc: int, out_len: int
) -> tuple[float, dict[str, float]]:
    """Output tokens/s of the measured run and the server's host counters over it, in
    microseconds per output token (absent from a server without them)."""
    import aiohttp

    sem = asyncio.Semaphore(conc)
    tokens = 0

    async def one(session: aiohttp.ClientSession, ids: list[int]) -> None:
        nonlocal tokens
        body = {
            "model": model, "prompt": ids, "max_tokens": out_len, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
        }  # fmt: skip
        async with sem, session.post(f"{url}/v1/completions", json=body) as resp:
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {await resp.text()}")
            async for line in resp.content:
                if line.startswith(b'data: {"id') and b'"usage":{' in line:
                    usage = json.loads(line[6:]).get("usage")
                    if usage:
                        tokens += usage["completion_tokens"]

    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(None)) as s:
        await asyncio.gather(*(one(s, p) for p in work[: min(conc, 8)]))  # warm-up
        async with s.get(f"{url}/metrics") as r:
            before = _counters(await r.text())
        tokens = 0
        t0 = time.perf_counter()
        await asyncio.gather(*(one(s, p) for p in work))
        rate = tokens / (time.perf_counter() - t0)
        async with s.get(f"{url}/metrics") as r:
            after = _counters(await r.text())
    phases = {
        key: (after[name] - before[name]) / max(tokens, 1) * 1e6
        for key, name in HOST_COUNTERS.items()
        if name in after and name in before
    }
    steps = after.get("tandem:num_steps_total", 0) - before.get("tandem:num_steps_total", 0)
    if steps:
        phases["tokens_per_step"] = tokens / steps
    return rate, phases


def run_serve(
    args: argparse.Namespace, conc: int, vocab: int, port: int
) -> tuple[float, dict[str, float]]:
    cmd = [
        sys.executable, "-m", "tandem.app.cli", "serve", "--model", str(args.model),
        "--load-format", "dummy", "--device", args.device, "--dtype", args.dtype,
        "--host", "127.0.0.1", "--port", str(port), "--max-num-seqs", str(conc),
        "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--max-queue", "4096",
        "--no-ui", *args.server_args.split(),
    ]  # fmt: skip
    log = open(Path(args.log_dir) / f"server-{conc}.log", "w")  # noqa: SIM115
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        import urllib.request

        t0 = time.monotonic()
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"the server exited during start-up (see {log.name})")
            if time.monotonic() - t0 > args.start_timeout:
                raise RuntimeError(f"the server was not up in {args.start_timeout} s")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.3)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models") as r:
            model = json.load(r)["data"][0]["id"]
        work = prompts(args.num_prompts or 2 * conc, args.input_len, vocab)
        return asyncio.run(_client(f"http://127.0.0.1:{port}", model, work, conc, args.output_len))
    finally:
        server.terminate()
        server.wait(60)
        log.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None, help="a model dir with config.json (default: tiny)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--concurrency", default="64,256")
    ap.add_argument("--num-prompts", type=int, default=0, help="per level (default 2 x C)")
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--server-args", default="", help="more `tandem serve` flags")
    ap.add_argument("--only", choices=["offline", "serve"], default=None)
    ap.add_argument("--port", type=int, default=8239)
    ap.add_argument("--start-timeout", type=float, default=300.0)
    ap.add_argument("--log-dir", default=None)
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--offline-child", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="tandem-svo-")
    args.log_dir = args.log_dir or tmp
    if args.model is None:
        args.model = Path(tmp) / "tiny"
        args.model.mkdir()
        (args.model / "config.json").write_text(json.dumps(TINY))
    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    if args.offline_child:
        print(json.dumps({"offline": run_offline(args, args.offline_child, vocab)}))
        return 0
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    rows = []
    for conc in [int(c) for c in args.concurrency.split(",")]:
        row = {"concurrency": conc, "offline": None, "serve": None, "serve_host_us": {}}
        if args.only != "serve":
            child = [sys.executable, __file__, "--offline-child", str(conc), "--model",
                     str(args.model), *sys.argv[1:]]  # fmt: skip
            out = subprocess.run(child, env=env, capture_output=True, text=True, check=False)
            if out.returncode != 0:
                print(out.stderr[-3000:], file=sys.stderr)
                return 1
            row["offline"] = json.loads(out.stdout.strip().splitlines()[-1])["offline"]
        if args.only != "offline":
            row["serve"], row["serve_host_us"] = run_serve(args, conc, vocab, args.port)
        rows.append(row)
        off, srv = row["offline"], row["serve"]
        ratio = f"{srv / off:6.1%}" if off and srv else "     -"
        print(
            f"concurrency {conc:4d}  offline {off or 0:9.0f} tok/s  serve {srv or 0:9.0f} tok/s"
            f"  serve/offline {ratio}",
            flush=True,
        )
        if row["serve_host_us"]:
            print("    serve host time per output token (us): " + ", ".join(
                f"{k} {v:.1f}" for k, v in row["serve_host_us"].items()), flush=True)  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args) | {"model": str(args.model)},
                                               "rows": rows}, indent=2))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

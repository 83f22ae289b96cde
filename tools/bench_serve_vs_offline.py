#!/usr/bin/env python3
"""`tandem serve` against the offline engine on one workload, in one command.

    python tools/bench_serve_vs_offline.py                        # host-bound tiny model, CPU
    python tools/bench_serve_vs_offline.py --model DIR --device cuda --concurrency 64,256 \\
        --input-len 256 --output-len 256                          # e.g. the 1B dummy shape

For each concurrency C: N prompts of random token ids (input-len each, ignore_eos, greedy,
output-len tokens each) run through `LLM.generate` C at a time (in a subprocess, so its
memory is gone before the server starts), then through a `tandem serve` started with the
same engine settings, driven by an in-process client holding C streamed completions open
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
    """Random token ids; each level and the warm-ups take their own seed, so that no
    measured prompt finds its blocks in the prefix cache."""
    rng = random.Random(seed)
    hi = min(vocab, 30000)
    return [[rng.randrange(3, hi) for _ in range(input_len)] for _ in range(num)]


def run_offline(
    args: argparse.Namespace, levels: list[int], vocab: int
) -> list[tuple[float, float]]:
    """Output tokens/s and process CPU us per token of LLM.generate at each concurrency C:
    the prompts go in waves of C, which, every prompt and every output being as long, is what
    max_num_seqs=C makes of them."""
    from tandem import LLM, SamplingParams

    llm = LLM(
        str(args.model), load_format="dummy", device=args.device, dtype=args.dtype,
        max_num_seqs=max(levels), max_num_batched_tokens=args.max_num_batched_tokens,
    )  # fmt: skip
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0.0)
    llm.generate(prompts(min(max(levels), 8), args.input_len, vocab, seed=1), params)
    rates = []
    for conc in levels:
        work = prompts(args.num_prompts or 2 * conc, args.input_len, vocab, seed=10_000 + conc)
        tokens = 0
        cpu0, t0 = time.process_time(), time.perf_counter()
        for i in range(0, len(work), conc):
            outs = llm.generate(work[i : i + conc], params)
            tokens += sum(len(o.outputs[0].token_ids) for o in outs)
        cpu_us = (time.process_time() - cpu0) / tokens * 1e6
        rates.append((tokens / (time.perf_counter() - t0), cpu_us))
    return rates


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


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (Linux), all its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def child_pids(pid: int) -> list[int]:
    """The live children of a process (Linux), e.g. the server's engine process."""
    pids: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            pids += [int(c) for c in (task / "children").read_text().split()]
        except OSError:  # the thread ended meanwhile
            pass
    return pids


def tree_cpu_seconds(pid: int) -> tuple[float, float]:
    """CPU seconds of a process alone and of its children (with theirs), both live now."""
    children = 0.0
    for child in child_pids(pid):
        try:
            children += sum(tree_cpu_seconds(child))
        except OSError:  # it exited meanwhile
            pass
    return process_cpu_seconds(pid), children


async def _client(
    url: str,
    model: str,
    work: list[list[int]],
    warm: list[list[int]],
    conc: int,
    out_len: int,
    pid: int,
) -> tuple[float, dict[str, float]]:
    """Output tokens/s of the measured run and the server's host counters over it, in
    microseconds per output token (absent from a server without them), with the server
    process's CPU time per token (`process_cpu`) and its engine process's
    (`engine_process_cpu`, where the engine runs in one)."""
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
            # Whole reads, not lines: the client must not be what limits the rate. The usage
            # chunk is the stream's last one before [DONE], so only the tail is kept.
            tail = b""
            async for data in resp.content.iter_any():
                tail = (tail + data)[-16384:]
            for line in tail.split(b"\n"):
                if line.startswith(b'data: {"id') and b'"usage":{' in line:
                    usage = json.loads(line[6:]).get("usage")
                    if usage:
                        tokens += usage["completion_tokens"]

    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(None)) as s:
        await asyncio.gather(*(one(s, p) for p in warm))  # warm-up: not the measured prompts
        async with s.get(f"{url}/metrics") as r:
            before = _counters(await r.text())
        tokens = 0
        cpu0, t0 = tree_cpu_seconds(pid), time.perf_counter()
        await asyncio.gather(*(one(s, p) for p in work))
        rate = tokens / (time.perf_counter() - t0)
        cpu1 = tree_cpu_seconds(pid)
        async with s.get(f"{url}/metrics") as r:
            after = _counters(await r.text())
    phases = {"process_cpu": (cpu1[0] - cpu0[0]) / max(tokens, 1) * 1e6}
    if cpu1[1] or cpu0[1]:  # the engine's own process
        phases["engine_process_cpu"] = (cpu1[1] - cpu0[1]) / max(tokens, 1) * 1e6
    phases |= {
        key: (after[name] - before[name]) / max(tokens, 1) * 1e6
        for key, name in HOST_COUNTERS.items()
        if name in after and name in before
    }
    steps = after.get("tandem:num_steps_total", 0) - before.get("tandem:num_steps_total", 0)
    if steps:
        phases["tokens_per_step"] = tokens / steps
    return rate, phases


def run_serve(
    args: argparse.Namespace, levels: list[int], vocab: int
) -> list[tuple[float, dict[str, float]]]:
    """One `tandem serve` (max_num_seqs = the largest level) driven at each level in turn."""
    import urllib.request

    profiler = (
        [str(ROOT / "tools" / "sample_stacks.py"), "--out", args.profile] if args.profile else []
    )
    cmd = [
        sys.executable, *profiler, "-m", "tandem.app.cli", "serve", "--model", str(args.model),
        "--load-format", "dummy", "--device", args.device, "--dtype", args.dtype,
        "--host", "127.0.0.1", "--port", str(args.port), "--max-num-seqs", str(max(levels)),
        "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--max-queue", "4096",
        "--no-ui", *args.server_args.split(),
    ]  # fmt: skip
    url = f"http://127.0.0.1:{args.port}"
    log = open(Path(args.log_dir) / "server.log", "a")  # noqa: SIM115
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=args.env)
    try:
        t0 = time.monotonic()
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"the server exited during start-up (see {log.name})")
            if time.monotonic() - t0 > args.start_timeout:
                raise RuntimeError(f"the server was not up in {args.start_timeout} s")
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.3)
        with urllib.request.urlopen(f"{url}/v1/models") as r:
            model = json.load(r)["data"][0]["id"]
        return [
            asyncio.run(
                _client(url, model, prompts(args.num_prompts or 2 * conc, args.input_len, vocab, 10_000 + conc),
                        prompts(min(conc, 8), args.input_len, vocab, seed=1), conc,
                        args.output_len, server.pid)
            )
            for conc in levels
        ]  # fmt: skip
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
    ap.add_argument(
        "--profile", default=None, help="the server under tools/sample_stacks.py, into this file"
    )
    ap.add_argument("--only", choices=["offline", "serve"], default=None)
    ap.add_argument("--port", type=int, default=8239)
    ap.add_argument("--start-timeout", type=float, default=300.0)
    ap.add_argument("--log-dir", default=None)
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--rounds", type=int, default=1, help="offline then serve, this many times")
    ap.add_argument("--offline-child", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="tandem-svo-")
    args.log_dir = args.log_dir or tmp
    if args.model is None:
        args.model = Path(tmp) / "tiny"
        args.model.mkdir()
        (args.model / "config.json").write_text(json.dumps(TINY))
    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    levels = [int(c) for c in args.concurrency.split(",")]
    if args.offline_child:
        print(json.dumps({"offline": run_offline(args, levels, vocab)}))
        return 0
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    if args.device == "cpu":  # a tiny forward gains nothing from threads, and on a loaded
        env.setdefault("OMP_NUM_THREADS", "1")  # host their spinning swamps the comparison
    args.env = env
    rows = []
    for rnd in range(args.rounds):
        offline: list[tuple[float | None, float | None]] = [(None, None)] * len(levels)
        served: list[tuple[float | None, dict[str, float]]] = [(None, {})] * len(levels)
        if args.only != "serve":
            child = [sys.executable, __file__, *sys.argv[1:], "--offline-child", "1",
                     "--model", str(args.model)]  # fmt: skip
            out = subprocess.run(child, env=env, capture_output=True, text=True, check=False)
            if out.returncode != 0:
                print(out.stderr[-3000:], file=sys.stderr)
                return 1
            offline = json.loads(out.stdout.strip().splitlines()[-1])["offline"]
        if args.only != "offline":
            served = run_serve(args, levels, vocab)
        for conc, (off, off_cpu), (srv, host_us) in zip(levels, offline, served, strict=True):
            rows.append({"round": rnd, "concurrency": conc, "offline": off, "serve": srv,
                         "offline_cpu_us": off_cpu, "serve_host_us": host_us})  # fmt: skip
            ratio = f"{srv / off:6.1%}" if off and srv else "     -"
            print(
                f"concurrency {conc:4d}  offline {off or 0:9.0f} tok/s  serve {srv or 0:9.0f} "
                f"tok/s  serve/offline {ratio}",
                flush=True,
            )
            if off_cpu:
                print(f"    offline process CPU per output token (us): {off_cpu:.1f}")
            if host_us:
                print("    serve host time per output token (us): " + ", ".join(
                    f"{k} {v:.1f}" for k, v in host_us.items()), flush=True)  # fmt: skip
    if args.json:
        settings = {k: str(v) for k, v in vars(args).items() if k != "env"}
        Path(args.json).write_text(json.dumps({"args": settings, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

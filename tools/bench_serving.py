#!/usr/bin/env python3
"""Serving benchmark: a load generator speaking the OpenAI streaming API over aiohttp.

    tandem serve &                                   # the server under test
    python tools/bench_serving.py --dataset random --input-len 128 --output-len 64 \\
        --num-prompts 64 --max-concurrency 16
    python tools/bench_serving.py --dataset conversation --request-rate 4 --num-prompts 100
    python tools/bench_serving.py --sweep-concurrency 1,16,64 --plot sweep.png \\
        --result-json sweep.json --health-probe [--sweep-num-prompts 16,64,256]

Every request streams (`stream_options.include_usage`), so token counts come from the
server's usage chunk (or, from a server that sends none, the number of text chunks) and inter-token latency from SSE chunk arrival times. Per request:
TTFT (first chunk carrying text), ITL (gaps between text-carrying chunks; a chunk may carry
several tokens when the server coalesces), TPOT ((e2e - TTFT) / (output tokens - 1)) and
end-to-end latency. The run reports mean / median / p99 of each, request and output-token
throughput, and goodput (requests/s meeting every SLO given). `--health-probe` samples
GET /health every 20 ms while the load runs. Datasets: `random` (random token ids decoded to
text with the model's tokenizer, re-encoded to the exact --input-len; ignore_eos so outputs
are exactly --output-len) and `conversation` (synthetic multi-turn chats sharing one system
prompt, lengths varied). Nothing here imports the server; the tokenizer is only for `random`.
`--result-json` is rewritten after every level, so a run cut short keeps the levels it finished.
The sweep plot is a PNG through matplotlib, or an SVG written here where matplotlib is missing.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import math
import os
import platform
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parents[1]


# ---- datasets ---------------------------------------------------------------------------------
@dataclass
class BenchRequest:
    endpoint: str  # "completions" | "chat"
    prompt: str | list[int] | None = None  # completions
    messages: list[dict[str, str]] | None = None  # chat
    max_tokens: int = 64


@functools.lru_cache(maxsize=4)
def load_tokenizer(name: str | None) -> Any:
    """The tokenizer of a model directory, a .gguf file or a known name (None: the default)."""
    sys.path.insert(0, str(ROOT))
    from tandem.models.hub import resolve_model
    from tandem.models.tokenizer import Tokenizer

    path = resolve_model(name)
    if path.is_file() and path.suffix == ".gguf":
        return Tokenizer.from_gguf(path)
    return Tokenizer.from_pretrained(path)


def random_prompt(tokenizer: Any, rng: random.Random, input_len: int) -> str | list[int]:
    """Random token ids as text that re-encodes to exactly `input_len` tokens (ids as fallback)."""
    if tokenizer is None:
        return [rng.randrange(100, 30000) for _ in range(input_len)]
    special = set(tokenizer.all_special_ids)
    vocab = tokenizer.vocab_size
    ids = [t for t in (rng.randrange(vocab) for _ in range(input_len * 2)) if t not in special]
    ids = ids[:input_len]
    for _ in range(8):  # decode/re-encode until the round trip keeps the length
        text = tokenizer.decode(ids)
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) == input_len:
            return text
        if len(ids) > input_len:
            ids = ids[:input_len]
        else:
            ids = (
                ids
                + [t for t in (rng.randrange(vocab) for _ in range(input_len)) if t not in special][
                    : input_len - len(ids)
                ]
            )
    return ids  # could not settle on text of that length: send the ids themselves


def random_dataset(args: argparse.Namespace, rng: random.Random) -> list[BenchRequest]:
    tokenizer = None if args.tokenizer == "none" else load_tokenizer(args.tokenizer or args.model)
    out = []
    for _ in range(args.num_prompts):
        prompt = random_prompt(tokenizer, rng, args.input_len)
        if args.endpoint == "chat" and isinstance(prompt, str):
            out.append(
                BenchRequest(
                    "chat",
                    messages=[{"role": "user", "content": prompt}],
                    max_tokens=args.output_len,
                )
            )
        else:
            out.append(BenchRequest("completions", prompt=prompt, max_tokens=args.output_len))
    return out


_WORDS = (
    "the a of to and in is it you that he was for on are with as his they be at one have "
    "this from or had by word but what some we can out other were all there when up use "
    "your how said an each she which do their time if will way about many then them write "
    "would like so these her long make thing see him two has look more day could go come "
    "did number sound no most people my over know water than call first who may down side "
    "been now find any new work part take get place made live where after back little only "
    "round man year came show every good me give our under name very through just form "
    "sentence great think say help low line differ turn cause much mean before move right "
    "boy old too same tell does set three want air well also play small end put home read "
    "hand port large spell add even land here must big high such follow act why ask men "
    "change went light kind off need house picture try us again animal point mother world "
    "near build self earth father head stand own page should country found answer school "
    "grow study still learn plant cover food sun four between state keep eye never last "
    "let thought city tree cross farm hard start might story saw far sea draw left late run "
    "while press close night real life few north open seem together next white children "
    "begin got walk example ease paper group always music those both mark often letter "
    "until mile river car feet care second book carry took science eat room friend began "
    "idea fish mountain stop once base hear horse cut sure watch color face wood main"
).split()

SYSTEM_PROMPT = (
    "You are a helpful, concise assistant for a travel company. Answer questions "
    "about destinations, bookings and schedules. Be accurate, avoid speculation, "
    "say when you do not know, and keep each answer short unless asked for detail. "
    "Use plain text without markdown. Prices are in euros unless stated otherwise."
)


def _sentence(rng: random.Random, num_words: int) -> str:
    words = [rng.choice(_WORDS) for _ in range(num_words)]
    return " ".join(words).capitalize() + rng.choice(".?!")


def conversation_dataset(args: argparse.Namespace, rng: random.Random) -> list[BenchRequest]:
    """Chats of 1-4 user turns sharing SYSTEM_PROMPT; message and output lengths vary ~4x."""
    out = []
    for _ in range(args.num_prompts):
        messages = [{"role": "system", "content": SYSTEM_PROMPT}]
        for turn in range(rng.randint(1, 4)):
            if turn:
                messages.append(
                    {
                        "role": "assistant",
                        "content": " ".join(
                            _sentence(rng, rng.randint(6, 20)) for _ in range(rng.randint(1, 4))
                        ),
                    }
                )
            messages.append(
                {
                    "role": "user",
                    "content": " ".join(
                        _sentence(rng, rng.randint(4, 16)) for _ in range(rng.randint(1, 3))
                    ),
                }
            )
        lo, hi = max(1, args.output_len // 2), max(1, args.output_len * 3 // 2)
        out.append(BenchRequest("chat", messages=messages, max_tokens=rng.randint(lo, hi)))
    return out


# ---- one request ------------------------------------------------------------------------------
@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    text_chunks: int = 0  # chunks that carried text: the token count where a server sends no usage
    ttft: float = 0.0  # s
    e2e: float = 0.0  # s
    itl: list[float] = field(default_factory=list)  # s, gaps between text-carrying chunks

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


async def send(
    http: aiohttp.ClientSession,
    base_url: str,
    model: str,
    req: BenchRequest,
    headers: dict[str, str],
) -> RequestResult:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": req.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
        "temperature": 0,
    }
    if req.endpoint == "chat":
        body["messages"] = req.messages
        url = f"{base_url}/v1/chat/completions"
    else:
        body["prompt"] = req.prompt
        url = f"{base_url}/v1/completions"
    result = RequestResult()
    start = time.perf_counter()
    last: float | None = None
    try:
        async with http.post(url, json=body, headers=headers) as resp:
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return result
            async for raw in resp.content:  # one SSE line at a time
                line = raw.strip()
                if not line.startswith(b"data: "):
                    continue
                now = time.perf_counter()
                data = line[6:]
                if data == b"[DONE]":
                    result.e2e = now - start
                    result.ok = not result.error and last is not None
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = str(chunk["error"].get("message"))
                    continue
                if chunk.get("usage"):
                    result.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                for choice in chunk.get("choices", ()):
                    text = (
                        choice.get("text")
                        if "text" in choice
                        else (choice.get("delta") or {}).get("content")
                    )
                    if text:
                        result.text_chunks += 1
                        if last is None:
                            result.ttft = now - start
                        else:
                            result.itl.append(now - last)
                        last = now
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:  # noqa: UP041
        result.error = f"{type(exc).__name__}: {exc}"
    if not result.ok and not result.error:
        result.error = "stream ended without text or [DONE]"
    if result.ok and not result.output_tokens:
        # A server without stream usage (llama.cpp's, say) streams one token per chunk.
        result.output_tokens = result.text_chunks
    return result


# ---- health probe -----------------------------------------------------------------------------
async def probe_health(
    base_url: str,
    interval_s: float,
    stop: asyncio.Event,
    latencies: list[float],
    failures: list[str],
) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
        while not stop.is_set():
            t0 = time.perf_counter()
            try:
                async with http.get(f"{base_url}/health") as resp:
                    await resp.read()
                    if resp.status != 200:
                        failures.append(f"HTTP {resp.status}")
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:  # noqa: UP041
                failures.append(type(exc).__name__)
            latencies.append(time.perf_counter() - t0)
            try:
                await asyncio.wait_for(
                    stop.wait(), max(0.0, interval_s - (time.perf_counter() - t0))
                )
            except asyncio.TimeoutError:  # noqa: UP041
                pass


# ---- a run ------------------------------------------------------------------------------------
def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated q-th percentile (0-100) of a non-empty list."""
    s = sorted(values)
    k = (len(s) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def summary_ms(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "median": None, "p99": None}
    return {
        "mean": 1000 * statistics.fmean(values),
        "median": 1000 * statistics.median(values),
        "p99": 1000 * percentile(values, 99),
    }


async def run_load(
    args: argparse.Namespace,
    requests: list[BenchRequest],
    model: str,
    max_concurrency: int | None,
    request_rate: float,
) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    rng = random.Random(args.seed + 1)
    semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    stop_probe = asyncio.Event()
    probe_lat: list[float] = []
    probe_fail: list[str] = []
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:

        async def limited(req: BenchRequest) -> RequestResult:
            if semaphore is None:
                return await send(http, args.base_url, model, req, headers)
            async with semaphore:
                return await send(http, args.base_url, model, req, headers)

        probe = None
        if args.health_probe:
            probe = asyncio.create_task(
                probe_health(
                    args.base_url, args.health_interval_ms / 1000, stop_probe, probe_lat, probe_fail
                )
            )
        start = time.perf_counter()
        tasks = []
        for req in requests:
            tasks.append(asyncio.create_task(limited(req)))
            if math.isfinite(request_rate):  # Poisson arrivals
                await asyncio.sleep(rng.expovariate(request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        stop_probe.set()
        if probe is not None:
            await probe
    return summarize(args, results, duration, max_concurrency, request_rate, probe_lat, probe_fail)


def summarize(
    args: argparse.Namespace,
    results: list[RequestResult],
    duration: float,
    max_concurrency: int | None,
    request_rate: float,
    probe_lat: list[float],
    probe_fail: list[str],
) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    tpots = [t for r in ok if (t := r.tpot) is not None]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    slo_ttft = args.slo_ttft_ms / 1000 if args.slo_ttft_ms else None
    slo_tpot = args.slo_tpot_ms / 1000 if args.slo_tpot_ms else None
    good = [
        r
        for r in ok
        if (slo_ttft is None or r.ttft <= slo_ttft)
        and (slo_tpot is None or (r.tpot or 0.0) <= slo_tpot)
    ]
    report: dict[str, Any] = {
        "max_concurrency": max_concurrency,
        "request_rate": request_rate if math.isfinite(request_rate) else "inf",
        "num_prompts": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "duration_s": duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "goodput": len(good) / duration if (slo_ttft or slo_tpot) else None,
        "slo_ttft_ms": args.slo_ttft_ms,
        "slo_tpot_ms": args.slo_tpot_ms,
        "ttft_ms": summary_ms([r.ttft for r in ok]),
        "tpot_ms": summary_ms(tpots),
        "itl_ms": summary_ms([g for r in ok for g in r.itl]),
        "e2e_ms": summary_ms([r.e2e for r in ok]),
    }
    report["ttft_ms"]["p50"] = report["ttft_ms"]["median"]
    report["tpot_ms"]["p50"] = report["tpot_ms"]["median"]
    if args.health_probe:
        report["health"] = {
            "samples": len(probe_lat),
            "failures": len(probe_fail),
            "p50_ms": 1000 * percentile(probe_lat, 50) if probe_lat else None,
            "p99_ms": 1000 * percentile(probe_lat, 99) if probe_lat else None,
            "max_ms": 1000 * max(probe_lat) if probe_lat else None,
        }
    return report


def print_report(r: dict[str, Any]) -> None:
    def f(v: Any) -> str:
        return "-" if v is None else (f"{v:.2f}" if isinstance(v, float) else str(v))

    print(f"==== concurrency {f(r['max_concurrency'])}, request rate {r['request_rate']} ====")
    print(
        f"  successful requests      {r['completed']} / {r['num_prompts']}"
        + (f"  errors: {r['errors']}" if r["errors"] else "")
    )
    print(f"  duration                 {r['duration_s']:.2f} s")
    print(f"  input / output tokens    {r['total_input_tokens']} / {r['total_output_tokens']}")
    print(f"  request throughput       {r['request_throughput']:.2f} req/s")
    print(f"  output token throughput  {r['output_throughput']:.2f} tok/s")
    print(f"  total token throughput   {r['total_token_throughput']:.2f} tok/s")
    if r["goodput"] is not None:
        print(
            f"  goodput                  {r['goodput']:.2f} req/s "
            f"(TTFT <= {f(r['slo_ttft_ms'])} ms, TPOT <= {f(r['slo_tpot_ms'])} ms)"
        )
    print(f"  {'(ms)':<8}{'mean':>10}{'median':>10}{'p99':>10}")
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        s = r[key]
        print(f"  {key[:-3].upper():<8}{f(s['mean']):>10}{f(s['median']):>10}{f(s['p99']):>10}")
    if "health" in r:
        h = r["health"]
        print(
            f"  /health  {h['samples']} samples, p50 {f(h['p50_ms'])} ms, p99 {f(h['p99_ms'])} "
            f"ms, max {f(h['max_ms'])} ms, {h['failures']} failures"
        )


_PANELS = (
    ("TTFT (ms)", (("p50", lambda r: r["ttft_ms"]["p50"]), ("p99", lambda r: r["ttft_ms"]["p99"]))),
    ("TPOT (ms)", (("p50", lambda r: r["tpot_ms"]["p50"]), ("p99", lambda r: r["tpot_ms"]["p99"]))),
    ("output tokens/s", (("output", lambda r: r["output_throughput"]),)),
)


def plot_sweep(runs: list[dict[str, Any]], path: str, title: str) -> str:
    """TTFT and TPOT p50/p99 and output tok/s against concurrency; returns the path written:
    `path` through matplotlib, or `path` with an .svg suffix drawn here where matplotlib is
    missing (or where `path` asks for .svg)."""
    if Path(path).suffix.lower() != ".svg":
        try:
            _plot_matplotlib(runs, path, title)
            return path
        except ImportError:
            print("matplotlib is not installed: writing an SVG plot instead", file=sys.stderr)
    svg = str(Path(path).with_suffix(".svg"))
    Path(svg).write_text(sweep_svg(runs, title))
    return svg


def sweep_svg(runs: list[dict[str, Any]], title: str) -> str:
    """The sweep plot as a standalone SVG: three panels, log2 concurrency on x, linear y."""
    w, h, left, top, bottom = 330, 260, 60, 40, 40
    colors = ("#1f77b4", "#d62728")
    xs = [r["max_concurrency"] or 1 for r in runs]
    lx = [math.log2(x) for x in xs]
    x0, x1 = min(lx), max(lx) if max(lx) > min(lx) else min(lx) + 1
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{3 * w}" height="{h + top}" '
        'font-family="sans-serif" font-size="11">',
        f'<rect width="100%" height="100%" fill="white"/><text x="{1.5 * w}" y="18" '
        f'text-anchor="middle" font-size="13">{_xml(title)}</text>',
    ]
    for i, (label, series) in enumerate(_PANELS):
        ox, pw, ph = i * w + left, w - left - 15, h - bottom - 10
        ys = [v for _, get in series for r in runs if (v := get(r)) is not None]
        ymax = max(ys, default=1.0) * 1.1 or 1.0

        def px(v: float, ox: float = ox, pw: float = pw) -> float:
            return ox + (v - x0) / (x1 - x0) * pw

        def py(v: float, ph: float = ph, ymax: float = ymax) -> float:
            return top + ph - v / ymax * ph

        parts.append(
            f'<rect x="{ox}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="#999"/>'
            f'<text x="{ox - 48}" y="{top + ph / 2}" transform="rotate(-90 {ox - 48} '
            f'{top + ph / 2})" text-anchor="middle">{_xml(label)}</text>'
            f'<text x="{ox + pw / 2}" y="{top + ph + 32}" text-anchor="middle">concurrency</text>'
        )
        for k in range(5):
            v = ymax * k / 4
            tick = f"{v:,.0f}" if v >= 100 else f"{v:.3g}"
            parts.append(f'<text x="{ox - 4}" y="{py(v) + 4:.1f}" text-anchor="end">{tick}</text>')
        for x, xl in zip(xs, lx, strict=True):
            parts.append(
                f'<text x="{px(xl):.1f}" y="{top + ph + 15}" text-anchor="middle">{x}</text>'
            )
        for j, (name, get) in enumerate(series):
            pts = [
                (px(xl), py(v)) for xl, r in zip(lx, runs, strict=True) if (v := get(r)) is not None
            ]
            if not pts:
                continue
            color = colors[j % 2] if len(series) > 1 else "#2ca02c"
            dash = ' stroke-dasharray="5,3"' if j else ""
            path = " ".join(f"{a:.1f},{b:.1f}" for a, b in pts)
            parts.append(
                f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="2"{dash}/>'
            )
            parts.extend(
                f'<circle cx="{a:.1f}" cy="{b:.1f}" r="3" fill="{color}"/>' for a, b in pts
            )
            if len(series) > 1:
                parts.append(
                    f'<text x="{ox + 8}" y="{top + 14 + 13 * j}" fill="{color}">{name}</text>'
                )
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def _xml(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _plot_matplotlib(runs: list[dict[str, Any]], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [r["max_concurrency"] for r in runs]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, key, label in ((axes[0], "ttft_ms", "TTFT (ms)"), (axes[1], "tpot_ms", "TPOT (ms)")):
        ax.plot(xs, [r[key]["p50"] for r in runs], "o-", label="p50")
        ax.plot(xs, [r[key]["p99"] for r in runs], "s--", label="p99")
        ax.set_ylabel(label)
        ax.legend()
    axes[2].plot(xs, [r["output_throughput"] for r in runs], "o-", color="tab:green")
    axes[2].set_ylabel("output tokens/s")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.set_xlabel("concurrency")
        ax.grid(True, alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- main -------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--api-key", default=os.environ.get("TANDEM_API_KEY"))
    p.add_argument("--model", default=None, help="model id (default: the server's first)")
    p.add_argument(
        "--tokenizer",
        default=None,
        help="for --dataset random: model dir, .gguf or name (default: --model, else "
        "the default model); 'none' sends token ids",
    )
    p.add_argument("--dataset", choices=["random", "conversation"], default="random")
    p.add_argument(
        "--endpoint",
        choices=["completions", "chat"],
        default="completions",
        help="for --dataset random (conversation always uses chat)",
    )
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="requests/s with Poisson arrivals; inf sends all at once",
    )
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument(
        "--sweep-concurrency",
        default=None,
        help="comma-separated levels, e.g. 1,4,16,64: one run per level",
    )
    p.add_argument(
        "--sweep-num-prompts",
        default=None,
        help="comma-separated request counts, one per --sweep-concurrency level "
        "(default: max(--num-prompts, level) each)",
    )
    p.add_argument("--slo-ttft-ms", type=float, default=None)
    p.add_argument("--slo-tpot-ms", type=float, default=None)
    p.add_argument(
        "--health-probe", action="store_true", help="sample GET /health latency during the run"
    )
    p.add_argument("--health-interval-ms", type=float, default=20.0)
    p.add_argument("--warmup", type=int, default=1, help="requests sent before measuring")
    p.add_argument("--request-timeout", type=float, default=1800.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--result-json", default=None)
    p.add_argument("--plot", default=None, help="PNG path for the sweep plot")
    return p


async def server_model(args: argparse.Namespace) -> str:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with (
        aiohttp.ClientSession() as http,
        http.get(f"{args.base_url}/v1/models", headers=headers) as resp,
    ):
        resp.raise_for_status()
        return (await resp.json())["data"][0]["id"]


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    model = args.model or await server_model(args)
    rng = random.Random(args.seed)
    dataset = random_dataset if args.dataset == "random" else conversation_dataset
    levels = (
        [int(x) for x in args.sweep_concurrency.split(",")]
        if args.sweep_concurrency
        else [args.max_concurrency]
    )
    counts = [
        args.num_prompts if level is None else max(args.num_prompts, level) for level in levels
    ]
    if args.sweep_num_prompts:
        counts = [int(x) for x in args.sweep_num_prompts.split(",")]
        if len(counts) != len(levels):
            raise ValueError(
                f"--sweep-num-prompts has {len(counts)} counts for {len(levels)} levels"
            )
    if args.warmup:
        warm = argparse.Namespace(
            **{**vars(args), "num_prompts": args.warmup, "output_len": 4, "health_probe": False}
        )
        await run_load(warm, dataset(warm, rng), model, None, math.inf)
    runs: list[dict[str, Any]] = []
    result = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),  # noqa: UP017
        "machine": {
            "node": platform.node(),
            "processor": platform.processor(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
        },
        "base_url": args.base_url,
        "model": model,
        "dataset": args.dataset,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
        "runs": runs,
    }
    for level, num in zip(levels, counts, strict=True):
        level_args = argparse.Namespace(**{**vars(args), "num_prompts": num})
        # the warm-up's and every level's prompts come from one stream: a prompt seen before
        # would be served from the prefix cache and flatter TTFT
        requests = dataset(level_args, rng)
        rate = math.inf if args.sweep_concurrency else args.request_rate
        report = await run_load(args, requests, model, level, rate)
        print_report(report)
        runs.append(report)
        if args.result_json:  # after every level: a run cut short keeps what it measured
            write_json(args.result_json, result)
    return result


def write_json(path: str, result: dict[str, Any]) -> None:
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps(result, indent=2, default=str) + "\n")
    tmp.replace(path)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.base_url = args.base_url.rstrip("/")
    try:  # the client parses every SSE chunk of every stream: uvloop keeps its overhead down
        import uvloop

        run = uvloop.run
    except ImportError:
        run = asyncio.run
    result = run(main_async(args))
    if args.result_json:
        write_json(args.result_json, result)
        print(f"results: {args.result_json}")
    if args.plot and not args.sweep_concurrency:
        print("--plot needs --sweep-concurrency; no plot written", file=sys.stderr)
    elif args.plot:
        title = f"{result['model']} · {args.dataset} in {args.input_len} / out {args.output_len}"
        print(f"plot: {plot_sweep(result['runs'], args.plot, title)}")
    return 0 if all(r["failed"] == 0 for r in result["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())

"""End-to-end hybrid MoE benchmark: a Qwen3-30B-A3B-shaped model (48 layers, hidden 2048,
32/4 heads of dim 128, 128 experts top-8, expert intermediate 768, vocab 151936) with random
weights; attention and everything dense on the GPU, the experts on the CPU expert pool
("cpu_pool" backend), per expert format; then, with --gpu-all and where it fits, the same
model with every expert on the GPU ("gpu" expert backend: routed kernels, decode graphs; or
--gpu-all-backend torch, the per-expert loop), and with --hf the peer, HF transformers'
Qwen3-MoE of the same shape on the GPU, in the same process. `--config config.json` takes the
shape and architecture from an HF config instead (Qwen3-MoE, Qwen2-MoE with its shared expert
and dense layers, Mixtral, GLM-4.5, GPT-OSS with its expert biases; `--layers N` cuts it to N
layers).

The GPU side runs with the cupy attention backend by default (--attention-backend torch: the
reference backend, as in the first recorded figures) and its decode steps through CUDA graphs
captured per batch size where the expert backend allows it (`supports_cuda_graphs`: the
stream-ordered cpu_pool path with every expert on the pool, and the gpu backend; the torch
expert backend syncs on the host, so a run with it stays eager). `--graphs on off` measures
both in one process (the same model and pool), so the graph speed-up is read off one run;
prefill is eager either way and is measured once.

Per configuration it prints decode tok/s at batch 1, aggregate decode tok/s at --batch
concurrent sequences, and prefill tok/s of one --prefill-token prompt, each next to its floor:
active expert bytes per token / --floor-gbps (CPU read bandwidth); for --gpu-all the bytes a
step reads from GPU memory over the measured device copy bandwidth. At batch B the floor counts
the experts a step is expected to touch under uniform routing (E * (1 - (1 - k/E)^B)); prefill
reads every expert once. The pool holds distinct memory per layer, but every layer is converted
from one random layer (random init of 29 B host parameters would dominate the run).

    python tools/bench_hybrid_moe.py [--formats int4 bf16] [--gpu-all] [--hf] [--json out.json]
        [--config config.json] [--layers 48] [--decode-steps 16] [--batch 16] [--prefill 2048] [--threads N]
        [--attention-backend cupy|torch] [--graphs on off] [--spin-us 200]
        [--pool-sync flags host_func]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tandem.models.batch import ForwardBatch, KVCache  # noqa: E402
from tandem.models.config import ModelConfig  # noqa: E402
from tandem.models.layers.cpu_expert_options import default_cuda_pool_threads  # noqa: E402
from tandem.models.loader import apply_fast_linears, build_model  # noqa: E402
from tandem.models.loader.dummy import init_dummy_weights  # noqa: E402
from tools.peers.cpu_bandwidth import read_bandwidth_gbps  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--config",
        type=Path,
        default=None,
        help="an HF config.json (or a directory holding one) of a supported MoE architecture "
        "(Qwen3-MoE, Qwen2-MoE with its shared expert, Mixtral): its shape replaces the shape "
        "options below, but for --layers where given",
    )
    p.add_argument(
        "--layers", type=int, default=None, help="decoder layers (default 48, or the config's)"
    )
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--inter", type=int, default=768)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument(
        "--formats", nargs="*", default=["int4", "bf16"], help="CPU-pool runs (none: skip them)"
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="pool threads (default: the backend's, cpus - 2 on CUDA)",
    )
    p.add_argument("--decode-steps", type=int, default=16)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prompt", type=int, default=32, help="prompt tokens before decoding")
    p.add_argument("--prefill", type=int, default=2048)
    p.add_argument(
        "--gpu-experts",
        type=int,
        default=None,
        help="pool runs: N experts a layer also on the GPU, which computes the slots routed to "
        "them (the floors still count every expert on the CPU)",
    )
    p.add_argument("--gpu-all", action="store_true", help="also run every expert on the GPU")
    p.add_argument(
        "--gpu-all-backend",
        default="gpu",
        choices=["gpu", "torch"],
        help="the expert backend of --gpu-all: gpu (kernels, decode graphs) or the torch loop",
    )
    p.add_argument(
        "--hf",
        action="store_true",
        help="also the peer: HF transformers' model of this architecture and shape on the GPU "
        "(bf16)",
    )
    p.add_argument(
        "--hf-experts",
        nargs="+",
        default=["default", "grouped_mm"],
        help="HF experts implementations to measure (default: what HF picks)",
    )
    p.add_argument(
        "--floor-gbps",
        type=float,
        default=None,
        help="CPU read bandwidth of the floors, GB/s (default: measured now by "
        "tools/peers/cpu_bandwidth.c at the pool's thread count)",
    )
    p.add_argument(
        "--pcie-gbps",
        type=float,
        default=55.0,
        help="pinned host -> GPU bandwidth: the floor of prefill steps on the GPU path",
    )
    p.add_argument("--device", default="cuda")
    p.add_argument(
        "--attention-backend",
        default="cupy",
        choices=["torch", "cupy"],
        help="the CuPy paged kernels (default; CUDA graphs need them) or the torch reference",
    )
    p.add_argument(
        "--graphs",
        nargs="+",
        default=["on", "off"],
        choices=["on", "off"],
        help="decode through CUDA graphs, eagerly, or both (each measured on the same model)",
    )
    p.add_argument("--spin-us", type=int, default=None, help="pool spin before sleep (us)")
    p.add_argument(
        "--pool-sync",
        nargs="+",
        default=[None],
        choices=["flags", "host_func"],
        help="how the stream starts and awaits the pool (default: the backend's, flags where "
        "the driver has stream memory operations); several: one run each, same process",
    )
    p.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="after the figures, N batch-1 decode steps under torch.profiler: device time per "
        "kernel/copy per step against the step's wall time (what the GPU side costs)",
    )
    p.add_argument(
        "--gpu-prefill",
        nargs="+",
        default=["auto", "off"],
        help="modes of the cpu_pool backend's GPU path for prefill-sized steps, each measured "
        "on the same model (auto: by format; off: the pool; N: from N tokens)",
    )
    p.add_argument(
        "--prefill-sweep",
        type=int,
        nargs="*",
        default=[],
        metavar="T",
        help="also one-step prefills of these lengths per --gpu-prefill mode (the crossover)",
    )
    p.add_argument(
        "--prefill-chunks",
        type=int,
        nargs="*",
        default=[],
        metavar="C",
        help="also the --prefill prompt in steps of C tokens of one sequence (what the scheduler "
        "makes of it with max_num_batched_tokens C), per --gpu-prefill mode",
    )
    p.add_argument("--profile-rows", type=int, default=15, help="kernels --profile prints")
    p.add_argument(
        "--fit-ram",
        action="store_true",
        help="per format, the model cut to its dense layers + as many MoE layers as the host's "
        "available memory holds (--layers caps it); the figures are also extrapolated to the "
        "config's full depth",
    )
    p.add_argument("--ram-reserve-gb", type=float, default=10.0, help="left free by --fit-ram")
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args(argv)
    a.prefill = max([a.prefill, *a.prefill_sweep])
    return a


def model_config(a: argparse.Namespace) -> ModelConfig:
    if a.config is not None:
        path = a.config / "config.json" if a.config.is_dir() else a.config
        cfg = ModelConfig.from_hf_dict(json.loads(path.read_text()))
        if not cfg.is_moe:
            raise SystemExit(f"{path}: {cfg.architecture} is not a mixture of experts")
        a.full_config = cfg
        if a.layers is not None:
            cfg = dataclasses.replace(
                cfg,
                num_hidden_layers=a.layers,
                sliding_layers=tuple(i for i in cfg.sliding_layers if i < a.layers),
            )
        return cfg
    a.full_config = cfg = ModelConfig(
        architecture="Qwen3MoeForCausalLM",
        vocab_size=a.vocab,
        hidden_size=a.hidden,
        intermediate_size=6144,
        num_hidden_layers=48 if a.layers is None else a.layers,
        num_attention_heads=a.heads,
        num_key_value_heads=a.kv_heads,
        head_dim=a.head_dim,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        max_position_embeddings=40960,
        qk_norm=True,
        num_experts=a.experts,
        num_experts_per_tok=a.topk,
        moe_intermediate_size=a.inter,
        norm_topk_prob=True,
    )
    return cfg


class DecodeGraph:
    """One decode batch size's forward captured in a CUDA graph over static device inputs (the
    CUDA runner's scheme, without its scheduler): a step copies its inputs in and replays."""

    def __init__(self, runner: Runner, bs: int, max_blocks: int, max_len: int) -> None:
        dev = runner.device
        self.bs = bs
        self.ids = torch.zeros(bs, dtype=torch.int64, device=dev)
        self.pos = torch.zeros(bs, dtype=torch.int64, device=dev)
        self.slots = torch.full((bs,), -1, dtype=torch.int64, device=dev)
        self.seq_lens = torch.zeros(bs, dtype=torch.int32, device=dev)
        self.tables = torch.zeros(bs, max_blocks, dtype=torch.int32, device=dev)
        self.batch = ForwardBatch(
            query_start_loc=torch.arange(bs + 1, dtype=torch.int32, device=dev),
            seq_lens=self.seq_lens,
            block_tables=self.tables,
            slot_mapping=self.slots,
            logits_indices=torch.arange(bs, dtype=torch.int64, device=dev),
            query_lens_cpu=[1] * bs,
            seq_lens_cpu=[max_len] * bs,
            kv_cache=runner.kv,
            max_query_len=1,
            max_seq_len=max_len,  # an upper bound: the split-K plan serves shorter contexts
            attn_metadata="cupy",
        )
        self.model = runner.model
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None

    def load(self, ids, pos, slots, seq_lens, tables) -> None:
        self.ids.copy_(ids)
        self.pos.copy_(pos)
        self.slots.copy_(slots)
        self.seq_lens.copy_(seq_lens)
        self.tables.zero_()
        self.tables[:, : tables.shape[1]].copy_(tables)

    def _forward(self) -> torch.Tensor:
        return self.model.compute_logits(self.model(self.ids, self.pos, self.batch))

    @torch.no_grad()
    def run(self) -> torch.Tensor:
        if self.graph is None:  # warm-up on a side stream on this step's inputs, then capture
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):  # idempotent: the same KV values into the same slots
                    self._forward()
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.logits = self._forward()
        self.graph.replay()
        assert self.logits is not None
        return self.logits


class Runner:
    """KV blocks handed out on demand (reset frees all); steps of (sequence slot, number of new
    tokens) with random token ids; the last token of each sequence gets logits. With `graphs`
    on (and a capturable model), decode-only steps replay a CUDA graph per batch size."""

    def __init__(self, model: nn.Module, cfg: ModelConfig, device, dtype, num_blocks: int,
                 max_len: int = 0):  # fmt: skip
        self.model, self.cfg, self.device = model, cfg, torch.device(device)
        self.block_size = 16
        self.max_len = max_len or num_blocks * self.block_size
        self.graphs_on = False
        self._graphs: dict[int, DecodeGraph] = {}
        self.kv = KVCache.for_model(cfg, num_blocks, self.block_size, dtype, device)
        self.gen = torch.Generator().manual_seed(0)
        self.reset()

    def graphs_supported(self) -> str | None:
        """None when decode steps can be captured; else why not."""
        if self.device.type != "cuda":
            return "not on CUDA"
        if getattr(self.model.attn_backend, "name", None) != "cupy":
            return "needs the cupy attention backend"
        backend = getattr(self.model, "expert_backend", None)
        if backend is not None and not getattr(backend, "supports_cuda_graphs", False):
            return f"the {getattr(backend, 'name', '?')} expert backend syncs on the host"
        return None

    def reset(self) -> None:
        self.lens: dict[int, int] = {}
        self.tables: dict[int, list[int]] = {}
        self.next_block = 0

    @torch.no_grad()
    def step(self, work: list[tuple[int, int]]) -> None:
        ids, pos, slots, qlens, slens, tables = [], [], [], [], [], []
        for slot, n in work:
            start = self.lens.get(slot, 0)
            end = start + n
            table = self.tables.setdefault(slot, [])
            while len(table) * self.block_size < end:
                table.append(self.next_block)
                self.next_block += 1
            pos += range(start, end)
            slots += [table[p // self.block_size] * self.block_size + p % self.block_size
                      for p in range(start, end)]  # fmt: skip
            qlens.append(n)
            slens.append(end)
            tables.append(list(table))
            self.lens[slot] = end
        width = max(len(t) for t in tables)
        bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
        qsl = torch.zeros(len(work) + 1, dtype=torch.int32)
        qsl[1:] = torch.cumsum(torch.tensor(qlens), 0)
        dev = self.device
        batch = ForwardBatch(
            query_start_loc=qsl.to(dev),
            seq_lens=torch.tensor(slens, dtype=torch.int32, device=dev),
            block_tables=bt.to(dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            logits_indices=(qsl[1:] - 1).long().to(dev),
            query_lens_cpu=qlens,
            seq_lens_cpu=slens,
            kv_cache=self.kv,
            max_query_len=max(qlens),
            max_seq_len=max(slens),
        )
        total = sum(qlens)
        ids = torch.randint(0, self.cfg.vocab_size, (total,), generator=self.gen).to(dev)
        positions = torch.tensor(pos, dtype=torch.int64, device=dev)
        if self.graphs_on and max(qlens) == 1:
            g = self._graphs.get(len(work))
            if g is None:
                g = self._graphs[len(work)] = DecodeGraph(
                    self, len(work), -(-self.max_len // self.block_size), self.max_len
                )
            g.load(ids, positions, batch.slot_mapping, batch.seq_lens, batch.block_tables)
            logits = g.run()
        else:
            logits = self.model.compute_logits(self.model(ids, positions, batch))
        logits.argmax(-1).tolist()  # the sampled tokens reach the host, as in serving


def max_len(a: argparse.Namespace) -> int:
    """Longest sequence a run makes (decode steps: warm-up, graph capture and timed)."""
    return max(a.prompt + a.decode_steps + 8, a.prefill, 256)


def num_blocks(a: argparse.Namespace) -> int:
    per_seq = -(-(a.prompt + a.decode_steps + 8) // 16)
    return max(a.batch * per_seq, -(-max(a.prefill, 256) // 16)) + 8  # 256: prefill warm-up


def measure_modes(
    runner: Runner, a: argparse.Namespace, name: str, prefill: bool = True
) -> dict[str, dict]:
    """`name` (graphs on where possible) and `name`_eager, per --graphs, on the same model;
    prefill is measured in the first mode only (it is eager in both), where `prefill`."""
    out: dict[str, dict] = {}
    why = runner.graphs_supported()
    for i, mode in enumerate(a.graphs):
        if mode == "on" and why is not None:
            print(f"# {name}: no CUDA graphs ({why}); decode runs eagerly", flush=True)
            mode = "off"
        key = name if mode == "on" else f"{name}_eager"
        if key in out:
            continue
        runner.graphs_on = mode == "on"
        out[key] = measure(runner, a, prefill=prefill and i == 0)
        out[key]["graphs"] = runner.graphs_on
    return out


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _pool(runner: Runner):
    backend = getattr(runner.model, "expert_backend", None)
    return getattr(backend, "_pool", None)


def _phases_per_call(ph: dict) -> dict[str, float]:
    """The pool's phase counters as microseconds per call: route (caller), job (submit to
    last worker done), and per phase worker 0's wall time (ext/cpu/moe.h: Phase)."""
    calls = max(int(ph.get("calls", 0)) or 1, 1)
    out = {"calls": calls, "route": ph["route_ns"] / calls / 1e3, "job": ph["job_ns"] / calls / 1e3}
    for name, ns in ph["wall_ns"].items():
        out[f"wall_{name}"] = ns / calls / 1e3
    return {k: round(v, 1) for k, v in out.items()}


def _pool_seconds(runner: Runner) -> float:
    backend = getattr(runner.model, "expert_backend", None)
    return backend.stats().pool_seconds if hasattr(backend, "stats") else 0.0


def measure(runner: Runner, a: argparse.Namespace, prefill: bool = True) -> dict[str, float]:
    """tok/s per phase, and for the pool the seconds per token it spent from submit to done
    (`*_pool_tok_s`: the rate if nothing but the pool took time)."""
    dev = a.device
    out: dict[str, float] = {}
    # Batch 1: a prompt, one warm-up decode step, then timed decode steps.
    runner.reset()
    runner.step([(0, a.prompt)])
    runner.step([(0, 1)])
    _sync(dev)
    pool = _pool(runner)
    if pool is not None:
        pool.reset_phase_stats()
    t0, p0 = time.perf_counter(), _pool_seconds(runner)
    for _ in range(a.decode_steps):
        runner.step([(0, 1)])
    _sync(dev)
    out["decode_b1_tok_s"] = a.decode_steps / (time.perf_counter() - t0)
    out["decode_b1_pool_tok_s"] = a.decode_steps / max(_pool_seconds(runner) - p0, 1e-9)
    if pool is not None:
        out["decode_b1_phases_us"] = _phases_per_call(pool.phase_stats())
    # Batch B: B prompts in one step, a warm-up step, then timed steps of B tokens.
    runner.reset()
    runner.step([(s, a.prompt) for s in range(a.batch)])
    runner.step([(s, 1) for s in range(a.batch)])
    _sync(dev)
    steps = max(4, a.decode_steps // 2)
    t0, p0 = time.perf_counter(), _pool_seconds(runner)
    for _ in range(steps):
        runner.step([(s, 1) for s in range(a.batch)])
    _sync(dev)
    out[f"decode_b{a.batch}_tok_s"] = a.batch * steps / (time.perf_counter() - t0)
    pool_s = max(_pool_seconds(runner) - p0, 1e-9)
    out[f"decode_b{a.batch}_pool_tok_s"] = a.batch * steps / pool_s
    if not prefill:
        if not _pool_seconds(runner):
            out = {k: v for k, v in out.items() if "_pool_" not in k}
        return out
    # Prefill: one warm-up of the same length (the GPU path pins the pool's memory and sizes
    # its buffers on first use), then one whole prompt in one step.
    runner.reset()
    runner.step([(0, a.prefill)])
    runner.reset()
    _sync(dev)
    t0, p0 = time.perf_counter(), _pool_seconds(runner)
    runner.step([(0, a.prefill)])
    _sync(dev)
    out["prefill_tok_s"] = a.prefill / (time.perf_counter() - t0)
    if _pool_seconds(runner) > p0:  # else the step never reached the pool (GPU path)
        out["prefill_pool_tok_s"] = a.prefill / (_pool_seconds(runner) - p0)
    if not _pool_seconds(runner):
        out = {k: v for k, v in out.items() if "_pool_" not in k}
    return out


def prefill_sweep(runner: Runner, backend, a: argparse.Namespace) -> dict[str, dict]:
    """One-step prefill tok/s per --gpu-prefill mode and length (--prefill and --prefill-sweep),
    each after a warm-up step of the same length (the GPU path pins the pool's memory and
    allocates its buffers on first use), with the layers that went to the GPU."""
    from tandem.models.layers.cpu_expert_options import parse_gpu_prefill

    lengths = sorted({a.prefill, *a.prefill_sweep})
    saved = backend._gpu_prefill_option
    out: dict[str, dict] = {}
    for mode in a.gpu_prefill:
        backend._gpu_prefill_option = parse_gpu_prefill(mode)
        row: dict[str, float] = {}
        for n in lengths:
            for _ in range(2):  # a warm-up of the same length, then the timed step
                runner.reset()
                _sync(a.device)
                calls0 = backend.stats().gpu_prefill_calls
                t0 = time.perf_counter()
                runner.step([(0, n)])
                _sync(a.device)
                dt = time.perf_counter() - t0
            row[str(n)] = n / dt
            row[f"{n}_gpu_layers"] = backend.stats().gpu_prefill_calls - calls0
        for c in a.prefill_chunks:  # one prompt, scheduler-sized chunks of one sequence
            P = a.prefill
            for _ in range(2):
                runner.reset()
                _sync(a.device)
                calls0 = backend.stats().gpu_prefill_calls
                t0 = time.perf_counter()
                for start in range(0, P, c):
                    runner.step([(0, min(c, P - start))])
                _sync(a.device)
                dt = time.perf_counter() - t0
            row[f"{P}/{c}"] = P / dt
            row[f"{P}/{c}_gpu_layers"] = backend.stats().gpu_prefill_calls - calls0
        out[mode] = row
    backend._gpu_prefill_option = saved
    gp = backend._gpu_prefill
    if gp is not None:
        out["pin_seconds"] = {"all": gp.register_seconds}
    return out


def print_sweep(name: str, sweep: dict, fl: dict, a: argparse.Namespace) -> None:
    lengths = sorted({a.prefill, *a.prefill_sweep})
    floor_per_token = fl["prefill_floor_tok_s"] / a.prefill  # floor tok/s per prompt token
    pcie = a.pcie_gbps / a.floor_gbps  # the GPU path's floor: every expert over PCIe once
    print(f"# {name} prefill tok/s by --gpu-prefill mode (% of the floor: all experts read "
          f"once at {a.floor_gbps:g} GB/s; [layers on the GPU]); over PCIe at {a.pcie_gbps:g} "
          "GB/s the floor is " + ", ".join(f"{floor_per_token * pcie * n:.0f}" for n in lengths),
          flush=True)  # fmt: skip
    print("# | mode | " + " | ".join(f"{n} tokens" for n in lengths) + " |")
    for mode in a.gpu_prefill:
        r = sweep[mode]
        cells = [
            f"{r[str(n)]:.0f} ({r[str(n)] / (floor_per_token * n):.0%}) [{r[f'{n}_gpu_layers']}]"
            for n in lengths
        ]
        print(f"# | {mode} | " + " | ".join(cells) + " |", flush=True)
    if a.prefill_chunks:
        print(f"# {name} prefill of {a.prefill} tokens in chunks of C tokens (one sequence, "
              "as the scheduler splits it), tok/s [layer-steps on the GPU]:")  # fmt: skip
        for mode in a.gpu_prefill:
            r = sweep[mode]
            cells = [
                f"C={c}: {r[f'{a.prefill}/{c}']:.0f} [{r[f'{a.prefill}/{c}_gpu_layers']}]"
                for c in a.prefill_chunks
            ]
            print(f"# | {mode} | " + " | ".join(cells) + " |", flush=True)


def profile_decode(runner: Runner, a: argparse.Namespace, name: str) -> None:
    """--profile N: N batch-1 decode steps (graphs as measured) under torch.profiler; prints
    the device time per step of each kernel / copy name (top 15) and the step's wall time."""
    from torch.profiler import ProfilerActivity, profile

    runner.reset()
    runner.step([(0, a.prompt)])
    for _ in range(3):
        runner.step([(0, 1)])
    _sync(a.device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(a.profile):
            runner.step([(0, 1)])
        _sync(a.device)
        wall = (time.perf_counter() - t0) / a.profile
    rows = []
    for ev in prof.key_averages():
        dev_us = getattr(ev, "self_device_time_total", 0) or getattr(ev, "self_cuda_time_total", 0)
        if dev_us > 0:
            rows.append((dev_us / a.profile, ev.count / a.profile, ev.key))
    rows.sort(reverse=True)
    busy = sum(r[0] for r in rows)
    print(f"# profile {name}: {a.profile} batch-1 decode steps, wall {wall * 1e3:.2f} ms/step, "
          f"device busy {busy / 1e3:.2f} ms/step (kernels and copies)", flush=True)  # fmt: skip
    for us, count, key in rows[: a.profile_rows]:
        print(f"#   {us:9.1f} us/step  {count:6.1f}x  {key[:90]}", flush=True)


def expert_bytes(hidden: int, inter: int, fmt: str) -> float:
    """Bytes of one expert (gate, up and down) in the pool's format, scales included."""
    per_elt = {"bf16": 2.0, "int8": 1.0 + 4 / hidden, "int4": 0.5 + 4 / 64}[fmt]
    return 3 * hidden * inter * per_elt


def touched_experts(num_experts: int, top_k: int, tokens: int) -> float:
    """Experts a step of `tokens` tokens reads on average under uniform routing."""
    return num_experts * (1 - (1 - top_k / num_experts) ** tokens)


def moe_layers(cfg: ModelConfig) -> int:
    """Layers with routed experts (Qwen2-MoE's decoder_sparse_step / mlp_only_layers leave
    dense MLPs in the others)."""
    return sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))


def floors(cfg: ModelConfig, fmt: str, a: argparse.Namespace) -> dict[str, float]:
    one = expert_bytes(cfg.hidden_size, cfg.moe_intermediate_size, fmt)
    layers, E, k, bw = moe_layers(cfg), cfg.num_experts, cfg.num_experts_per_tok, a.floor_gbps
    per_token = k * one * layers
    touched = touched_experts(E, k, a.batch)
    return {
        "active_expert_GB_per_token": per_token / 1e9,
        "decode_b1_floor_tok_s": bw * 1e9 / per_token,
        f"decode_b{a.batch}_floor_tok_s": a.batch * bw * 1e9 / (touched * one * layers),
        "prefill_floor_tok_s": a.prefill * bw * 1e9 / (E * one * layers),
    }


def shared_layer(cfg: ModelConfig, distinct: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """The host layer every pool layer converts from (bf16): `distinct` random experts tiled
    to E. Drawing every value of a DeepSeek-V3 layer (256 x 44 M) took 91 s on the device; the
    pool's speed depends on each layer having its own memory (each conversion writes its own),
    not on the values."""
    g = torch.Generator().manual_seed(1)
    E, H, inter = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    d = min(E, distinct)
    reps = -(-E // d)
    w13 = (torch.randn(d, 2 * inter, H, generator=g) * 0.02).to(torch.bfloat16)
    w2 = (torch.randn(d, H, inter, generator=g) * 0.02).to(torch.bfloat16)
    return w13.repeat(reps, 1, 1)[:E].contiguous(), w2.repeat(reps, 1, 1)[:E].contiguous()


def mem_available_bytes() -> int:
    """The kernel's estimate of memory a process can still take (/proc/meminfo)."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def fit_ram(cfg: ModelConfig, fmt: str, a: argparse.Namespace) -> ModelConfig:
    """--fit-ram: the config cut to its leading dense layers and as many MoE layers (in `fmt`
    on the pool) as the host's available memory holds, less --ram-reserve-gb; at most
    --layers layers where given."""
    layer_bytes = cfg.num_experts * expert_bytes(cfg.hidden_size, cfg.moe_intermediate_size, fmt)
    avail = mem_available_bytes() - a.ram_reserve_gb * 1e9
    moe = max(1, int(avail // layer_bytes))
    dense = 0
    while dense < cfg.num_hidden_layers and not cfg.is_moe_layer(dense):
        dense += 1
    layers = min(dense + moe, cfg.num_hidden_layers if a.layers is None else a.layers)
    print(f"# --fit-ram {fmt}: {avail / 1e9:.1f} GB available past the reserve, "
          f"{layer_bytes / 1e9:.2f} GB a MoE layer: {layers} layers ({dense} dense)", flush=True)  # fmt: skip
    return dataclasses.replace(
        cfg,
        num_hidden_layers=layers,
        sliding_layers=tuple(i for i in cfg.sliding_layers if i < layers),
    )


def extrapolate(res: dict, cfg: ModelConfig, full: ModelConfig, fmt: str, a) -> dict:
    """Per-MoE-layer pool time and the step time of the full-depth model (`full`), from a run
    of `cfg` (fewer MoE layers): each step = the pool's time (measured per MoE layer) + the rest
    (GPU side, launches, waits not hidden behind the pool), the rest scaled by the layer count
    (the LM head with it: an overestimate). Floors of `full` at the measured bandwidth."""
    n, n_full = moe_layers(cfg), moe_layers(full)
    scale = full.num_hidden_layers / cfg.num_hidden_layers
    one = expert_bytes(cfg.hidden_size, cfg.moe_intermediate_size, fmt)
    E, k, bw = cfg.num_experts, cfg.num_experts_per_tok, a.measured_gbps * 1e9
    out: dict[str, float] = {"moe_layers": n, "layers": cfg.num_hidden_layers,
                             "full_layers": full.num_hidden_layers}  # fmt: skip
    for b in (1, a.batch):
        rate, pool_rate = res.get(f"decode_b{b}_tok_s"), res.get(f"decode_b{b}_pool_tok_s")
        if not rate or not pool_rate:
            continue
        step, pool = b / rate, b / pool_rate  # seconds a step, and of it the pool's
        per_layer = pool / n
        rest = max(step - pool, 0.0)
        full_step = rest * scale + per_layer * n_full
        touched = touched_experts(E, k, b)
        out[f"b{b}_pool_ms_per_moe_layer"] = per_layer * 1e3
        out[f"b{b}_floor_ms_per_moe_layer"] = touched * one / bw * 1e3
        out[f"b{b}_rest_ms_per_step"] = rest * 1e3
        out[f"b{b}_full_depth_tok_s"] = b / full_step
        out[f"b{b}_full_depth_floor_tok_s"] = b * bw / (touched * one * n_full)
    return out


def run_hybrid(cfg, fmt, shared, a, dtype, sync: str | None = None, full=None) -> dict:
    t0 = time.perf_counter()
    opts = {
        "sync": sync,
        "fmt": fmt,
        "num_threads": a.threads,
        "cpu_experts": "all",
        "gpu_experts": a.gpu_experts,
        "rebalance_after_tokens": 0,  # the first N experts stay on the GPU: runs compare
        "expert_cache": False,  # a benchmark of compute: no conversion cache written
        "spin_us": a.spin_us,
    }
    model = build_model(cfg, dtype=dtype, device=a.device, attn_backend=a.attention_backend,
                        expert_backend="cpu_pool",
                        expert_options=opts)  # fmt: skip
    backend = model.expert_backend
    # GPT-OSS: the pool takes a block's expert biases when it takes its experts
    init_dummy_weights(model, select=lambda name: name.endswith(("w13_bias", "w2_bias")))
    for block in model.modules():
        if hasattr(block, "w13") and getattr(block, "backend", None) is backend:
            block.w13 = nn.Parameter(shared[0], requires_grad=False)
            block.w2 = nn.Parameter(shared[1], requires_grad=False)
            backend.add_block(block)  # converts into the pool, frees the torch copy
    backend.confine()  # as attach does (TANDEM_POOL_CONFINE)
    init_dummy_weights(model)  # everything else (the expert tensors are empty now)
    apply_fast_linears(model, a.device, dtype)  # as load_model does
    load_s = time.perf_counter() - t0
    runner = Runner(model, cfg, a.device, dtype, num_blocks(a), max_len(a))
    name = f"hybrid_{fmt}" + (f"_{sync}" if sync else "")
    on_cuda = runner.device.type == "cuda"
    # on CUDA the sweep below measures prefill per --gpu-prefill mode: not measured twice
    results = measure_modes(runner, a, name, prefill=not on_cuda)
    if on_cuda:
        sweep = prefill_sweep(runner, backend, a)
        for res in results.values():
            res["prefill_by_mode"] = sweep
        print_sweep(name, sweep, floors(cfg, fmt, a), a)
    if a.profile:
        profile_decode(runner, a, f"hybrid_{fmt}")
    s = backend.stats()
    info = backend.pool.info()
    for res in results.values():
        res.update(
            load_s=load_s,
            pool_GB=sum(info["bytes_per_format"].values()) / 1e9,
            isa=info["isa"],
            pack_rows=info["pack_rows"],
            threads=info["num_threads"],
            pool_wait_s=s.pool_wait_seconds,  # all modes together
            d2h_GB=s.d2h_bytes / 1e9,
            h2d_GB=s.h2d_bytes / 1e9,
            pool_utilisation=s.pool_utilisation,
            stream_errors=s.stream_errors,
            pool_sync=backend.sync,
        )
        res.update(floors(cfg, fmt, a))
        scale = a.measured_gbps / a.floor_gbps
        for key in [k for k in res if k.endswith("_floor_tok_s")]:
            res[key.replace("_floor_tok_s", "_floor_measured_tok_s")] = res[key] * scale
        res["cpu_read_gbps"] = a.measured_gbps
        res["extrapolated"] = extrapolate(res, cfg, full or cfg, fmt, a)
    backend.close()
    del model, runner
    return results


def dense_step_bytes(cfg: ModelConfig) -> float:
    """bf16 bytes a decode step reads besides the routed experts, from the config alone: every
    layer's attention (q/k/v/o and their biases), norms, router, shared expert (and its gate) or
    dense MLP, the final norm and the LM head; not the embedding rows a step looks up (a tied
    table is the LM head, read in full)."""
    h, hd = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    attn = h * (q + 2 * kv) + q * h + (q + 2 * kv if cfg.attention_bias else 0)
    attn += 2 * hd if cfg.qk_norm else 0
    total = 0
    for i in range(cfg.num_hidden_layers):
        total += attn + 2 * h  # and the two norms
        if cfg.is_moe_layer(i):
            total += cfg.num_experts * h  # router
            if cfg.shared_expert_intermediate_size:
                total += 3 * h * cfg.shared_expert_intermediate_size + h
            total += 3 * h * cfg.moe_intermediate_size * cfg.n_shared_experts  # DeepSeek, GLM
        else:
            total += 3 * h * cfg.intermediate_size
    return 2.0 * (total + h + cfg.vocab_size * h)


def gpu_step_bytes(cfg: ModelConfig, batch: int) -> float:
    """Bytes a decode step of `batch` sequences reads with every weight on the GPU (bf16): the
    dense part and the experts it touches under uniform routing. One formula for this tool and
    tools/device/gpu-serving.sh's summary."""
    one = expert_bytes(cfg.hidden_size, cfg.moe_intermediate_size, "bf16")
    touched = touched_experts(cfg.num_experts, cfg.num_experts_per_tok, batch)
    return dense_step_bytes(cfg) + touched * one * moe_layers(cfg)


def gpu_floors(cfg: ModelConfig, a: argparse.Namespace, gbps: float) -> dict:
    """Decode floors with every weight on the GPU: `gpu_step_bytes` over the device's measured
    copy bandwidth."""
    return {
        "gpu_copy_gbps": gbps,
        "decode_b1_floor_tok_s": gbps * 1e9 / gpu_step_bytes(cfg, 1),
        f"decode_b{a.batch}_floor_tok_s": a.batch * gbps * 1e9 / gpu_step_bytes(cfg, a.batch),
    }


def run_gpu_all(cfg, a, dtype) -> dict:
    """The same model with every expert on the GPU (bf16, --gpu-all-backend), where it fits."""
    from tools.bench_gpu import copy_bandwidth_gbps

    on_cuda = torch.device(a.device).type == "cuda"
    gbps = copy_bandwidth_gbps() if on_cuda else a.measured_gbps
    t0 = time.perf_counter()
    model = build_model(
        cfg,
        dtype=dtype,
        device=a.device,
        attn_backend=a.attention_backend,
        expert_backend=a.gpu_all_backend,
    )
    init_dummy_weights(model)
    apply_fast_linears(model, a.device, dtype)
    load_s = time.perf_counter() - t0
    runner = Runner(model, cfg, a.device, dtype, num_blocks(a), max_len(a))
    results = measure_modes(runner, a, f"gpu_all_bf16_{a.gpu_all_backend}")
    if a.profile:
        profile_decode(runner, a, f"gpu_all_bf16_{a.gpu_all_backend}")
    fl = gpu_floors(cfg, a, gbps)
    for res in results.values():
        res.update(fl, load_s=load_s, expert_calls=dict(getattr(model.expert_backend, "calls", {})))
    del model, runner
    if on_cuda:
        torch.cuda.empty_cache()
    return results


def run_hf(cfg: ModelConfig, a: argparse.Namespace) -> dict:
    """The peer: HF transformers' model of the same architecture and shape, random bf16 weights
    on the GPU, `generate` with its dynamic cache (eager), per experts implementation in
    --hf-experts.
    Decode rate = N / (time(prompt + N + 1 tokens) - time(prompt + 1 token)) at batch 1 and
    at --batch; prefill = --prefill / time(prompt + 1 token)."""
    import transformers as hf

    from tandem.models.hf_export import to_hf_config_dict

    d = to_hf_config_dict(cfg)
    model_type = d.pop("model_type")
    d.pop("architectures")
    hcfg = hf.AutoConfig.for_model(model_type, **d)
    hcfg.eos_token_id, hcfg.pad_token_id = None, 0
    t0 = time.perf_counter()
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(a.device):
            model = hf.AutoModelForCausalLM.from_config(hcfg)  # random init on the device
    finally:
        torch.set_default_dtype(default_dtype)
    model = model.eval().requires_grad_(False)
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = None, 0
    load_s = time.perf_counter() - t0
    gen = torch.Generator().manual_seed(3)
    n = a.decode_steps

    class Clock(hf.StoppingCriteria):  # the time of every generated token (never stops)
        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kw) -> torch.Tensor:
            _sync(a.device)
            self.times.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    def timed(batch: int, prompt: int, new: int) -> list[float]:
        """Times of generate's start and of each of its `new` tokens."""
        ids = torch.randint(0, cfg.vocab_size, (batch, prompt), generator=gen).to(a.device)
        clock = Clock()
        _sync(a.device)
        t = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                             min_new_tokens=new, do_sample=False, disable_compile=True,
                             stopping_criteria=hf.StoppingCriteriaList([clock]))  # fmt: skip
        assert out.shape == (batch, prompt + new) and len(clock.times) == new, out.shape
        return [t, *clock.times]

    def decode_tok_s(batch: int) -> float:
        """Decode tokens a second: the steps after the first token (prefill excluded)."""
        times = timed(batch, a.prompt, n + 1)
        return batch * n / (times[-1] - times[1])

    results: dict[str, dict] = {}
    picked = getattr(model.config, "_experts_implementation", None)  # HF's own choice
    for impl in dict.fromkeys(picked if i == "default" else i for i in a.hf_experts):
        name = f"hf_transformers_{impl}" + ("_default" if impl == picked else "")
        try:
            if impl != picked:
                model.set_experts_implementation(impl)
            res: dict = {"load_s": load_s, "transformers": hf.__version__}
            res["experts_implementation"] = getattr(model.config, "_experts_implementation", None)
            timed(1, a.prompt, 2)  # warm-up
            res["decode_b1_tok_s"] = decode_tok_s(1)
            res[f"decode_b{a.batch}_tok_s"] = decode_tok_s(a.batch)
            start, first = timed(1, a.prefill, 1)
            res["prefill_tok_s"] = a.prefill / (first - start)
        except Exception as e:  # noqa: BLE001 - a peer that fails is reported, not fatal
            res = {"error": f"{type(e).__name__}: {e}"}
        results[name] = res
        print(f"# {name}: {res}", flush=True)
    model = None  # free the device
    if torch.device(a.device).type == "cuda":
        torch.cuda.empty_cache()
    return results


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    cfg = model_config(a)
    dtype = torch.bfloat16 if torch.device(a.device).type == "cuda" else torch.float32
    print(f"# {cfg.num_hidden_layers} layers, {cfg.num_experts} experts top-"
          f"{cfg.num_experts_per_tok}, hidden {cfg.hidden_size}, expert inter "
          f"{cfg.moe_intermediate_size}; device {a.device}"
          + (f" ({torch.cuda.get_device_name()})" if a.device == "cuda" else ""), flush=True)  # fmt: skip
    # Machine instances of one kind differ (BENCHMARKS: the pool's job took 294 us a layer on
    # one, 416-482 on another), so floors are also given at the rate read now, past the L3.
    on_cuda = torch.device(a.device).type == "cuda"
    threads = a.threads or (
        default_cuda_pool_threads() if on_cuda else max(1, (os.cpu_count() or 2) - 1)
    )
    gbps = read_bandwidth_gbps(threads)
    if a.floor_gbps is None:
        a.floor_gbps = gbps
    print(f"# CPU read bandwidth now: {gbps:.1f} GB/s ({threads} threads, "
          f"tools/peers/cpu_bandwidth.c); floors below use {a.floor_gbps:g} GB/s "
          "(measured-rate floors in the JSON: *_floor_measured_tok_s)", flush=True)  # fmt: skip
    a.measured_gbps = gbps
    t0 = time.perf_counter()
    shared = shared_layer(cfg) if a.formats else None  # the pool runs' expert layer
    print(f"# random expert layer: {time.perf_counter() - t0:.1f}s", flush=True)
    results: dict[str, dict] = {}

    def show(runs: dict[str, dict]) -> None:
        for name, r in runs.items():
            print(f"{name}: " + json.dumps({k: round(v, 3) if isinstance(v, float) else v
                                            for k, v in r.items()}), flush=True)  # fmt: skip
        results.update(runs)

    full = a.full_config
    for fmt in a.formats:
        cfg_fmt = fit_ram(full, fmt, a) if a.fit_ram else cfg
        for sync in a.pool_sync:
            show(run_hybrid(cfg_fmt, fmt, shared, a, dtype, sync, full))
    del shared
    if a.gpu_all:
        show(run_gpu_all(cfg, a, dtype))
    if a.hf:
        show(run_hf(cfg, a))
    print()
    b = a.batch
    print(
        f"| experts | decode b=1 tok/s (floor) | decode b={b} agg tok/s (floor) "
        f"| prefill {a.prefill} tok/s (floor) |"
    )
    print("|---|---|---|---|")
    for name, r in results.items():

        def cell(key: str, r: dict = r) -> str:
            if key not in r:
                return "-"
            floor = r.get(key.replace("_pool", "").replace("_tok_s", "_floor_tok_s"))
            return f"{r[key]:.1f}" + (f" ({floor:.1f}, {r[key] / floor:.0%})" if floor else "")

        print(f"| {name} | {cell('decode_b1_tok_s')} | {cell(f'decode_b{b}_tok_s')} "
              f"| {cell('prefill_tok_s')} |")  # fmt: skip
        if "decode_b1_pool_tok_s" in r:
            print(f"| {name}, pool time only | {cell('decode_b1_pool_tok_s')} "
                  f"| {cell(f'decode_b{b}_pool_tok_s')} | {cell('prefill_pool_tok_s')} |")  # fmt: skip
    for name, r in results.items():
        if "decode_b1_floor_measured_tok_s" in r:
            m = r["decode_b1_floor_measured_tok_s"]
            print(f"# {name}: decode b=1 {r['decode_b1_tok_s']:.1f} tok/s = "
                  f"{r['decode_b1_tok_s'] / m:.0%} of its floor at the measured "
                  f"{r['cpu_read_gbps']:.1f} GB/s ({m:.1f} tok/s)")  # fmt: skip
    for name, r in results.items():
        x = r.get("extrapolated")
        if not x:
            continue
        for bs in (1, b):
            if f"b{bs}_full_depth_tok_s" not in x:
                continue
            print(f"# {name} b={bs}: {x['moe_layers']} MoE of {x['layers']} layers; pool "
                  f"{x[f'b{bs}_pool_ms_per_moe_layer']:.2f} ms a MoE layer (floor "
                  f"{x[f'b{bs}_floor_ms_per_moe_layer']:.2f}), the rest "
                  f"{x[f'b{bs}_rest_ms_per_step']:.2f} ms a step; at {x['full_layers']} layers: "
                  f"{x[f'b{bs}_full_depth_tok_s']:.2f} tok/s (floor "
                  f"{x[f'b{bs}_full_depth_floor_tok_s']:.2f})")  # fmt: skip
    if a.json:
        a.json.write_text(json.dumps({"args": vars(a) | {"json": str(a.json)}, "results": results},
                                     indent=2, default=str))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""What the "cpu_pool" expert backend reads from its options and the environment: the expert
formats, --cpu-experts / --gpu-experts placement counts, --gpu-prefill, the pool's sync, confine
and spin settings, and its worker count on CUDA. No tensors."""

from __future__ import annotations

import os

FORMATS = ("bf16", "int8", "int4", "auto")  # auto: from the GGUF type (bf16 otherwise)
# "auto" for MXFP4 experts (GPT-OSS, safetensors or GGUF): int8 rows. The e2m1 grid is not
# uniform, so int4 (groups of 32, the same blocks) adds 6.5-7.5% relative L2 error to the
# checkpoint's own weights where int8 adds 0.75-4.3%, for 1.6x the bytes (docs/gpt-oss.md).
MXFP4_POOL_FORMAT = "int8"
SYNC_ENV = "TANDEM_POOL_SYNC"
# The router + the pool's input staging in one CUDA kernel (route_and_start); 0: torch router
FUSED_MOE_STAGE = os.environ.get("TANDEM_FUSED_MOE_STAGE", "1") != "0"
SYNC_MODES = ("flags", "host_func")
# Prefill-sized steps on CUDA: the layer's packed experts go to the GPU and are computed there
# (models/layers/gpu_prefill.py) from this many tokens; "auto": GPU_PREFILL_TOKENS by format,
# "off" (or 0): never.
GPU_PREFILL_ENV = "TANDEM_GPU_PREFILL"
# On CUDA, once the experts are in: the process's other threads (interpreter, event loop, CUDA
# driver) confined to the cpus the pool's workers leave (auto = on | off; see `confine`).
CONFINE_ENV = "TANDEM_POOL_CONFINE"
# Where shipping a whole layer over PCIe (~55 GB/s) beats the pool, Qwen3-30B-A3B shape on the
# device (docs/BENCHMARKS.md, "GPU prefill from the pool's weights"): a layer of int4 experts is
# ~320 MB (6 ms), int8 ~620 MB, bf16 ~1.2 GB (22 ms), against the pool's time at that many
# tokens (measured: int4 pool ahead at 300 tokens, behind at 512; int8 ahead at 512, behind at
# 1024; bf16 about even at 1024).
GPU_PREFILL_TOKENS = {"int4": 384, "int8": 640, "bf16": 1024}
# Never at or below the largest decode graph (runtime/cuda_graphs.py: 256 rows): a graph's
# eager warm-up and its capture must take the same path (the pool's, inside graphs).
GPU_PREFILL_MIN_TOKENS = 257


def parse_gpu_prefill(value: str | int | None) -> int | None:
    """'auto' / None -> None (by format); 'off' -> 0; N -> N (>= 0)."""
    if value is None or value == "auto":
        return None
    if value == "off":
        return 0
    try:
        n = int(value)
    except (TypeError, ValueError):
        n = -1
    if n < 0:
        raise ValueError(f"gpu_prefill must be 'auto', 'off' or a token count >= 0, got {value!r}")
    return n


def parse_cpu_experts(value: str | int | None) -> int | None:
    """'all' / None -> None (every expert not placed on the GPU); 'N' or N -> N."""
    if value is None or (isinstance(value, str) and value.strip().lower() == "all"):
        return None
    try:
        n = int(value)
    except (TypeError, ValueError):
        n = -1
    if n < 0:
        raise ValueError(f"cpu_experts must be 'all' or a non-negative int, got {value!r}")
    return n


def num_gpu_experts(
    num_experts: int, cpu_experts: str | int | None, gpu_experts: int | None
) -> int:
    """How many of a layer's experts stay on the GPU. `gpu_experts` wins; `cpu_experts=N`
    alone leaves E - N on the GPU; both given must add up to E ('all' takes the rest)."""
    cpu_n = parse_cpu_experts(cpu_experts)
    if gpu_experts is not None and gpu_experts < 0:
        raise ValueError(f"gpu_experts must be >= 0, got {gpu_experts}")
    if cpu_n is not None and cpu_n > num_experts:
        raise ValueError(
            f"cpu_experts={cpu_n} exceeds the {num_experts} experts of a layer "
            "(use cpu_experts='all')"
        )
    if gpu_experts is not None and gpu_experts > num_experts:
        raise ValueError(f"gpu_experts={gpu_experts} exceeds the {num_experts} experts of a layer")
    if gpu_experts is None:
        gpu = 0 if cpu_n is None else num_experts - min(cpu_n, num_experts)
    else:
        gpu = min(gpu_experts, num_experts)
        if cpu_n is not None and cpu_n + gpu != num_experts:
            raise ValueError(
                f"cpu_experts={cpu_n} + gpu_experts={gpu} must equal the {num_experts} experts "
                "of a layer (or use cpu_experts='all')"
            )
    return gpu


# Pool workers' spin before sleeping when the model is on CUDA: a layer's GPU part and the
# transfers between two pool jobs take 0.1-0.2 ms at batch 1, about the pool's default spin
# (200 us), and a worker that fell asleep costs a wake-up at the next layer (Qwen3-30B-A3B
# shape, int4, 12 workers: 19.1 tok/s with 200 us, 25.6 with 2000 us, same device call).
CUDA_SPIN_US = 2000
# With the model on the CPU the forward waits for each layer's job, and the next job comes only
# after torch's threads have run the next layer's attention on the same cores: workers spinning
# then only slow that down. They sleep at once instead (2-core VM, upcycled SmolLM2, int4:
# batch-1 decode 25-27 tok/s spinning 200 us, 32-34 with 0; on the 16-core device the same A/B
# swung too widely between repeats to read; docs/BENCHMARKS.md, session 6).
CPU_SPIN_US = 0
# Overrides the workers' spin (microseconds) either way.
SPIN_ENV = "TANDEM_POOL_SPIN_US"


def spin_us_from_env() -> int | None:
    raw = os.environ.get(SPIN_ENV, "").strip()
    if not raw:
        return None
    if not raw.isdigit():
        raise ValueError(f"{SPIN_ENV} must be a non-negative integer (microseconds), got {raw!r}")
    return int(raw)


def default_cuda_pool_threads() -> int:
    """Pool workers when the model runs on CUDA: every usable core but two. The thread that
    starts the pool's jobs (the poller of flag jobs, or the CUDA driver's host-function thread)
    and the engine's thread need cores of their own; with one worker per core but one, a
    descheduled worker stalls each layer's job (Qwen3-30B-A3B shape, int4, 16 cores: batch-1 decode 8.3 tok/s with 15 workers, 28.4 with
    14, 24.9 with 12; docs/BENCHMARKS.md "Hybrid MoE")."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    return max(1, cpus - 2)

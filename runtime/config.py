"""Frozen, composed configuration: EngineConfig holds model, cache and scheduler configs.

Values discovered at start-up (the number of KV blocks) live in `CacheLayout`, not here.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    enable_prefix_caching: bool = True
    # GPU: fraction of device memory the engine may use (weights + activations + KV).
    gpu_memory_utilization: float = 0.9
    # CPU: KV budget in bytes (ignored on CUDA). 0 means: derive from max_num_seqs x max_model_len.
    cpu_kv_bytes: int = 0
    # Explicit number of blocks (tests, benchmarks); overrides both budgets when set.
    num_blocks: int | None = None


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048  # token budget per step: decodes + prefill chunks
    max_model_len: int | None = None  # None: the model's own, capped by what the KV cache holds
    policy: str = "fcfs"  # "fcfs" or "priority"
    long_prefill_token_threshold: int = 0  # 0: a prefill chunk may take the whole budget


@dataclass(frozen=True)
class ModelSpec:
    """What to load: an HF directory, a .gguf file, or a known name; and how."""

    model: str | None = None  # None: the default model
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    load_format: str = "auto"  # auto | safetensors | gguf | dummy
    device: str = "auto"  # auto | cpu | cuda
    seed: int = 0  # for dummy weights
    attention_backend: str = "auto"  # auto | torch | cpu | cupy
    # Batch-invariant ops: a sequence's greedy output the same alone and in any batch (CUDA:
    # fixed-shape GEMMs and one attention kernel, at a cost; CPU bf16: the default already).
    deterministic: bool = False
    expert_backend: str = "auto"  # auto | torch | gpu | cpu_pool
    cpu_experts: str | None = None  # "all" or a number per layer
    gpu_experts: int | None = None
    cpu_threads: int | None = None
    cpu_expert_format: str = "auto"  # auto | bf16 | int8 | int4: experts' format in the CPU pool
    # (auto: a GGUF's quantized type as int4/int8, bf16 for float checkpoints)
    cpu_expert_group_size: int | None = None  # int4 groups of converted experts (None: 64)
    gpu_prefill: str | None = None  # auto | off | N tokens: CPU-pool layers computed on the GPU
    quantization: str = "auto"  # auto | none | gguf | gptq | awq | fp8: which stay packed
    dequantize: bool = False  # True: every weight dequantized to dtype at load (quantization none)
    tokenizer_path: str | None = None  # a tokenizer directory or .gguf (None: the model's own)
    chat_template: str | None = None  # jinja2 template text replacing the tokenizer's
    tensor_parallel_size: int = 1  # processes (one per GPU) the model's layers are split over


@dataclass(frozen=True)
class EngineConfig:
    model: ModelSpec = field(default_factory=ModelSpec)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    seed: int | None = None  # seeds torch's global RNG: requests without their own seed


@dataclass(frozen=True)
class CacheLayout:
    """Discovered at start-up from memory: how many KV blocks the pool has."""

    num_blocks: int
    block_size: int
    bytes_per_block: int
    # A model with windowed and full layers: the windowed layers' own pool (0: none) and the
    # bytes one of its blocks takes over those layers; `bytes_per_block` then counts the
    # full layers only.
    num_window_blocks: int = 0
    bytes_per_window_block: int = 0

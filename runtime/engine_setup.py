"""What the engine decides once, at start-up: device and dtype, attention and expert
backends, the model and tokenizer to load, and how many KV blocks fit.

Kept apart from `runtime/engine.py`, which owns the per-step loop and request bookkeeping.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from tandem.models.batch import KVCache
from tandem.runtime.config import CacheLayout, EngineConfig, ModelSpec, SchedulerConfig

if TYPE_CHECKING:
    from tandem.models.config import ModelConfig

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DEFAULT_CPU_KV_BYTES = 1 << 30


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise ValueError(f"unknown device {name!r}; choose auto, cpu or cuda") from e
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r}: no CUDA device is available here (use --device cpu)")
    return device


def check_expert_options(spec: ModelSpec, device: torch.device, config: ModelConfig) -> None:
    """The MoE placement options (cpu_experts, gpu_experts) against the model and the device,
    before any weight is read: a ValueError that names the option where one cannot apply
    (a dense model, more experts than a layer has, experts "on the GPU" without one, the
    pool's format or threads without the pool, which they would silently not reach; a
    --gpu-prefill token count without a GPU)."""
    gpu_prefill = None  # auto; 0: off; N: steps of N+ tokens compute pool layers on the GPU
    if spec.gpu_prefill is not None:
        from tandem.models.layers.cpu_expert_options import parse_gpu_prefill

        gpu_prefill = parse_gpu_prefill(spec.gpu_prefill)
    pool_options = [
        flag
        for flag, given in (
            ("--cpu-expert-format", spec.cpu_expert_format != "auto"),
            ("--cpu-threads", spec.cpu_threads is not None),
            ("--cpu-expert-group-size", spec.cpu_expert_group_size is not None),
            ("--gpu-prefill", bool(gpu_prefill)),
        )
        if given
    ]
    pool_asked = spec.cpu_experts is not None or spec.gpu_experts is not None
    if pool_options and not config.is_moe:
        raise ValueError(
            f"{'/'.join(pool_options)} only apply to mixture-of-experts models; "
            f"{config.architecture} is dense"
        )
    if pool_options and not pool_asked and spec.expert_backend != "cpu_pool":
        raise ValueError(
            f"{'/'.join(pool_options)} only apply to the CPU expert pool, which --cpu-experts "
            "selects: add --cpu-experts all"
        )
    if spec.cpu_expert_group_size is not None and spec.cpu_expert_format != "int4":
        raise ValueError(
            "--cpu-expert-group-size applies to int4 experts: add --cpu-expert-format int4"
        )
    if gpu_prefill and device.type != "cuda":
        raise ValueError(
            f"--gpu-prefill {gpu_prefill} computes the pool's layers on the GPU, but the model "
            f"runs on {device.type}: leave it out (or 'off') without a GPU"
        )
    if not pool_asked:
        return
    cpus = allowed_cpu_count()
    if spec.cpu_threads is not None and (
        isinstance(spec.cpu_threads, bool)
        or not isinstance(spec.cpu_threads, int)
        or spec.cpu_threads < 1
    ):
        raise ValueError(f"--cpu-threads must be a positive integer, got {spec.cpu_threads!r}")
    if spec.cpu_threads is not None and spec.cpu_threads > cpus:
        raise ValueError(
            f"--cpu-threads {spec.cpu_threads} exceeds the {cpus} cpus this process may use "
            "(workers would share cpus, which slows every layer down)"
        )
    if not config.is_moe:
        raise ValueError(
            f"--cpu-experts/--gpu-experts apply to mixture-of-experts models; "
            f"{config.architecture} is dense"
        )
    from tandem.models.layers.cpu_expert_options import num_gpu_experts

    gpu = num_gpu_experts(
        config.num_experts,
        "all" if spec.cpu_experts is None else spec.cpu_experts,
        spec.gpu_experts,
    )
    if gpu and device.type != "cuda":
        raise ValueError(
            f"{gpu} experts a layer would stay on the GPU, but the model runs on {device.type}: "
            "use --cpu-experts all (and no --gpu-experts) without a GPU"
        )


def clamp_pool_threads(
    requested: int | None, device: torch.device, cpus: int | None = None
) -> int | None:
    """The CPU expert pool's thread count for `--cpu-threads requested` (None: the pool's
    default). Pool workers spin on their cores, so every core given to them is taken from the
    engine's thread (and, on CUDA, the thread that starts the pool's jobs): a request for more
    than the cores left over (cpus - 1, on CUDA cpus - 2) is clamped with a warning (16 of 16
    cores once made hybrid decode 17x slower)."""
    if requested is None:
        return None
    cpus = allowed_cpu_count() if cpus is None else cpus
    usable = max(1, cpus - (2 if device.type == "cuda" else 1))
    if requested > usable:
        log.warning(
            "--cpu-threads %d would leave the engine no core of its own: using %d (of the %d "
            "cpus this process may use, %d stay for the engine%s)",
            requested, usable, cpus, cpus - usable,
            " and the pool's job thread" if device.type == "cuda" else "",
        )  # fmt: skip
        return usable
    return requested


def allowed_cpu_count() -> int:
    """The cpus this process may run on (its affinity mask, as the CPU expert pool counts them)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def cpu_has_fast_bf16() -> bool:
    """AVX-512 BF16 or AMX: bf16 matmuls run at least as fast as fp32 on half the bytes."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " avx512_bf16" in flags or " amx_bf16" in flags


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        # Decode is memory-bound: bf16 halves the bytes read per token. On a CPU without
        # native bf16 dot products the conversions cost more than they save, so keep fp32.
        if device.type == "cuda" or cpu_has_fast_bf16():
            return torch.bfloat16
        return torch.float32
    if name not in _DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; choose one of {', '.join(_DTYPES)}")
    return _DTYPES[name]


def load_engine_model(
    spec: ModelSpec,
    device: torch.device,
    dtype: torch.dtype,
    model_config: ModelConfig | None,
) -> tuple[torch.nn.Module, ModelConfig, Path | None]:
    """Resolve `spec.model` (fetching the default model on first use) and load it with the
    backends this device and dtype call for. Returns the model, its config and its path
    (None for dummy weights of a given config)."""
    from tandem.models.hub import resolve_model
    from tandem.models.loader import load_model

    model_path = None
    if not (spec.load_format == "dummy" and model_config is not None):
        model_path = resolve_model(spec.model)
    if model_config is None and model_path is not None:
        from tandem.models.loader import read_model_config

        model_config = read_model_config(model_path, spec.load_format)
    if model_config is not None:
        check_expert_options(spec, device, model_config)
    attn = spec.attention_backend
    if attn == "auto":
        attn = _auto_attention_backend(device, dtype, model_config)
    experts = spec.expert_backend
    if experts == "auto":  # the CPU pool when asked for; on CUDA every expert on the GPU
        asked = spec.cpu_experts is not None or spec.gpu_experts is not None
        experts = "cpu_pool" if asked else _auto_expert_backend(device)
        if spec.tensor_parallel_size > 1 and not asked:
            experts = "torch"  # the backend expert parallelism shards
    expert_options: dict[str, Any] | None = None
    if experts == "cpu_pool":
        expert_options = {
            "fmt": spec.cpu_expert_format,
            "group_size": spec.cpu_expert_group_size,
            "num_threads": clamp_pool_threads(spec.cpu_threads, device),
            "cpu_experts": "all" if spec.cpu_experts is None else spec.cpu_experts,
            "gpu_experts": spec.gpu_experts,
            "gpu_prefill": spec.gpu_prefill,
            # keys the expert cache by checkpoint path, size and mtime
            "cache_source": str(model_path) if model_path is not None else None,
        }
    model, model_config = load_model(
        model_path,
        dtype=dtype,
        device=device,
        load_format=spec.load_format,
        attn_backend=attn,
        expert_backend=experts,
        seed=spec.seed,
        config=model_config,
        expert_options=expert_options,
        quantization="none" if spec.dequantize else spec.quantization,
        deterministic=spec.deterministic,
    )
    return model, model_config, model_path


def load_tokenizer(model_path: Path, load_format: str = "auto", vocab_size: int | None = None):
    """The tokenizer next to the weights. Where there is none: for dummy weights a synthetic
    byte-level one of `vocab_size` (models.tokenizer.Tokenizer.synthetic), else None (the
    engine then takes token ids only)."""
    from tandem.models.tokenizer import Tokenizer

    if model_path.suffix == ".gguf":
        return Tokenizer.from_gguf(model_path)
    if (model_path / "tokenizer.json").exists() or (model_path / "tokenizer_config.json").exists():
        return Tokenizer.from_pretrained(model_path)
    if load_format == "dummy" and vocab_size is not None:
        log.warning(
            "no tokenizer in %s: dummy weights get a synthetic byte-level tokenizer "
            "(ids 0-255 are bytes, id N >= 256 reads ' tN')",
            model_path,
        )
        return Tokenizer.synthetic(vocab_size)
    log.warning("no tokenizer found in %s: token ids only", model_path)
    return None


def resolve_tokenizer(
    spec: ModelSpec, model_path: Path | None, vocab_size: int, tokenizer: Any = None
) -> Any:
    """The tokenizer the engine uses: a prebuilt one, `spec.tokenizer_path`'s, or the model's own;
    with `spec.chat_template` replacing its chat template."""
    if tokenizer is None and spec.tokenizer_path:
        path = Path(spec.tokenizer_path).expanduser()
        if not path.exists():
            raise FileNotFoundError(f"tokenizer path '{spec.tokenizer_path}' does not exist")
        tokenizer = load_tokenizer(path, "auto", vocab_size)
        if tokenizer is None:
            raise ValueError(
                f"no tokenizer in '{spec.tokenizer_path}': --tokenizer takes a directory holding "
                "tokenizer.json or a .gguf file"
            )
    elif tokenizer is None and model_path is not None:
        tokenizer = load_tokenizer(model_path, spec.load_format, vocab_size)
    if spec.chat_template is not None:
        from tandem.models.tokenizer import _compile_template

        if tokenizer is None:
            raise ValueError("--chat-template needs a tokenizer, and this model has none")
        try:
            _compile_template(spec.chat_template)
        except Exception as e:
            raise ValueError(f"--chat-template does not compile: {e}") from None
        tokenizer.chat_template = spec.chat_template
    return tokenizer


def resolve_max_model_len(requested: int | None, model_config: ModelConfig) -> int:
    """The longest sequence to serve: `requested` (None: the model's own). More positions than
    the model has are refused, not clamped."""
    positions = model_config.max_context
    if requested is not None and requested > positions:
        raise ValueError(
            f"--max-model-len {requested} is more than this model allows "
            f"(max_position_embeddings={positions}); leave it out to use the model's own"
        )
    if requested is not None and requested < 1:
        raise ValueError(f"--max-model-len must be at least 1, got {requested}")
    return positions if requested is None else requested


def served_model_len(
    requested: int | None, max_model_len: int, num_blocks: int, block_size: int
) -> int:
    """The longest sequence served: the model's own length (none `requested`) is capped by what
    `num_blocks` hold (one block kept spare), an asked-for one is not."""
    held = (num_blocks - 1) * block_size
    return min(max_model_len, held) if requested is None else max_model_len


def size_kv_cache(
    config: EngineConfig,
    model: torch.nn.Module,
    model_config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    max_model_len: int,
) -> CacheLayout:
    """KV blocks from an explicit count, from free GPU memory after weights and a profiled
    peak (`gpu_memory_utilization`), or from the CPU byte budget."""
    cfg, mc = config.cache, model_config
    tp = config.model.tensor_parallel_size
    # the windowed layers' own pool (the same count on every tensor-parallel rank)
    window_blocks = window_pool_blocks(mc, cfg.block_size, config.scheduler)
    group = len(mc.window_group_layers) if window_blocks else 0
    per_block = KVCache.bytes_per_block_for(
        mc, cfg.block_size, dtype, tp, mc.num_hidden_layers - group
    )  # this rank's heads; the full layers' where the windowed ones have a pool of their own
    per_window_block = KVCache.bytes_per_block_for(mc, cfg.block_size, dtype, tp, group)
    window_bytes = window_blocks * per_window_block
    min_blocks = -(-max_model_len // cfg.block_size) + 1
    if cfg.num_blocks is not None:
        num_blocks = cfg.num_blocks
    elif device.type == "cuda":
        reserve = _profile_activation_bytes(config, model, model_config, dtype, device)
        free, total = torch.cuda.mem_get_info(device)
        used = total - free
        budget = int(total * cfg.gpu_memory_utilization) - used - reserve - window_bytes
        num_blocks = max(budget // per_block, 0)
    else:
        budget = (cfg.cpu_kv_bytes or _DEFAULT_CPU_KV_BYTES) - window_bytes
        num_blocks = max(budget // per_block, 2 * min_blocks)
    if num_blocks < min_blocks:
        raise ValueError(
            f"KV cache too small: {num_blocks} blocks of {cfg.block_size} tokens cannot hold "
            f"one sequence of max_model_len={max_model_len}; lower --max-model-len or "
            f"raise the KV budget"
        )
    log.info(
        "KV cache: %d blocks x %d tokens (%.1f MiB)%s",
        num_blocks,
        cfg.block_size,
        num_blocks * per_block / 2**20,
        f"; {group} windowed layers: {window_blocks} blocks of their own "
        f"({window_bytes / 2**20:.1f} MiB)"
        if window_blocks
        else "",
    )
    return CacheLayout(
        num_blocks=int(num_blocks), block_size=cfg.block_size, bytes_per_block=per_block,
        num_window_blocks=window_blocks, bytes_per_window_block=per_window_block,
    )  # fmt: skip


def window_pool_blocks(mc: ModelConfig, block_size: int, sched: SchedulerConfig) -> int:
    """Blocks of the windowed layers' own pool (0: the model has none): every running
    sequence's window and a block either side, plus one step's tokens, plus the null block.
    The scheduler still preempts should it run dry (it does not, in this size)."""
    if not mc.window_group_layers:
        return 0
    assert mc.sliding_window is not None
    per_seq = -(-(mc.sliding_window - 1) // block_size) + 2
    step = -(-sched.max_num_batched_tokens // block_size)
    return sched.max_num_seqs * per_seq + step + 1


def _profile_activation_bytes(config, model, model_config, dtype, device) -> int:
    from tandem.runtime.cuda_runner import profile_activation_bytes

    sc = config.scheduler
    try:
        reserve = profile_activation_bytes(
            model, model_config, dtype, device,
            sc.max_num_batched_tokens, sc.max_num_seqs, config.cache.block_size,
        )  # fmt: skip
    except torch.OutOfMemoryError:
        raise
    except Exception:  # a model the profile cannot drive: keep the coarse bound, loudly
        log.exception("activation profiling failed; reserving a coarse bound instead")
        return _activation_reserve(model_config)
    log.info("profiled peak activation + graph reserve: %.0f MiB", reserve / 2**20)
    return reserve


def _activation_reserve(mc) -> int:
    # A coarse bound until the runner profiles a real peak: logits of a full token budget plus
    # a few hidden-sized buffers per token.
    return 2 * 1024**3


def _auto_expert_backend(device) -> str:
    """ "gpu" (sync-free, graph-capturable) on CUDA, else the torch reference."""
    return "gpu" if device.type == "cuda" else "torch"


def _auto_attention_backend(device, dtype, model_config: ModelConfig | None) -> str:
    """ "cupy" on CUDA where its kernels serve this head_dim and dtype (sliding windows and
    sinks included), else "torch". On the CPU in bf16, "cpu" (the batch-invariant C++ kernel, next to the batch-invariant bf16
    linears) where the extension builds and the model has neither (float32 keeps torch's
    GEMMs, not invariant, and the torch reference)."""
    plain = model_config is None or not (
        model_config.sliding_layers or model_config.attention_sinks or model_config.is_mla
    )
    if device.type == "cpu":
        from tandem.models.attention_backend import cpu_backend_supports

        ok = plain and dtype == torch.bfloat16 and cpu_backend_supports(dtype)
        return "cpu" if ok else "torch"
    if device.type != "cuda":
        return "torch"
    from tandem.models.cupy_backend import cupy_backend_supports, cupy_backend_supports_mla

    if model_config is not None and model_config.is_mla:
        mc = model_config
        supported = cupy_backend_supports_mla(
            mc.kv_lora_rank, mc.qk_rope_head_dim, mc.num_attention_heads, dtype, device
        )
        return "cupy" if supported else "torch"

    head_dim = model_config.head_dim if model_config is not None else 128
    return "cupy" if cupy_backend_supports(head_dim, dtype, device) else "torch"

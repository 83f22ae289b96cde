"""Builds a model from a checkpoint: picks the format, reads the config, constructs the model
on the meta device, materializes it on the target device and fills its weights once.

Formats: "safetensors" (HF directory or file; models/loader/safetensors.py), "gguf"
(models/loader/gguf.py), each imported only when used; "dummy" (random weights of the config's
shapes); "auto" picks by path.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tandem.models.attention_backend import get_attention_backend
from tandem.models.config import ModelConfig, UnsupportedModelError
from tandem.models.layers.expert_registry import get_expert_backend
from tandem.models.layers.parallel import (
    Shard,
    check_tensor_parallel,
    get_tp,
    tensor_parallel_shards,
)
from tandem.models.loader.dummy import init_dummy_weights
from tandem.models.quant.hf_config import HF_QUANT_FORMATS, HfQuantConfig, read_quant_config
from tandem.models.registry import get_model_class
from tandem.models.weights import expert_layer, is_mtp

log = logging.getLogger(__name__)

LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
# "auto": a checkpoint's quantized weights stay packed where Tandem serves their format (GGUF
# Q4_0/Q4_1/Q8_0/Q4_K/Q5_K/Q6_K) with a kernel for the device and dtype (CPU bf16, CUDA
# fp16/bf16); "none": dequantize everything at load to --dtype (the old behaviour); "gguf":
# packed whatever the dtype (float32: the torch reference), an error for another format.
# "gptq" | "awq" | "fp8": an HF safetensors checkpoint of that format served packed (the format
# is read from config.json's quantization_config when it has one; these name it when not).
QUANTIZATIONS = ("auto", "none", "gguf", "gptq", "awq", "fp8")
# Dense linears of bf16 CPU models through ext/cpu's small-M kernel (models/layers/cpu_linear.py):
# "0" off, or the weight format "bf16" | "int8" | "int4". Read here and nowhere else.
CPU_LINEAR_ENV = "TANDEM_CPU_LINEAR"
# "auto" (the default): bf16 weights through the kernel where the CPU has AVX-512 BF16 or AMX
# and the extension builds, else torch, with a warning. There every M goes through the kernel's
# VNNI layout, so greedy output does not depend on the batch: docs/BENCHMARKS.md "Batch-invariant
# CPU decode".
CPU_LINEAR_DEFAULT = "auto"
# Dense linears of fp16/bf16 CUDA models at 1-2 rows (decode of one or two sequences) through
# ext/cuda's skinny GEMM (models/layers/cuda_linear.py): "auto" (the default) where CuPy is
# present, "0" off. Read here and nowhere else.
CUDA_LINEAR_ENV = "TANDEM_CUDA_LINEAR"


def cpu_linear_format() -> str | None:
    value = os.environ.get(CPU_LINEAR_ENV, CPU_LINEAR_DEFAULT).strip().lower()
    if value in ("", "0", "off", "none"):
        return None
    if value not in ("auto", "bf16", "int8", "int4"):
        raise ValueError(f"{CPU_LINEAR_ENV} must be auto, 0, bf16, int8 or int4, got {value!r}")
    return value


def _apply_cpu_linear(model: nn.Module, fmt: str) -> None:
    from tandem.models.layers.cpu_linear import use_cpu_linear

    if fmt != "auto":  # asked for by name: a failure is an error
        use_cpu_linear(model, fmt)
        return
    try:
        from tandem.ext.cpu import supported_isas

        if not {"avx512", "amx"} & set(supported_isas()):
            return  # without native bf16 dot products torch's GEMM is as good
        use_cpu_linear(model, "bf16")
    except Exception as exc:  # an optimisation only: serve with torch's linear instead
        log.warning("fast CPU linear unavailable (%s: %s); using torch", type(exc).__name__, exc)


def _apply_cpu_quant(model: nn.Module) -> None:
    from tandem.models.quant.linear import quant_modules

    if not quant_modules(model):
        return
    try:
        from tandem.models.quant.cpu import use_cpu_quant_kernels

        use_cpu_quant_kernels(model)
    except Exception as exc:  # the torch reference serves the same packed weights, slower
        log.warning(
            "CPU packed-weight kernel unavailable (%s: %s); using torch", type(exc).__name__, exc
        )


def _apply_cuda_quant(model: nn.Module) -> None:
    from tandem.ext.cuda import is_available
    from tandem.models.quant.linear import quant_modules

    if quant_modules(model) and is_available():
        from tandem.models.quant.cuda import use_cuda_quant_kernels

        use_cuda_quant_kernels(model)


def _apply_cuda_linear(model: nn.Module) -> None:
    value = os.environ.get(CUDA_LINEAR_ENV, "auto").strip().lower()
    if value in ("0", "off", "none", ""):
        return
    if value not in ("auto", "1", "on"):
        raise ValueError(f"{CUDA_LINEAR_ENV} must be auto or 0, got {value!r}")
    from tandem.ext.cuda import is_available

    if not is_available():
        return
    from tandem.models.layers.cuda_linear import use_cuda_skinny_linear

    use_cuda_skinny_linear(model)


def resolve_load_format(model_path: str | Path, load_format: str) -> str:
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"unknown load_format {load_format!r}; choose from {LOAD_FORMATS}")
    if load_format != "auto":
        return load_format
    path = Path(model_path)
    if path.suffix == ".gguf":
        return "gguf"
    if path.is_dir() or path.suffix == ".safetensors":
        return "safetensors"
    raise ValueError(f"cannot infer the format of {model_path}; pass load_format")


def read_model_config(model_path: str | Path, load_format: str = "auto") -> ModelConfig:
    """The `ModelConfig` of a checkpoint (GGUF metadata or the HF config.json), without reading
    any weight: what `load_model` would build."""
    fmt = resolve_load_format(model_path, load_format) if load_format != "dummy" else "dummy"
    path = Path(model_path)
    if fmt == "gguf":
        from tandem.models.loader.gguf import gguf_model_config

        return gguf_model_config(path)
    if fmt == "safetensors":
        return ModelConfig.from_pretrained(path if path.is_dir() else path.parent)
    return ModelConfig.from_pretrained(path)


def build_model(
    config: ModelConfig,
    *,
    dtype: torch.dtype,
    device: torch.device | str,
    attn_backend: str = "torch",
    expert_backend: str = "torch",
    expert_options: dict[str, Any] | None = None,
    prepare: Callable[[nn.Module], None] | None = None,
) -> nn.Module:
    """An uninitialized model whose parameters live on `device` in `dtype` (allocated once).

    A backend with `host_experts = True` (cpu_pool) gets the MoE expert weights in host memory
    instead, so they never occupy the device. `prepare(model)` runs on the meta-device model
    first (e.g. to swap in packed-weight layers, whose dense weights are then never allocated)."""
    cls = get_model_class(config.architecture)
    check_tensor_parallel(config, get_tp().size, expert_backend)
    experts = (
        get_expert_backend(expert_backend, **(expert_options or {})) if config.is_moe else None
    )
    with torch.device("meta"):
        model = cls(config, get_attention_backend(attn_backend), experts)
        if prepare is not None:
            prepare(model)
    host_blocks = []
    if getattr(experts, "host_experts", False):
        for block in model.modules():
            if getattr(block, "backend", None) is experts and hasattr(block, "w13"):
                host_blocks.append((block, tuple(block.w13.shape), tuple(block.w2.shape)))
                block.w13 = block.w2 = None  # materialized below, on the host
    # not `to_empty`: its meta `empty_like` runs torch's Python reference, whose first use
    # imports torch.fx and sympy (tens of MB resident for the process's life)
    model = model.to(dtype=dtype)._apply(
        lambda t: torch.empty(t.shape, dtype=t.dtype, device=device)
    )
    for block, shape13, shape2 in host_blocks:
        block.w13 = nn.Parameter(torch.empty(shape13, dtype=dtype), requires_grad=False)
        block.w2 = nn.Parameter(torch.empty(shape2, dtype=dtype), requires_grad=False)
    model.requires_grad_(False)
    return model.eval()


def load_model(
    model_path: str | Path,
    *,
    dtype: torch.dtype,
    device: torch.device | str,
    load_format: str = "auto",
    attn_backend: str = "torch",
    expert_backend: str = "torch",
    seed: int = 0,
    config: ModelConfig | None = None,
    expert_options: dict[str, Any] | None = None,
    quantization: str = "auto",
    deterministic: bool = False,
) -> tuple[nn.Module, ModelConfig]:
    """`deterministic`: every op batch-invariant (a row's output the same alone and in any
    batch), or a ValueError where this device and dtype have no such path. `expert_options` go to the expert backend's factory (cpu_pool: fmt, cpu_experts,
    gpu_experts, num_threads, ...). An expert backend may have, and is then called with:
    `skip_expert_layers(model, path, format)` before any weight is read: the MoE layers whose
    routed-expert tensors it does not need (cpu_pool: cached or taken from a GGUF's blocks),
    which are then neither read nor expected; `attach(model, read_experts)` once the weights
    are in, where `read_experts(layer)` reads one skipped layer's experts after all."""
    fmt = resolve_load_format(model_path, load_format) if load_format != "dummy" else "dummy"
    path = Path(model_path)
    _check_quantization(fmt, quantization)
    config = config or read_model_config(path, load_format)
    packed: set[str] = set()
    kept = _packed_tensors(path, fmt, quantization)
    if _experts_stay_packed(expert_backend, device, quantization) and get_tp().size == 1:
        kept = {**kept, **_packed_expert_tensors(path, fmt, config)}  # TP: experts dequantized
    hf_quant = _hf_quant(path, fmt, quantization)
    if kept and quantization == "auto" and not _packed_kernels_serve(device, dtype):
        log.info("%s weights dequantized to %s at load: no packed kernel for it", device, dtype)
        kept = {}
    dense: dict[str, str] = {}  # tensor parallel: kept tensors whose split cuts a block

    def prepare(m: nn.Module) -> None:
        from tandem.models.quant.swap import quantize_modules

        shards = tensor_parallel_shards(m)[0] if get_tp().size > 1 else None
        packed.update(quantize_modules(m, kept, device, dtype, shards, hf_quant, dense))

    model = build_model(
        config,
        dtype=dtype,
        device=device,
        attn_backend=attn_backend,
        expert_backend=expert_backend,
        expert_options=expert_options,
        prepare=prepare if kept else None,
    )
    if dense:
        name, why = next(iter(dense.items()))
        log.warning(
            "tensor parallel: %d packed tensors dequantized at load because their split would "
            "cut quant blocks (first: %s: %s)",
            len(dense),
            name,
            why,
        )
    if kept and len(packed) < len(kept):
        log.info(
            "%d quantized tensors without a packed layer (MoE experts: the cpu_pool converts "
            "them to its own formats, the torch experts hold them in %s) dequantized at load",
            len(kept) - len(packed),
            dtype,
        )
    backend = getattr(model, "expert_backend", None)
    read_experts = None
    if fmt == "dummy":
        read_experts = _init_dummy(model, backend, path, seed)
    else:
        skip_layers = getattr(backend, "skip_expert_layers", None)
        skip = skip_layers(model, path, fmt) if skip_layers is not None else frozenset()

        def wanted(name: str) -> bool:  # every tensor but the skipped layers' experts
            return expert_layer(name) not in skip and not is_mtp(name, config)

        # never read: skipped experts, and DeepSeek's multi-token-prediction layers
        has_mtp = is_mtp(f"model.layers.{config.num_hidden_layers}.", config)
        select = wanted if skip or has_mtp else None
        shards = tensor_parallel_shards(model)[0] if get_tp().size > 1 else None
        weights = _checkpoint_weights(path, fmt, dtype, select, packed, hf_quant, shards)
        model.load_weights(weights, expected=select)

        def read_experts(layer: int) -> None:
            def only(name: str) -> bool:
                return expert_layer(name) == layer

            weights = _checkpoint_weights(path, fmt, dtype, only, quant=hf_quant)
            model.load_weights(weights, expected=only)

    attach = getattr(backend, "attach", None)
    if attach is not None:
        attach(model, read_experts)  # e.g. cpu_pool: experts into the pool, torch copies freed
    if packed:
        from tandem.models.quant.act_order import fold_down_perms

        fold_down_perms(model)  # GPTQ act-order: down_proj's gather into gate_up's row order
    if deterministic:
        make_batch_invariant(model, device, dtype)
    else:
        apply_fast_linears(model, device, dtype)
    return model, config


def make_batch_invariant(model: nn.Module, device: torch.device | str, dtype: torch.dtype) -> None:
    """The `--deterministic` mode. CUDA: dense linears in fixed-shape GEMMs
    (models/layers/invariant_linear.py) and the cupy attention through one kernel for every
    batch. CPU: the default path already is (bf16 VNNI linears and the "cpu" attention kernel on
    an AVX-512 BF16 CPU); anything else is refused, as is a backend with no invariant path."""
    from tandem.models.layers.attention import Attention

    kind = torch.device(device).type
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    backends = {m.backend.name for m in layers}
    if getattr(model, "expert_backend", None) is not None:
        raise ValueError("--deterministic serves dense models only (MoE experts are not covered)")
    if kind == "cuda":
        if backends != {"cupy"}:
            raise ValueError(f"--deterministic on CUDA needs the cupy attention, got {backends}")
        for m in layers:
            m.backend.batch_invariant = True
        from tandem.models.layers.invariant_linear import use_batch_invariant

        use_batch_invariant(model)
        return
    if kind == "cpu":
        from tandem.models.layers.cpu_linear import CpuDenseLinear
        from tandem.models.quant.linear import QuantLinear

        apply_fast_linears(model, device, dtype)
        fmts = {m.packed.fmt for m in model.modules() if isinstance(m, CpuDenseLinear)}
        if any(isinstance(m, QuantLinear) for m in model.modules()):
            fmts.add("packed checkpoint types (use --dequantize)")
        if dtype != torch.bfloat16 or fmts != {"bf16_vnni"} or backends != {"cpu"}:
            raise ValueError(
                "--deterministic on the CPU needs bfloat16 on an AVX-512 BF16 CPU with the C++ "
                f"kernels (linear formats {sorted(fmts)}, attention {sorted(backends)}, {dtype})"
            )
        return
    raise ValueError(f"--deterministic is not supported on {kind}")


def _init_dummy(
    model: nn.Module, backend: Any, path: Path, seed: int
) -> Callable[[int], None] | None:
    """Random weights. A backend that skips expert layers (cpu_pool) gets those layers' host
    experts filled one layer at a time by the returned `read_experts`, right before it converts
    them, so the bf16 copy of every layer (58 GB for Qwen3-30B-A3B) never exists at once. The
    layers share one host buffer per tensor shape (the backend has converted and dropped the
    previous layer's by then): fresh pages for every layer would cost a page fault per 4 KiB."""
    skip_layers = getattr(backend, "skip_expert_layers", None)
    skip = skip_layers(model, path, "dummy") if skip_layers is not None else frozenset()
    blocks: dict[int, tuple[str, nn.Module]] = {}
    for name, module in model.named_modules():
        layer = getattr(module, "layer_idx", None)
        if layer in skip and getattr(module, "backend", None) is backend and hasattr(module, "w13"):
            blocks[layer] = (name, module)
    lazy = {f"{name}.{w}" for name, _ in blocks.values() for w in ("w13", "w2")}
    init_dummy_weights(model, seed, select=(lambda name: name not in lazy) if lazy else None)
    if not blocks:
        return None
    scratch: dict[tuple[tuple[int, ...], torch.dtype], torch.Tensor] = {}

    def read_experts(layer: int) -> None:
        name, block = blocks[layer]
        for w in ("w13", "w2"):
            param = getattr(block, w)
            key = (tuple(param.shape), param.dtype)
            if key in scratch:
                setattr(block, w, nn.Parameter(scratch[key], requires_grad=False))
            else:
                scratch[key] = param.data
        names = {f"{name}.w13", f"{name}.w2"}
        init_dummy_weights(model, seed, select=lambda n: n in names)

    return read_experts


def _experts_stay_packed(
    expert_backend: str, device: torch.device | str, quantization: str
) -> bool:
    """Whether routed experts stay packed (`_packed_expert_tensors`): the gpu expert backend
    on CUDA (its kernels read them; ext/cuda/moe_quant.py), or anywhere with `--quantization
    gguf` (the torch reference dequantizes them every step)."""
    if expert_backend != "gpu" or quantization == "none":
        return False
    return torch.device(device).type == "cuda" or quantization == "gguf"


def _packed_expert_tensors(path: Path, fmt: str, config: ModelConfig) -> dict[str, str]:
    """Per-expert HF name -> type of the routed experts a gpu-backend model keeps packed: a
    GGUF's stacked expert tensors of the kept types, a GPT-OSS checkpoint's MXFP4 experts."""
    if fmt == "gguf":
        from tandem.models.loader.gguf import gguf_packed_tensors

        return gguf_packed_tensors(path, experts=True)
    if fmt == "safetensors" and config.architecture == "GptOssForCausalLM":
        from tandem.models.gpt_oss import mxfp4_expert_names
        from tandem.models.loader.safetensors import tensor_names

        return mxfp4_expert_names(tensor_names(path), config)
    return {}


def _packed_kernels_serve(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether packed weights have a kernel here (CPU: bf16 models; CUDA: fp16/bf16); elsewhere
    "auto" dequantizes at load, since the torch reference would dequantize every step."""
    kind = torch.device(device).type
    return (kind == "cpu" and dtype == torch.bfloat16) or (
        kind == "cuda" and dtype in (torch.float16, torch.bfloat16)
    )


def _check_quantization(fmt: str, quantization: str) -> None:
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {quantization!r}; choose from {QUANTIZATIONS}")
    if quantization == "gguf" and fmt != "gguf":
        raise ValueError(f"quantization 'gguf' needs a GGUF checkpoint, got format {fmt!r}")
    if quantization in HF_QUANT_FORMATS and fmt != "safetensors":
        raise ValueError(
            f"quantization {quantization!r} needs an HF safetensors checkpoint, got format {fmt!r}"
        )


def _packed_tensors(path: Path, fmt: str, quantization: str) -> dict[str, str]:
    """HF name -> packed type of the checkpoint tensors that stay quantized (`quantization`
    already checked against `fmt` by `_check_quantization`)."""
    if fmt == "safetensors" and quantization != "none":
        return _hf_packed_tensors(path, quantization)
    if quantization == "none" or fmt != "gguf":
        return {}
    from tandem.models.loader.gguf import gguf_packed_tensors

    return gguf_packed_tensors(path)


def _hf_quant(path: Path, fmt: str, quantization: str) -> HfQuantConfig | None:
    """The HF checkpoint's quantization: its config.json's (an unserved format is refused
    here, by name), or the one `quantization` names when config.json has none."""
    if fmt != "safetensors":
        return None
    found = read_quant_config(path)
    if found is not None and quantization in HF_QUANT_FORMATS and found.method != quantization:
        raise UnsupportedModelError(
            f"--quantization {quantization} but the checkpoint's quantization_config says "
            f"{found.method}"
        )
    if found is None and quantization in HF_QUANT_FORMATS:
        from tandem.models.loader.safetensors import infer_config

        return infer_config(path, quantization)
    return found


def _hf_packed_tensors(path: Path, quantization: str) -> dict[str, str]:
    """HF name -> "int4" | "fp8" of a GPTQ / AWQ / FP8 safetensors checkpoint's weights."""
    from tandem.models.loader.safetensors import packed_candidates

    quant = _hf_quant(path, "safetensors", quantization)
    kept = packed_candidates(path)
    kept.pop("model.embed_tokens.weight", None)  # a gathered table: dequantized at load
    if quantization in HF_QUANT_FORMATS and not kept:
        raise UnsupportedModelError(
            f"--quantization {quantization}: the checkpoint holds no {quantization} weights"
        )
    if any(k == "int4" for k in kept.values()) and (quant is None or quant.method == "fp8"):
        raise UnsupportedModelError(
            "the checkpoint has int4 qweight tensors but no GPTQ or AWQ quantization_config in "
            "config.json; pass --quantization gptq or --quantization awq"
        )
    return kept


def _checkpoint_weights(
    path: Path,
    fmt: str,
    dtype: torch.dtype,
    select: Callable[[str], bool] | None,
    packed: set[str] | frozenset[str] = frozenset(),
    quant: HfQuantConfig | None = None,
    shards: dict[str, Shard] | None = None,
) -> Iterator[tuple[str, Any]]:
    """(HF name, tensor) of a "gguf" or "safetensors" checkpoint; `select(name)` False: not
    read at all; names in `packed` come as `models.quant.tensor.QuantizedTensor`s (with
    `shards`, as this rank's slice, read alone where the format allows)."""
    if fmt == "gguf":
        from tandem.models.loader.gguf import load_gguf_weights

        return load_gguf_weights(path, dtype, select, frozenset(packed), shards)
    from tandem.models.loader.safetensors import iter_safetensors_weights

    return iter_safetensors_weights(path, dtype, select, frozenset(packed), quant, shards)


def apply_fast_linears(model: nn.Module, device: torch.device | str, dtype: torch.dtype) -> None:
    """Swap dense linears for the device's small-M kernels where they apply (CPU: ext/cpu's
    GEMV for bf16, `TANDEM_CPU_LINEAR`; CUDA: ext/cuda's skinny GEMM, `TANDEM_CUDA_LINEAR`)."""
    kind = torch.device(device).type
    if kind == "cpu" and dtype == torch.bfloat16:
        _apply_cpu_quant(model)  # kernels on packed layers: any shard of them works
    if get_tp().size > 1:  # the sharded layers call F.linear on their own dense weights
        if kind == "cuda" and dtype in (torch.float16, torch.bfloat16):
            _apply_cuda_quant(model)
        return
    linear_fmt = cpu_linear_format()
    if linear_fmt is not None and kind == "cpu" and dtype == torch.bfloat16:
        _apply_cpu_linear(model, linear_fmt)
    if kind == "cuda" and dtype in (torch.float16, torch.bfloat16):
        _apply_cuda_quant(model)
        _apply_cuda_linear(model)

"""Engine options shared by `tandem generate`, `tandem chat` and `tandem serve`.

One definition of the model, memory and scheduling flags and of how they become an
`EngineConfig`, so the three commands cannot drift apart.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tandem.runtime.config import CacheConfig, EngineConfig, ModelSpec, SchedulerConfig

DEFAULT_MODEL = "smollm2-135m-instruct"


class HelpFormatter(argparse.HelpFormatter):
    """Shows each option's default after its help, unless the default is None or the help
    already says what it is."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (
            "default" in text
            or default is None
            or default is argparse.SUPPRESS
            or isinstance(default, bool)
            or not action.option_strings
        ):
            return text
        return f"{text} (default: %(default)s)" if text else "default: %(default)s"


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    sched, cache = SchedulerConfig(), CacheConfig()
    parser.add_argument(
        "-m",
        "--model",
        default=None,
        help=f"an HF model directory, a .gguf file, or a known name (default: {DEFAULT_MODEL})",
    )
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="a tokenizer directory (tokenizer.json) or .gguf file (default: the model's own)",
    )
    parser.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE|TEMPLATE",
        help="a jinja2 chat template file, or the template text itself "
        "(default: the tokenizer's own)",
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="auto: bf16 on CUDA and on CPUs with native bf16, else float32",
    )
    parser.add_argument("--device", default="auto", help="auto (cuda if available) | cpu | cuda")
    parser.add_argument(
        "--load-format",
        default="auto",
        choices=["auto", "safetensors", "gguf", "dummy"],
        help="auto: from the --model path; dummy: random weights of the shape in --model's "
        "config.json (a directory holding only config.json will do; without tokenizer files "
        "a synthetic byte-level tokenizer stands in)",
    )
    parser.add_argument(
        "--quantization",
        default="auto",
        choices=["auto", "none", "gguf", "gptq", "awq", "fp8"],
        help="auto: a checkpoint's quantized weights (GGUF Q4_0/Q4_1/Q8_0/Q4_K/Q5_K/Q6_K, "
        "GPTQ/AWQ int4, FP8 e4m3) are served from their packed bytes; none: dequantized to --dtype at load; gptq/awq/fp8: "
        "name the format of a safetensors checkpoint whose config.json does not",
    )
    parser.add_argument(
        "--dequantize",
        action="store_true",
        help="dequantize every weight to --dtype at load (same as --quantization none)",
    )
    parser.add_argument(
        "--max-model-len",
        type=count_arg(1),
        default=None,
        help="longest sequence (prompt + completion) in tokens (default: the model's own, "
        "capped by what the KV cache holds; more than the model allows is refused)",
    )
    parser.add_argument(
        "--max-num-seqs",
        type=int,
        default=sched.max_num_seqs,
        help="sequences decoded together in one step",
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=sched.max_num_batched_tokens,
        help="token budget of one step, shared by decodes and prefill chunks",
    )
    parser.add_argument(
        "--block-size", type=int, default=cache.block_size, help="tokens per KV cache block"
    )
    parser.add_argument(
        "--num-kv-blocks",
        type=int,
        default=None,
        help="fix the number of KV blocks (default: sized from memory)",
    )
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=cache.gpu_memory_utilization,
        help="fraction of GPU memory for weights, activations and the KV cache (CUDA only)",
    )
    parser.add_argument(
        "--cpu-experts",
        default=None,
        help="'all' or N: MoE experts per layer on the CPU expert pool",
    )
    parser.add_argument(
        "--gpu-experts",
        type=count_arg(0),
        default=None,
        help="MoE experts per layer kept on the GPU (the most routed ones)",
    )
    parser.add_argument(
        "--cpu-threads",
        type=count_arg(1),
        default=None,
        help="threads of the CPU expert pool (default: cpus - 1; with the model on CUDA "
        "cpus - 2, and the server's other threads go to the cpus left)",
    )
    parser.add_argument(
        "--cpu-expert-format",
        default="auto",
        choices=["auto", "bf16", "int8", "int4"],
        help="weight format of the experts in the CPU pool (auto: a GGUF's own, Q4_0/Q4_1/Q4_K "
        "-> int4 in groups of 32, Q8_0 -> int8; bf16 for float checkpoints)",
    )
    parser.add_argument(
        "--cpu-expert-group-size",
        type=int,
        default=None,
        choices=[32, 64],
        help="elements per scale of int4 experts converted from float weights (default 64; "
        "with --cpu-expert-format int4)",
    )
    parser.add_argument(
        "--gpu-prefill",
        default=None,
        type=_gpu_prefill_arg,
        metavar="auto|off|N",
        help="CPU-pool experts on CUDA: steps of at least N tokens compute the layer on the GPU "
        "from the pool's weights, copied over PCIe (auto: by expert format; "
        "env TANDEM_GPU_PREFILL)",
    )
    parser.add_argument(
        "--tensor-parallel-size",
        type=count_arg(1),
        default=1,
        help="processes (one per GPU; gloo on the CPU) the model's layers are split over",
    )
    parser.add_argument(
        "--deterministic",
        action="store_true",
        help="batch-invariant ops: greedy output the same alone and in any batch (CUDA: "
        "fixed-shape GEMMs and one attention kernel, slower; CPU: needs bf16 on AVX-512 BF16, "
        "where it is the default already). Dense models; docs/determinism.md",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")


def count_arg(least: int):  # noqa: ANN202
    def parse(value: str) -> int:
        try:
            n = int(value)
        except ValueError:
            n = least - 1
        if n < least:
            raise argparse.ArgumentTypeError(f"expected an integer >= {least}, got {value!r}")
        return n

    return parse


def _gpu_prefill_arg(value: str) -> str:
    if value in ("auto", "off") or (value.isdigit() and int(value) >= 0):
        return value
    raise argparse.ArgumentTypeError(f"expected auto, off or a token count, got {value!r}")


def read_chat_template(value: str | None) -> str | None:
    """--chat-template: a file's text, or the argument itself when it is a template."""
    if value is None:
        return None
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text()
    if "{" not in value:
        raise FileNotFoundError(f"--chat-template file '{value}' does not exist")
    return value


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=ModelSpec(
            model=args.model,
            tokenizer_path=args.tokenizer,
            chat_template=read_chat_template(args.chat_template),
            seed=args.seed if getattr(args, "seed", None) is not None else 0,
            dtype=args.dtype,
            device=args.device,
            load_format=args.load_format,
            cpu_experts=args.cpu_experts,
            gpu_experts=args.gpu_experts,
            cpu_threads=args.cpu_threads,
            cpu_expert_format=args.cpu_expert_format,
            cpu_expert_group_size=args.cpu_expert_group_size,
            gpu_prefill=args.gpu_prefill,
            quantization=args.quantization,
            dequantize=args.dequantize,
            tensor_parallel_size=getattr(args, "tensor_parallel_size", 1),
            deterministic=args.deterministic,
        ),
        cache=CacheConfig(
            block_size=args.block_size,
            num_blocks=args.num_kv_blocks,
            gpu_memory_utilization=args.gpu_memory_utilization,
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_model_len=args.max_model_len,
            max_num_batched_tokens=args.max_num_batched_tokens,
        ),
        seed=getattr(args, "seed", None),
    )

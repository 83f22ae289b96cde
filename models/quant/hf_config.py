"""The `quantization_config` of an HF checkpoint (config.json), read into one typed object:
which format (GPTQ, AWQ, FP8), its group size or scale block, and a clear error naming any
format or option Tandem does not serve. Knows nothing of tensors."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tandem.models.config import UnsupportedModelError

HF_QUANT_FORMATS = ("gptq", "awq", "fp8")


@dataclass(frozen=True)
class HfQuantConfig:
    method: str  # "gptq" | "awq" | "fp8"
    group: int = 0  # int4: input channels per scale (0: one group per row)
    zero_offset: int = 0  # GPTQ "gptq" (v1) checkpoints store zero points minus 1
    block: tuple[int, int] = (128, 128)  # fp8: the weight_scale_inv block


def _refuse(what: str) -> UnsupportedModelError:
    return UnsupportedModelError(
        f"{what}; Tandem serves 4-bit GPTQ (gptq/gptq_v2 format), 4-bit AWQ (GEMM version) and "
        "FP8 e4m3 checkpoints"
    )


def _int4(method: str, q: dict[str, Any]) -> HfQuantConfig:
    bits = int(q.get("bits", q.get("w_bit", 4)))
    if bits != 4:
        raise _refuse(f"{method.upper()} with {bits}-bit weights is not supported")
    group = int(q.get("group_size", q.get("q_group_size", 128)))
    group = 0 if group <= 0 else group
    if group and group % 32:
        raise _refuse(f"{method.upper()} group size {group} is not a multiple of 32")
    if method == "awq":
        version = str(q.get("version", "gemm")).lower()
        if version != "gemm":
            raise _refuse(f"AWQ version {version!r} is not supported (only the GEMM layout)")
        if not q.get("zero_point", True):
            raise _refuse("AWQ without zero points is not supported")
        return HfQuantConfig("awq", group)
    fmt = str(q.get("checkpoint_format", "gptq")).lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise _refuse(f"GPTQ checkpoint_format {fmt!r} is not supported")
    return HfQuantConfig("gptq", group, 1 if fmt == "gptq" else 0)


def _compressed_tensors(q: dict[str, Any]) -> HfQuantConfig:
    fmt = q.get("format")
    if fmt not in ("float-quantized", "naive-quantized"):
        raise _refuse(f"compressed-tensors format {fmt!r} is not supported")
    for group in (q.get("config_groups") or {}).values():
        weights = group.get("weights") or {}
        if weights.get("type") != "float" or int(weights.get("num_bits", 8)) != 8:
            raise _refuse(f"compressed-tensors weights {weights} are not FP8")
        block = weights.get("block_structure")
        if weights.get("strategy") == "block" and block:
            return HfQuantConfig("fp8", block=(int(block[0]), int(block[1])))
    return HfQuantConfig("fp8")


def parse_quant_config(q: dict[str, Any] | None) -> HfQuantConfig | None:
    """`quantization_config` -> `HfQuantConfig`, None without one; refuses what is not served."""
    if not q:
        return None
    method = str(q.get("quant_method", "")).lower()
    if method in ("gptq", "awq"):
        return _int4(method, q)
    if method == "fp8":
        fmt = str(q.get("fmt", "e4m3")).lower()
        if fmt != "e4m3":
            raise _refuse(f"FP8 format {fmt!r} is not supported")
        block = q.get("weight_block_size")
        return HfQuantConfig("fp8", block=(int(block[0]), int(block[1])) if block else (128, 128))
    if method == "fbgemm_fp8":
        return HfQuantConfig("fp8")
    if method == "compressed-tensors":
        return _compressed_tensors(q)
    raise _refuse(f"quantization_config quant_method {method!r} is not supported")


def read_quant_config(path: str | Path) -> HfQuantConfig | None:
    """The checkpoint's quantization (a directory or a file beside its config.json)."""
    path = Path(path)
    config = (path if path.is_dir() else path.parent) / "config.json"
    if not config.exists():
        return None
    return parse_quant_config(json.loads(config.read_text()).get("quantization_config"))

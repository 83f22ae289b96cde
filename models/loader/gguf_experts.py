"""GGUF expert tensors straight into the CPU expert pool, one layer at a time.

Reads each layer's stacked `blk.N.ffn_{gate,up,down}_exps.weight` ([E, out, in]), decodes it
to float32 (models/gguf_dequant.py) and hands it to `CpuExpertPool.add_layer` in a pool format
chosen from the GGUF type. Q4_0 -> int4 with groups of 32 is lossless: the pool's int4 uses
Q4_0's 16-level mapping (largest-magnitude element -> -8), so each block requantizes to itself.
Q4_1 and Q4_K (asymmetric, with a minimum) are requantized to int4 groups of 32 (lossy: the
pool has no minimum term); Q8_0 -> int8 per row; float types -> bf16. Only one layer's float32
copy exists at a time, so host memory never holds the experts twice.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tandem.models.gguf_dequant import dequantize_tensor
from tandem.models.gguf_reader import GGUFReader, ggml_type_name

if TYPE_CHECKING:
    from tandem.ext.cpu import CpuExpertPool

# GGUF type -> (pool format, int4 group size)
AUTO_FORMATS: dict[str, tuple[str, int]] = {
    "Q4_0": ("int4", 32),
    "Q4_1": ("int4", 32),
    "Q4_K": ("int4", 32),
    "Q8_0": ("int8", 64),
    "MXFP4": ("int8", 64),  # GPT-OSS: why int8, models/layers/cpu_expert_options.py
    "F32": ("bf16", 64),
    "F16": ("bf16", 64),
    "BF16": ("bf16", 64),
}
_EXPS = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight$")


def gguf_expert_layers(reader: GGUFReader) -> dict[int, dict[str, str]]:
    """layer -> {"gate"|"up"|"down": tensor name} for every layer with stacked experts."""
    layers: dict[int, dict[str, str]] = {}
    for name in reader.tensors:
        m = _EXPS.match(name)
        if m:
            layers.setdefault(int(m[1]), {})[m[2]] = name
    return {i: parts for i, parts in sorted(layers.items()) if len(parts) == 3}


def gguf_layer_experts(reader: GGUFReader, layer: int) -> tuple[torch.Tensor, torch.Tensor, str]:
    """(w13 [E, 2I, H] f32, w2 [E, H, I] f32, GGUF type name of the gate tensor)."""
    parts = gguf_expert_layers(reader)[layer]
    info = {k: reader.tensors[v] for k, v in parts.items()}
    gate = dequantize_tensor(reader, info["gate"])  # [E, I, H]
    up = dequantize_tensor(reader, info["up"])
    w13 = torch.cat([gate, up], dim=1)
    del gate, up
    w2 = dequantize_tensor(reader, info["down"])  # [E, H, I]
    return w13, w2, ggml_type_name(info["gate"].ggml_type)


def load_gguf_experts(
    path: str | Path | GGUFReader,
    pool: CpuExpertPool,
    fmt: str = "auto",
    layers: list[int] | None = None,
    group_size: int | None = None,
) -> dict[int, tuple[str, int]]:
    """Converts the experts of `layers` (default all) into `pool`; returns layer -> (format,
    group size). `fmt` "auto" picks from the GGUF type (AUTO_FORMATS), else bf16/int8/int4;
    int4 groups: `group_size`, else 32 for Q4 types (Q4_0 lossless) and 64 for the others."""
    reader = path if isinstance(path, GGUFReader) else GGUFReader(path)
    done: dict[int, tuple[str, int]] = {}
    for layer in layers if layers is not None else list(gguf_expert_layers(reader)):
        w13, w2, qtype = gguf_layer_experts(reader, layer)
        if fmt == "auto":
            pool_fmt, group = AUTO_FORMATS.get(qtype, ("bf16", 64))
        else:
            pool_fmt, group = fmt, 32 if qtype in ("Q4_0", "Q4_1", "Q4_K") else 64
            group = group_size or group
        pool.add_layer(layer, w13, w2, pool_fmt, group)
        done[layer] = (pool_fmt, group)
    return done

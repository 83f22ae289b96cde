"""Reads HF safetensors checkpoints: one file, a directory with `model.safetensors`, or a
sharded directory with `model.safetensors.index.json`. Files are memory-mapped (safe_open);
each tensor is materialized and cast to the target dtype only when the consumer asks for it.
FP8 block-scaled weights (DeepSeek's: e4m3 + `weight_scale_inv`) are decoded one tensor at a
time (models/quant/fp8.py), so no full high-precision copy of the checkpoint ever exists.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from tandem.models.config import UnsupportedModelError
from tandem.models.quant.fp8 import FP8_DTYPES, dequant_fp8_blockwise

INDEX_NAME = "model.safetensors.index.json"
# Tensors kept in their stored float32 whatever the model dtype: DeepSeek-V3's router
# correction bias (its small differences pick the experts; transformers keeps it float32 too).
KEEP_FLOAT32 = (".e_score_correction_bias",)
SCALE_SUFFIX = "_scale_inv"  # FP8: "<name>.weight" + "<name>.weight_scale_inv"


def safetensors_files(path: str | Path) -> list[Path]:
    """The checkpoint files of `path` (a file or an HF directory), in a stable order."""
    path = Path(path)
    if path.is_file():
        return [path]
    index = path / INDEX_NAME
    if index.exists():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        return [path / f for f in sorted(set(weight_map.values()))]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {path}")
    return files


def iter_safetensors_weights(
    path: str | Path,
    dtype: torch.dtype | None = None,
    select: Callable[[str], bool] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, CPU tensor) for every tensor, or those whose name `select` accepts (the
    others are never read); floating tensors cast to `dtype`."""
    files = safetensors_files(path)
    scale_files: dict[str, Path] | None = None  # FP8 scale name -> its file, on first need
    block = (128, 128)
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                if name.endswith(SCALE_SUFFIX) or (select is not None and not select(name)):
                    continue
                tensor = f.get_tensor(name)
                if tensor.dtype in FP8_DTYPES:
                    if scale_files is None:
                        scale_files, block = _scale_files(files), block_size(path)
                    tensor = _dequant(name, tensor, f, file, scale_files, block)
                if name.endswith(KEEP_FLOAT32):
                    tensor = tensor.float()
                elif dtype is not None and tensor.is_floating_point() and tensor.dtype != dtype:
                    tensor = tensor.to(dtype)
                yield name, tensor


def block_size(path: str | Path) -> tuple[int, int]:
    """The FP8 scale block of the checkpoint's `quantization_config` (default 128 x 128)."""
    path = Path(path)
    config = (path if path.is_dir() else path.parent) / "config.json"
    block = None
    if config.exists():
        quant = json.loads(config.read_text()).get("quantization_config") or {}
        block = quant.get("weight_block_size")
    return (int(block[0]), int(block[1])) if block else (128, 128)


def _scale_files(files: list[Path]) -> dict[str, Path]:
    found: dict[str, Path] = {}
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118
                if name.endswith(SCALE_SUFFIX):
                    found[name] = file
    return found


def _dequant(name, tensor, f, file, scale_files, block) -> torch.Tensor:
    scale_name = name + SCALE_SUFFIX
    where = scale_files.get(scale_name)
    if where is None:
        raise UnsupportedModelError(f"FP8 tensor {name!r} has no {scale_name!r} in the checkpoint")
    if where == file:
        scale = f.get_tensor(scale_name)
    else:
        with safe_open(str(where), framework="pt", device="cpu") as g:
            scale = g.get_tensor(scale_name)
    try:
        return dequant_fp8_blockwise(tensor, scale, block)
    except ValueError as exc:
        raise UnsupportedModelError(f"FP8 tensor {name!r}: {exc}") from exc

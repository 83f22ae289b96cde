"""Reads HF safetensors checkpoints: one file, a directory with `model.safetensors`, or a
sharded directory with `model.safetensors.index.json`. Files are memory-mapped (safe_open);
each tensor is materialized and cast to the target dtype only when the consumer asks for it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open

INDEX_NAME = "model.safetensors.index.json"
# Tensors kept in their stored float32 whatever the model dtype: DeepSeek-V3's router
# correction bias (its small differences pick the experts; transformers keeps it float32 too).
KEEP_FLOAT32 = (".e_score_correction_bias",)


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
    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                if select is not None and not select(name):
                    continue
                tensor = f.get_tensor(name)
                if name.endswith(KEEP_FLOAT32):
                    tensor = tensor.float()
                elif dtype is not None and tensor.is_floating_point() and tensor.dtype != dtype:
                    tensor = tensor.to(dtype)
                yield name, tensor

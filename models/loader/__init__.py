"""Builds a model from a checkpoint: picks the format, reads the config, constructs the model
on the meta device, materializes it on the target device and fills its weights once.

Formats: "safetensors" (HF directory or file), "gguf" (models/loader/gguf.py, imported lazily),
"dummy" (random weights of the config's shapes); "auto" picks by path.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from models.attention_backend import get_attention_backend
from models.config import ModelConfig
from models.layers.experts import get_expert_backend
from models.loader.dummy import init_dummy_weights
from models.loader.safetensors import iter_safetensors_weights
from models.registry import get_model_class

LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")


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


def build_model(
    config: ModelConfig,
    *,
    dtype: torch.dtype,
    device: torch.device | str,
    attn_backend: str = "torch",
    expert_backend: str = "torch",
) -> nn.Module:
    """An uninitialized model whose parameters live on `device` in `dtype` (allocated once)."""
    cls = get_model_class(config.architecture)
    experts = get_expert_backend(expert_backend) if config.is_moe else None
    with torch.device("meta"):
        model = cls(config, get_attention_backend(attn_backend), experts)
    model = model.to(dtype=dtype).to_empty(device=device)
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
) -> tuple[nn.Module, ModelConfig]:
    fmt = resolve_load_format(model_path, load_format) if load_format != "dummy" else "dummy"
    path = Path(model_path)
    if fmt == "gguf":
        from models.loader.gguf import gguf_model_config, load_gguf_weights

        config = config or gguf_model_config(path)
        weights = load_gguf_weights(path, dtype)
    elif fmt == "safetensors":
        config = config or ModelConfig.from_pretrained(path if path.is_dir() else path.parent)
        weights = iter_safetensors_weights(path, dtype)
    else:
        if config is None:
            config = ModelConfig.from_pretrained(path)
        weights = None
    model = build_model(
        config, dtype=dtype, device=device, attn_backend=attn_backend, expert_backend=expert_backend
    )
    if weights is None:
        init_dummy_weights(model, seed)
    else:
        model.load_weights(weights)
    return model, config

"""Expert backends by name: "torch" (the reference), "gpu" and "cpu_pool", each imported on
first use (so the CUDA kernels and the C++ pool load only when asked for), and any a caller
registers. The backends do not know this registry: nothing imports back into it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from tandem.models.layers.experts import ExpertBackend

# name -> (module, class): the built-in backends, imported when first asked for
_BUILTIN = {
    "torch": ("tandem.models.layers.experts", "TorchExpertBackend"),
    "gpu": ("tandem.models.layers.gpu_experts", "GpuExpertBackend"),
    "cpu_pool": ("tandem.models.layers.cpu_experts", "CpuPoolExpertBackend"),
}
_REGISTERED: dict[str, Callable[..., ExpertBackend]] = {}


def register_expert_backend(name: str, factory: Callable[..., ExpertBackend]) -> None:
    """Make `get_expert_backend(name, **kwargs)` return `factory(**kwargs)`."""
    _REGISTERED[name] = factory


def get_expert_backend(name: str, **kwargs: Any) -> ExpertBackend:
    factory = _REGISTERED.get(name)
    if factory is None and name in _BUILTIN:
        module, attr = _BUILTIN[name]
        factory = getattr(importlib.import_module(module), attr)
    if factory is None:
        available = ", ".join(sorted(set(_BUILTIN) | set(_REGISTERED)))
        raise ValueError(f"unknown expert backend {name!r}; available: {available}")
    return factory(**kwargs)

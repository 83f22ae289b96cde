"""Random weights of a real model shape, for benchmarks and tests without a checkpoint.

Fills an already-built model in place, on its own device and dtype (no host copy, no second
allocation): normal(0, 0.02) everywhere, 1.0 for every RMSNorm weight, seeded.
"""

from __future__ import annotations

import torch
from torch import nn

from models.layers.norm import RMSNorm


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int = 0, std: float = 0.02) -> None:
    norm_params = {id(m.weight) for m in model.modules() if isinstance(m, RMSNorm)}
    generators: dict[torch.device, torch.Generator] = {}
    for _, param in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        if id(param) in norm_params:
            param.fill_(1.0)
            continue
        gen = generators.get(param.device)
        if gen is None:
            gen = torch.Generator(device=param.device).manual_seed(seed)
            generators[param.device] = gen
        param.normal_(0.0, std, generator=gen)

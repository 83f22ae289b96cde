"""Packed GGUF linears on the CPU through ext/cpu's qlinear kernel (weights read in their own
block layout, dequantized in registers; AVX-512 BF16 where the CPU has it, else portable C++).

`use_cpu_quant_kernels(model)` attaches the kernel to every `QuantLinear` of a bf16 CPU model;
float32 models keep the torch reference (the AVX-512 kernel rounds activations to bf16).
"""

from __future__ import annotations

import torch
from torch import nn

from tandem.ext.cpu.qlinear import QTYPES, CpuQuantLinearPool
from tandem.models.quant.linear import QuantLinear, quant_modules
from tandem.models.quant.tensor import QuantizedTensor


class CpuQuantKernel:
    """kernel(x [M, K] bf16/fp32, segment) -> [M, rows] in x's dtype, for QuantLinear."""

    def __init__(self, pool: CpuQuantLinearPool) -> None:
        self.pool = pool

    def __call__(self, x: torch.Tensor, seg: QuantizedTensor) -> torch.Tensor:
        if x.dtype not in (torch.bfloat16, torch.float32) or seg.qtype not in QTYPES:
            return torch.nn.functional.linear(x, seg.dequantize(x.dtype))
        return self.pool.linear(x, seg.data, seg.qtype)


def use_cpu_quant_kernels(model: nn.Module, pool: CpuQuantLinearPool | None = None) -> int:
    """Attach the kernel to the model's CPU `QuantLinear`s; returns how many."""
    mods = [m for m in quant_modules(model) if isinstance(m, QuantLinear)]
    mods = [m for m in mods if m.device.type == "cpu"]
    if not mods:
        return 0
    kernel = CpuQuantKernel(pool or CpuQuantLinearPool(num_threads=1))
    for m in mods:
        m.kernel = kernel
    return len(mods)

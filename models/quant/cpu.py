"""Packed linears on the CPU through ext/cpu's qlinear kernel (weights read in their own
layout, dequantized in registers): GGUF blocks on AVX-512 BF16 or portable C++, GPTQ/AWQ int4
and FP8 e4m3 on AVX-512 BF16 (elsewhere those take the torch reference).

`use_cpu_quant_kernels(model)` attaches the kernel to every `QuantLinear` of a bf16 CPU model;
float32 models keep the torch reference (the AVX-512 kernel rounds activations to bf16).
"""

from __future__ import annotations

import torch
from torch import nn

from tandem.ext.cpu.qlinear import QTYPES, CpuQuantLinearPool, PackedRows
from tandem.models.quant.fp8 import Fp8Tensor
from tandem.models.quant.int4 import Int4Tensor
from tandem.models.quant.linear import PackedWeight, QuantLinear, quant_modules
from tandem.models.quant.tensor import QuantizedTensor


class CpuQuantKernel:
    """kernel(x [M, K] bf16/fp32, segment) -> [M, rows] in x's dtype, for QuantLinear."""

    def __init__(self, pool: CpuQuantLinearPool) -> None:
        self.pool = pool
        self.vector = pool.isa in ("avx512", "amx")
        self._packed: dict[int, PackedRows] = {}  # id(segment data) -> its checked form

    def __call__(self, x: torch.Tensor, seg: PackedWeight) -> torch.Tensor:
        if x.dtype in (torch.bfloat16, torch.float32):
            if isinstance(seg, Int4Tensor) and self.vector and seg.scales.dtype == torch.float16:
                xs = x if seg.perm is None else x.index_select(1, seg.perm)
                return self.pool.linear_int4(xs, seg.codes, seg.scales, seg.zeros, seg.group)
            if isinstance(seg, Fp8Tensor) and self.vector and _fp8_served(seg):
                return self.pool.linear_fp8(x, seg.data, seg.scale, seg.block)
            if isinstance(seg, QuantizedTensor) and seg.qtype in QTYPES:
                w = self._packed.get(id(seg.data))
                if w is None or w.data is not seg.data:
                    w = self._packed[id(seg.data)] = self.pool.packed(seg.data, seg.qtype, seg.cols)
                return self.pool.run_packed(x, w)
        return torch.nn.functional.linear(x, seg.dequantize(x.dtype))


def _fp8_served(seg: Fp8Tensor) -> bool:
    return seg.data.dtype == torch.float8_e4m3fn and seg.cols % 32 == 0 and seg.block[1] % 32 == 0


def use_cpu_quant_kernels(model: nn.Module, pool: CpuQuantLinearPool | None = None) -> int:
    """Attach the kernel to the model's CPU `QuantLinear`s; returns how many."""
    mods = [m for m in quant_modules(model) if isinstance(m, QuantLinear)]
    mods = [m for m in mods if m.device.type == "cpu"]
    if not mods:
        return 0
    kernel = CpuQuantKernel(pool or CpuQuantLinearPool(num_threads=1))
    for m in mods:
        m.kernel = kernel
        m.segments = [_fp16_scales(s) for s in m.segments]
    return len(mods)


def _fp16_scales(seg: PackedWeight) -> PackedWeight:
    """An int4 tensor with bf16 scales that fp16 holds exactly gets fp16 ones (the kernel's)."""
    if not isinstance(seg, Int4Tensor) or seg.scales.dtype != torch.bfloat16:
        return seg
    half = seg.scales.to(torch.float16)
    if not torch.equal(half.to(torch.bfloat16), seg.scales):
        return seg
    return Int4Tensor(seg.qtype, seg.codes, half, seg.zeros, seg.group, seg.perm)

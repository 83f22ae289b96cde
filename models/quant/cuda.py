"""Packed GGUF linears on CUDA through ext/cuda's gguf_linear op (register-dequantizing GEMV
at decode sizes, dequantize-to-scratch + cuBLAS above). `use_cuda_quant_kernels(model)`
attaches it to every CUDA `QuantLinear` of a fp16/bf16 model."""

from __future__ import annotations

import torch
from torch import nn

from tandem.ext.cuda import gguf_linear  # noqa: F401  (registers torch.ops.tandem.gguf_linear)
from tandem.models.quant.linear import QuantLinear, quant_modules
from tandem.models.quant.tensor import QuantizedTensor


class CudaQuantKernel:
    def __call__(self, x: torch.Tensor, seg: QuantizedTensor) -> torch.Tensor:
        if x.dtype not in (torch.float16, torch.bfloat16) or seg.type_id not in gguf_linear.QTYPES:
            return torch.nn.functional.linear(x, seg.dequantize(x.dtype))
        return torch.ops.tandem.gguf_linear(x, seg.data, seg.type_id, seg.cols)


def use_cuda_quant_kernels(model: nn.Module) -> int:
    """Attach the kernel to the model's CUDA `QuantLinear`s; returns how many."""
    mods = [
        m for m in quant_modules(model) if isinstance(m, QuantLinear) and m.device.type == "cuda"
    ]
    kernel = CudaQuantKernel()
    for m in mods:
        m.kernel = kernel
    return len(mods)

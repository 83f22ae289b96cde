"""RMSNorm as Llama/Qwen/Mixtral define it: normalize in float32, scale in the input dtype.

On CUDA (fp16/bf16) outside torch.compile the norm is one fused kernel
(`torch.ops.tandem.rms_norm`, ext/cuda/norm.py) instead of the ~7 kernels of the torch
expression, which at decode batch sizes are launch-bound: four norms a layer (with q/k norms)
cost a Qwen3-MoE decode step about 3 ms of GPU time on an H100 at batch 1. Under torch.compile
the torch expression stays, so Inductor can fuse it with its neighbours. `add_norm` folds the
residual add before a norm into the same kernel. TANDEM_CUDA_NORM=0
turns the kernel off. bf16 on the CPU takes ext/cpu's one-call norm, `add_norm` included.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from tandem.ext.cpu import norm as _cpu_norm
from tandem.ext.cpu.build import extension_available
from tandem.ext.cuda import norm as _cuda_norm  # registers torch.ops.tandem.rms_norm

FUSED_CUDA_NORM = os.environ.get("TANDEM_CUDA_NORM", "1") != "0"


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))  # [hidden]
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., hidden]; the variance is taken in float32 as HF does, for bf16 parity.
        if FUSED_CUDA_NORM and x.is_cuda and not torch.compiler.is_compiling():
            return torch.ops.tandem.rms_norm(x, self.weight, self.eps)
        if self._cpu_kernel(x):
            return _cpu_norm.rms_norm_cpu(x, self.weight, self.eps)[1]
        return _cuda_norm.rms_norm_ref(x, self.weight, self.eps)

    def add_norm(
        self, x: torch.Tensor, delta: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, norm(x + delta)); delta None: (x, norm(x)). One kernel on CUDA."""
        if delta is None:
            return x, self(x)
        if (
            FUSED_CUDA_NORM
            and x.is_cuda
            and not torch.compiler.is_compiling()
            and not (torch.is_grad_enabled() and (x.requires_grad or delta.requires_grad))
        ):
            return torch.ops.tandem.add_rms_norm(x, delta, self.weight, self.eps)
        if (
            self._cpu_kernel(x)
            and delta.shape == x.shape
            and delta.dtype == x.dtype
            and delta.device.type == "cpu"
            and not (torch.is_grad_enabled() and (x.requires_grad or delta.requires_grad))
        ):
            return _cpu_norm.rms_norm_cpu(x, self.weight, self.eps, delta=delta)
        s = x + delta
        return s, self(s)

    def _cpu_kernel(self, x: torch.Tensor) -> bool:
        return (
            not x.is_cuda
            and not torch.compiler.is_compiling()
            and _cpu_norm.supported(x, self.weight)
            and extension_available()
        )

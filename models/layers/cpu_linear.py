"""Fast small-M dense linears on the CPU: `CpuDenseLinear` and `use_cpu_linear(model, fmt)`.

Decode on the CPU streams every weight once per step with M = number of sequences; torch's
GEMV reads weights at a fraction of memory bandwidth there. "bf16" on an AVX-512 or AMX pool
packs a VNNI copy of the weight and sends every M to the C++ kernel (ext/cpu/linear.*: VNNI dot
products, or AMX tiles, which also make prefill fast), whose per-row sums do not depend on M: a
sequence's output is then the same alone and in any batch. Other
formats send rows up to `max_rows` to the kernel and larger M (prefill) to torch's F.linear.
Knows nothing about requests.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem.ext.cpu.linear import FORMATS, VNNI_ISAS, CpuLinearPool, PackedWeight, pack_weight

# Largest M sent to the C++ kernel; above it torch's GEMM is as fast or faster (measured on a
# 2-vCPU AVX-512 BF16 EPYC, docs/BENCHMARKS.md "Offline decode (CPU)").
DEFAULT_MAX_ROWS = 4
# Steps of at least this many rows also use torch's other threads' cores (the pool's workers);
# smaller ones run on the caller alone (docs/BENCHMARKS.md "Batch-invariant CPU decode").
PARALLEL_MIN_ROWS = 4


class CpuDenseLinear(nn.Module):
    """y = x @ W^T (+ b) for x [..., K] bf16/fp32 on the CPU; drop-in for an nn.Linear."""

    def __init__(
        self,
        weight: torch.Tensor,  # [N, K] bf16, CPU, contiguous; kept for the torch fallback
        bias: torch.Tensor | None,
        pool: CpuLinearPool,
        fmt: str = "bf16",
        max_rows: int = DEFAULT_MAX_ROWS,
    ) -> None:
        super().__init__()
        if weight.dtype != torch.bfloat16 or weight.device.type != "cpu":
            raise ValueError("CpuDenseLinear needs a bf16 CPU weight")
        self.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self._bias_f32 = None if bias is None else bias.float().contiguous()
        if fmt == "bf16" and pool.isa in VNNI_ISAS:
            fmt, max_rows = "bf16_vnni", 1 << 62  # batch-invariant: every M through the kernel
        self.packed: PackedWeight = pack_weight(self.weight.data, fmt)
        self.pool = pool
        self.max_rows = max_rows
        self.in_features = weight.shape[1]
        self.out_features = weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features if x.numel() else 0
        if rows == 0 or rows > self.max_rows or x.dtype not in (torch.bfloat16, torch.float32):
            return F.linear(x, self.weight, self.bias)
        y = self.pool.linear(x.reshape(rows, self.in_features), self.packed, self._bias_f32)
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"fmt={self.packed.fmt}, max_rows={self.max_rows}, isa={self.pool.isa}"
        )


class _CpuLogits:
    """compute_logits for a tied or untied lm_head through the fast path (float32 logits)."""

    def __init__(self, head: CpuDenseLinear) -> None:
        self.head = head

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden).float()


_TARGETS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def use_cpu_linear(
    model: nn.Module,
    fmt: str = "bf16",
    *,
    pool: CpuLinearPool | None = None,
    max_rows: int = DEFAULT_MAX_ROWS,
) -> int:
    """Swaps the dense projections (qkv/o/gate_up/down) and the lm_head of a bf16 CPU model
    for `CpuDenseLinear`, in place; returns how many were swapped. No-op (0) for another dtype
    or device. The torch weights stay (the fallback for M > max_rows reads them)."""
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")
    params = list(model.parameters())
    if not params or params[0].device.type != "cpu" or params[0].dtype != torch.bfloat16:
        return 0
    # Batch-1 on the caller's thread alone: a pinned worker next to torch's own intra-op threads
    # on the same cores made it slower, not faster (measured: 60 vs 28 tok/s on 2 vCPUs).
    pool = pool or CpuLinearPool(
        num_threads=torch.get_num_threads(), parallel_min_rows=PARALLEL_MIN_ROWS
    )
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if name in _TARGETS and type(child) is nn.Linear:
                setattr(
                    parent, name, CpuDenseLinear(child.weight.data, _b(child), pool, fmt, max_rows)
                )
                swapped += 1
    packed_head = getattr(model, "quant_head", None) is not None  # models/quant owns it
    if (
        hasattr(model, "compute_logits")
        and hasattr(model, "embed_tokens")
        and swapped
        and not packed_head
    ):
        head_w = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
        head = CpuDenseLinear(head_w.data, None, pool, fmt, max_rows)
        model.cpu_lm_head = head  # registered: shares the tied weight, no copy
        model.compute_logits = _CpuLogits(head)
        swapped += 1
    return swapped


def _b(linear: nn.Linear) -> torch.Tensor | None:
    return None if linear.bias is None else linear.bias.data

"""Batch-invariant dense linears on CUDA: `BatchInvariantLinear` and `use_batch_invariant(model)`.

cuBLAS picks its kernel (tile shape, split-K) from the GEMM's shape, so a row's sums change
with the number of rows M in the step. Here every GEMM has the same shape: the rows are padded
to a multiple of `TILE_ROWS` and multiplied `TILE_ROWS` at a time, so cuBLAS runs one kernel
and each row's result is the same alone and in any batch (the `--deterministic` mode). Decode
(M <= TILE_ROWS) stays one GEMM; long prefills pay for many small ones. Knows nothing about
requests.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# Rows per GEMM: one size for every call. 64 covers decode up to 64 sequences in one call, and
# a 64-row GEMM still reads each weight once, so decode stays weight-bandwidth-bound.
TILE_ROWS = 64


def invariant_linear(
    x: torch.Tensor,  # [..., K]
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """F.linear in GEMMs of exactly TILE_ROWS rows; returns [..., N] in x's dtype."""
    K, N = weight.shape[1], weight.shape[0]
    x2 = x.reshape(-1, K)
    m = x2.shape[0]
    pad = -m % TILE_ROWS
    if pad:
        x2 = F.pad(x2, (0, 0, 0, pad))
    parts = [F.linear(x2[i : i + TILE_ROWS], weight, bias) for i in range(0, m + pad, TILE_ROWS)]
    y = parts[0] if len(parts) == 1 else torch.cat(parts)
    return y[:m].reshape(*x.shape[:-1], N)


class BatchInvariantLinear(nn.Module):
    """Drop-in for an nn.Linear whose rows do not depend on the batch (see the module doc)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.in_features = weight.shape[1]
        self.out_features = weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return invariant_linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, tile={TILE_ROWS}"


class _InvariantLogits:
    """compute_logits through `invariant_linear` (float32 logits)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        m = self.model
        weight = m.embed_tokens.weight if m.lm_head is None else m.lm_head.weight
        return invariant_linear(hidden, weight).float()


def use_batch_invariant(model: nn.Module) -> int:
    """Swaps every nn.Linear of `model` (and its lm_head product) for the batch-invariant one,
    in place; marks the model `batch_invariant` (the runner then keeps torch.compile off, whose
    generated GEMMs and reductions may vary with the batch). Returns how many were swapped."""
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                bias = None if child.bias is None else child.bias.data
                setattr(parent, name, BatchInvariantLinear(child.weight.data, bias))
                swapped += 1
    if hasattr(model, "compute_logits") and hasattr(model, "embed_tokens"):
        model.compute_logits = _InvariantLogits(model)
        swapped += 1
    model.batch_invariant = True
    return swapped

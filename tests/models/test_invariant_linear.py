"""models/layers/invariant_linear.py: fixed-shape GEMMs give each row the same bits in any
batch, and the swap covers every dense linear and the logits of a model (CPU, float32 here;
the CUDA run is tests/runtime/test_batch_invariance.py's gpu test)."""

from __future__ import annotations

import torch
from torch import nn

from tandem.models.layers.invariant_linear import (
    TILE_ROWS,
    BatchInvariantLinear,
    invariant_linear,
    use_batch_invariant,
)


def test_rows_match_alone_and_torch() -> None:
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(40, 24, generator=g), torch.randn(40, generator=g)
    x = torch.randn(2 * TILE_ROWS + 5, 24, generator=g)
    full = invariant_linear(x, w, b)
    torch.testing.assert_close(full, torch.nn.functional.linear(x, w, b))
    for m, start in [(1, 0), (2, 7), (3, 70), (TILE_ROWS + 1, 3)]:
        assert torch.equal(invariant_linear(x[start : start + m], w, b), full[start : start + m])
    assert invariant_linear(x.view(-1, 1, 24)[:5], w).shape == (5, 1, 40)


def test_swap_covers_linears_and_logits() -> None:
    class Tiny(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed_tokens = nn.Embedding(50, 16)
            self.lm_head = None
            self.block = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 16, bias=False))

        def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
            return nn.functional.linear(hidden, self.embed_tokens.weight).float()

    model = Tiny()
    h = torch.randn(3, 16)
    ref = model.compute_logits(model.block(h))
    assert use_batch_invariant(model) == 3 and model.batch_invariant
    assert all(isinstance(m, BatchInvariantLinear) for m in model.block)
    torch.testing.assert_close(model.compute_logits(model.block(h)), ref)

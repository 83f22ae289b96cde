"""models/quant/cuda.py's re-layout of a packed model (tiles, gate/up row pairs, the
QuantSwigluMLP swap) on the CPU: the swapped model's float32 forward (the torch reference on
the new layouts) equals the unswapped one's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_K"])
def test_tiled_and_paired_model_matches_rows(tmp_path: Path, qtype: str) -> None:
    from tandem.models.layers.mlp import GatedMLP
    from tandem.models.loader import load_model
    from tandem.models.quant.cuda import QuantSwigluMLP, pair_gate_up, tile_segments
    from tandem.models.quant.linear import QuantLinear
    from tests.models.quant_cases import write_tiny_gguf

    path = write_tiny_gguf(tmp_path / "m.gguf", qtype)
    model, _ = load_model(path, dtype=torch.float32, device="cpu", quantization="gguf")
    mlps = [m for m in model.modules() if type(m) is GatedMLP]
    x = torch.randn(5, mlps[0].gate_up_proj.in_features, generator=torch.Generator().manual_seed(0))
    before = [m(x) for m in mlps]
    for m in model.modules():
        if isinstance(m, QuantLinear):
            m.kernel = None
            tile_segments(m)
    assert all(pair_gate_up(m) for m in mlps)
    assert all(type(m) is QuantSwigluMLP for m in mlps)
    assert all(m.gate_up_proj.segments[0].layout == "tile16x2" for m in mlps)
    assert not pair_gate_up(mlps[0])  # already paired
    for m, b in zip(mlps, before, strict=True):
        torch.testing.assert_close(m(x), b, rtol=1e-5, atol=1e-5)

"""A tiny packed GGUF model on CUDA (register-dequantizing GEMV at decode sizes, scratch +
cuBLAS above) against the same weights dequantized at load (GPU tests)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import tandem.ext.cuda as cuda_ext

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not cuda_ext.is_available(), reason="needs CUDA and CuPy"),
]


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0", "Q4_K", "Q6_K"])
def test_packed_model_on_cuda_close_to_dequantized(
    tmp_path: Path, qtype: str, moe: bool, paged_runner
):
    from tandem.models.loader import load_model
    from tandem.models.quant.linear import QuantLinear, quantized_bytes
    from tests.models.quant_cases import write_tiny_gguf
    from tests.models.test_cuda_parity import CudaPagedRunner

    path = write_tiny_gguf(tmp_path / "m.gguf", qtype, moe=moe, head_type="Q6_K" if moe else None)
    fast, cfg = load_model(path, dtype=torch.bfloat16, device="cuda")
    mods = [m for m in fast.modules() if isinstance(m, QuantLinear)]
    assert mods and all(m.kernel is not None and m.segments[0].data.is_cuda for m in mods)
    assert quantized_bytes(fast) > 0
    segs = [s for m in mods if not m._tied for s in m.segments]  # 4-bit types: tile layout
    tiled = [s.layout in ("tile16", "tile16x2") for s in segs]
    assert tiled == [s.qtype in ("Q4_0", "Q4_1", "Q4_K") for s in segs]
    assert any(s.layout == "tile16x2" for s in segs) == (qtype in ("Q4_0", "Q4_K") and not moe)
    ref, _ = load_model(path, dtype=torch.bfloat16, device="cuda", quantization="none")
    gen = torch.Generator().manual_seed(2)
    for rows in (1, 2, 7, 16, 64, 300):
        ids = [int(i) for i in torch.randint(0, 96, (rows,), generator=gen)]
        a = CudaPagedRunner(paged_runner, fast, cfg, block_size=16, seed=1).step([(0, ids)])[0]
        b = CudaPagedRunner(paged_runner, ref, cfg, block_size=16, seed=1).step([(0, ids)])[0]
        row_ok = (a - b).abs().amax(-1) <= 0.03 * b.abs().max()
        allowed = max(1, rows // 10) if moe else 0  # tokens whose routing may flip
        assert int((~row_ok).sum()) <= allowed, rows

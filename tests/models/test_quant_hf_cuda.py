"""Tiny GPTQ / AWQ / FP8 models on CUDA (ext/cuda/hf_linear's GEMV at decode sizes, scratch +
cuBLAS above) against the same checkpoint dequantized at load, at 1-300 rows (GPU tests)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import tandem.ext.cuda as cuda_ext

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not cuda_ext.is_available(), reason="needs CUDA and CuPy"),
]
ROWS = [1, 2, 7, 16, 64, 300]


CASES = [("gptq", dict(group=32, sym=False, act_order=True), False),
         ("awq", dict(group=32), True), ("gptq", dict(group=32, sym=True), True),
         ("fp8", dict(scheme="block"), False), ("fp8", dict(scheme="channel"), True)]  # fmt: skip


@pytest.mark.parametrize(("method", "opts", "moe"), CASES)
def test_packed_model_on_cuda_close_to_dequantized(
    tmp_path: Path, method: str, opts: dict, moe: bool, paged_runner
) -> None:
    from tandem.models.loader import load_model
    from tandem.models.quant.linear import QuantLinear, quantized_bytes
    from tests.models.hf_quant_cases import write_quantized
    from tests.models.test_cuda_parity import CudaPagedRunner
    from tests.models.test_quant_hf import _checkpoint_quant_bytes

    write_quantized(tmp_path, method, moe=moe, **opts)
    fast, cfg = load_model(tmp_path, dtype=torch.bfloat16, device="cuda")
    mods = [m for m in fast.modules() if isinstance(m, QuantLinear)]
    assert mods and all(m.kernel is not None and m.segments[0].data.is_cuda for m in mods)
    if not moe:
        assert quantized_bytes(fast) <= 1.05 * _checkpoint_quant_bytes(tmp_path)
    ref, _ = load_model(tmp_path, dtype=torch.bfloat16, device="cuda", quantization="none")
    gen = torch.Generator().manual_seed(2)
    for rows in ROWS:
        ids = [int(i) for i in torch.randint(0, 128, (rows,), generator=gen)]
        a = CudaPagedRunner(paged_runner, fast, cfg, block_size=16, seed=1).step([(0, ids)])[0]
        b = CudaPagedRunner(paged_runner, ref, cfg, block_size=16, seed=1).step([(0, ids)])[0]
        row_ok = (a - b).abs().amax(-1) <= 0.03 * b.abs().max()
        allowed = max(1, rows // 10) if moe else 0
        assert int((~row_ok).sum()) <= allowed, rows

"""ext/cuda/gguf_linear against dequantize-then-matmul, and inside a CUDA graph (GPU tests)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tandem.ext.cuda as cuda_ext

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not cuda_ext.is_available(), reason="needs CUDA and CuPy"),
]

TYPES = ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]


def _weight(qtype: str, n: int, k: int, seed: int):
    from tandem.models.quant.tensor import QuantizedTensor
    from tests.models.quant_cases import pack

    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * 0.1
    data = torch.from_numpy(np.ascontiguousarray(pack(w, qtype))).cuda()
    return QuantizedTensor(qtype, data, k)


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("rows", [1, 2, 7, 16, 64, 300])
def test_matches_dequantize_then_matmul(qtype: str, rows: int) -> None:
    from tandem.ext.cuda import gguf_linear  # noqa: F401

    k = 768 if qtype.endswith("_K") else 96 + 32 * (rows % 3)
    n = 37 + rows % 5
    w = _weight(qtype, n, k, rows)
    x = torch.randn(rows, k, device="cuda", generator=torch.Generator("cuda").manual_seed(rows))
    for dtype in (torch.bfloat16, torch.float16):
        xd = x.to(dtype)
        expected = xd.double() @ w.dequantize().double().T
        got = torch.ops.tandem.gguf_linear(xd, w.data, w.type_id, k)
        assert got.dtype == dtype and got.shape == (rows, n)
        tol = 2e-2 if rows > 16 else 1e-2  # prefill: the weight itself rounded to 16 bits
        torch.testing.assert_close(got.double(), expected, rtol=tol, atol=tol)


def test_inside_a_cuda_graph() -> None:
    from tandem.ext.cuda import gguf_linear  # noqa: F401

    w = _weight("Q4_K", 300, 512, 0)
    x = torch.randn(2, 512, device="cuda", dtype=torch.bfloat16)
    eager = torch.ops.tandem.gguf_linear(x, w.data, w.type_id, 512)
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        torch.ops.tandem.gguf_linear(x, w.data, w.type_id, 512)  # compile outside the capture
        with torch.cuda.graph(g, stream=s):
            y = torch.ops.tandem.gguf_linear(x, w.data, w.type_id, 512)
    x.copy_(torch.randn_like(x))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, torch.ops.tandem.gguf_linear(x, w.data, w.type_id, 512))
    assert not torch.equal(y, eager)

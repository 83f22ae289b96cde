"""ext/cuda/gguf_tile (tensor-core GEMV over the tile layout, scratch + cuBLAS above 16 rows)
against dequantize-then-matmul, and inside a CUDA graph (GPU tests)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tandem.ext.cuda as cuda_ext

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not cuda_ext.is_available(), reason="needs CUDA and CuPy"),
]

TYPES = ["Q4_0", "Q4_1", "Q4_K"]


def _weight(qtype: str, n: int, k: int, seed: int):
    from tandem.models.quant.tensor import QuantizedTensor
    from tests.models.quant_cases import pack

    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * 0.1
    data = torch.from_numpy(np.ascontiguousarray(pack(w, qtype))).cuda()
    return QuantizedTensor(qtype, data, k)


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("rows", [1, 2, 7, 9, 16, 64, 300])
def test_matches_dequantize_then_matmul(qtype: str, rows: int) -> None:
    from tandem.ext.cuda import gguf_tile  # noqa: F401

    k = 768 if qtype.endswith("_K") else 64 * (2 + rows % 5)
    n = 16 * (3 + rows % 4)
    w = _weight(qtype, n, k, rows)
    t = w.as_tiles()
    assert t.layout == "tile16" and torch.equal(t.as_rows().data, w.data)
    x = torch.randn(rows, k, device="cuda", generator=torch.Generator("cuda").manual_seed(rows))
    for dtype in (torch.bfloat16, torch.float16):
        xd = x.to(dtype)
        expected = xd.double() @ w.dequantize().double().T
        got = torch.ops.tandem.gguf_tile_linear(xd, t.data, t.type_id, k)
        assert got.dtype == dtype and got.shape == (rows, n)
        tol = 2e-2 if rows > 16 else 1e-2  # prefill: the weight itself rounded to 16 bits
        torch.testing.assert_close(got.double(), expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("n,k", [(1024, 4096), (16416, 512)])  # 1 and 2 tiles per CTA
@pytest.mark.parametrize("rows", [1, 3, 12])
def test_large_shape_agrees_with_row_kernel(qtype: str, n: int, k: int, rows: int) -> None:
    """8B-like shapes (many chunks per warp, many tiles) against the row-layout GEMV."""
    from tandem.ext.cuda import gguf_linear, gguf_tile  # noqa: F401  (the ops)

    tid = {"Q4_0": 2, "Q4_1": 3, "Q4_K": 12}[qtype]
    assert gguf_tile.tiles_per_cta(tid, n) == (2 if n > 16384 and qtype != "Q4_0" else 1)
    w = _weight(qtype, n, k, 5)
    t = w.as_tiles()
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    a = torch.ops.tandem.gguf_tile_linear(x, t.data, t.type_id, k).double()
    b = torch.ops.tandem.gguf_linear(x, w.data, w.type_id, k).double()
    ref = x.double() @ w.dequantize().double().T
    assert ((a - ref).norm(dim=1) / ref.norm(dim=1)).max() < 5e-3
    assert ((a - b).norm(dim=1) / ref.norm(dim=1)).max() < 5e-3


def test_strided_x_rows() -> None:
    from tandem.ext.cuda import gguf_tile  # noqa: F401

    w = _weight("Q4_0", 64, 512, 3)
    t = w.as_tiles()
    big = torch.randn(4, 1024, device="cuda", dtype=torch.bfloat16)
    x = big[:, 256:768]  # row stride 1024
    got = torch.ops.tandem.gguf_tile_linear(x, t.data, t.type_id, 512).double()
    ref = x.double() @ w.dequantize().double().T
    torch.testing.assert_close(got, ref, rtol=1e-2, atol=1e-2)


def test_inside_a_cuda_graph() -> None:
    from tandem.ext.cuda import gguf_tile  # noqa: F401

    t = _weight("Q4_K", 304, 512, 0).as_tiles()
    x = torch.randn(2, 512, device="cuda", dtype=torch.bfloat16)
    eager = torch.ops.tandem.gguf_tile_linear(x, t.data, t.type_id, 512)
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        torch.ops.tandem.gguf_tile_linear(x, t.data, t.type_id, 512)  # compile outside capture
        with torch.cuda.graph(g, stream=s):
            y = torch.ops.tandem.gguf_tile_linear(x, t.data, t.type_id, 512)
    x.copy_(torch.randn_like(x))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, torch.ops.tandem.gguf_tile_linear(x, t.data, t.type_id, 512))
    assert not torch.equal(y, eager)


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("rows", [1, 2, 7, 16, 64, 300])
def test_swiglu_pairs_match_torch(qtype: str, rows: int) -> None:
    """silu(x G^T) * (x U^T) from paired gate/up tiles, against the dequantized weights."""
    from tandem.ext.cuda import gguf_tile  # noqa: F401

    k, inter = 512, 8 * (2 + rows % 3) + (8192 if rows == 2 else 0)  # 2: two tiles per CTA
    w = _weight(qtype, 2 * inter, k, rows)
    p = w.as_tiles(pairs=True)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    gate, up = (x @ w.dequantize(torch.bfloat16).T).chunk(2, dim=-1)
    expected = (torch.nn.functional.silu(gate) * up).double()
    got = torch.ops.tandem.gguf_tile_swiglu(x, p.data, p.type_id, k)
    assert got.shape == (rows, inter) and got.dtype == torch.bfloat16
    err = (got.double() - expected).norm(dim=1) / expected.norm(dim=1)
    assert err.max() < 2e-2


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("rows", [1, 5, 16])
def test_settings_agree(qtype: str, rows: int) -> None:
    """Every (warps, chunks in flight, offset fold) setting against the reference; with the
    same warps and fold the sums run in the same order, so depth and programmatic launch change
    no bit."""
    from tandem.ext.cuda import _loader, gguf_tile

    n, k = 2048, 4096
    t = _weight(qtype, n, k, 11).as_tiles()
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    ref = x.double() @ t.dequantize().double().T
    for warps in (8, 16):
        for fold in (False, True):
            outs = []
            for depth, pdl in [(2, True), (4, True), (2, False)]:
                _loader.PDL["on"] = pdl
                try:
                    out = torch.full((rows, n), float("nan"), device="cuda", dtype=torch.bfloat16)
                    gguf_tile.launch_gemv(
                        x, t.data, t.type_id, out, warps=warps, depth=depth, fold=fold
                    )
                finally:
                    _loader.PDL["on"] = True
                outs.append(out)
            assert all(torch.equal(o, outs[0]) for o in outs[1:])
            assert ((outs[0].double() - ref).norm(dim=1) / ref.norm(dim=1)).max() < 5e-3
    with pytest.raises(ValueError, match="warps"):
        gguf_tile.launch_gemv(x, t.data, t.type_id, out, warps=4)


def test_dependent_chain_in_a_graph_waits_for_each_input() -> None:
    """GEMVs launched with programmatic dependent launch, each reading the one before (and a
    torch op between), replayed in a graph: equal to the same chain launched plainly."""
    from tandem.ext.cuda import _loader, gguf_tile  # noqa: F401

    k = 1024
    ws = [_weight("Q4_0", k, k, 20 + i).as_tiles() for i in range(4)]
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)

    def chain() -> torch.Tensor:
        y = x
        for i, w in enumerate(ws):
            y = torch.ops.tandem.gguf_tile_linear(y, w.data, w.type_id, k)
            y = y / y.abs().amax() if i == 1 else y  # a torch kernel in between
        return y

    _loader.PDL["on"] = False
    try:
        plain = chain()
    finally:
        _loader.PDL["on"] = True
    assert torch.equal(chain(), plain)
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        chain()
        with torch.cuda.graph(g, stream=s):
            y = chain()
    for seed in range(3):
        x.copy_(
            torch.randn(1, k, device="cuda", generator=torch.Generator("cuda").manual_seed(seed))
        )
        g.replay()
        torch.cuda.synchronize()
        _loader.PDL["on"] = False
        try:
            assert torch.equal(y, chain())
        finally:
            _loader.PDL["on"] = True

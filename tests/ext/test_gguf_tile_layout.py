"""ext/cuda/gguf_tile.py's tile layout on the CPU: `from_tiles(to_tiles(x)) == x` byte for byte,
and an emulation of gguf_tile.cu's MMA kernel built from the PTX m16n8k16 fragment layouts (not
from the relayout's own index table) that must reproduce dequantize-then-matmul."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tandem.ext.cuda.gguf_tile import TILE_TYPES, from_tiles, supports, tile_bytes, to_tiles
from tandem.models.quant.tensor import QuantizedTensor
from tests.models.quant_cases import pack

TYPES = {"Q4_0": 2, "Q4_1": 3, "Q4_K": 12}


def _weight(qtype: str, n: int, k: int, seed: int = 0) -> QuantizedTensor:
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * 0.1
    return QuantizedTensor(qtype, torch.from_numpy(np.ascontiguousarray(pack(w, qtype))), k)


@pytest.mark.parametrize("qtype", list(TYPES))
@pytest.mark.parametrize("n,k", [(16, 256), (48, 512), (4112, 256)])
def test_round_trip_is_exact(qtype: str, n: int, k: int) -> None:
    w = _weight(qtype, n, k, seed=n)
    tid = TYPES[qtype]
    tiles = to_tiles(w.data, tid, k)
    assert tiles.shape == (n // 16, tile_bytes(tid, k))
    if qtype != "Q4_K":  # Q4_0 / Q4_1 keep their exact GGUF size
        assert tiles.numel() == w.data.numel()
    else:
        assert tiles.numel() <= 1.03 * w.data.numel()
    assert torch.equal(from_tiles(tiles, tid, k), w.data)


def test_supports() -> None:
    assert supports(2, 32, 64) and not supports(2, 40, 64) and not supports(2, 32, 96)
    assert supports(12, 16, 256) and not supports(12, 16, 320)
    assert not supports(8, 16, 256)  # Q8_0 keeps the row layout
    assert set(TILE_TYPES) == set(TYPES.values())


def _emulate(tiles: torch.Tensor, tid: int, k: int, x: torch.Tensor) -> torch.Tensor:
    """gguf_tile_gemv_kernel in numpy: per chunk and k-tile, A and B rebuilt from each lane's
    registers by the PTX fragment layout, D = A @ B, block scales on each 32-column sum."""
    _, _, _, meta, _ = TILE_TYPES[tid]
    ntiles, chunks, m = tiles.shape[0], k // 64, x.shape[0]
    t8 = tiles.numpy()
    off = 8 if tid == 2 else 0
    xs = x.numpy().astype(np.float64)
    out = np.zeros((m, ntiles * 16))
    lanes = np.arange(32)
    g, t = lanes // 4, lanes % 4
    for tile in range(ntiles):
        base = t8[tile]
        for c in range(chunks):
            words = base[c * 512 : (c + 1) * 512].reshape(32, 16).view("<u4")  # [lane, 4 words]
            d, mn = _scales(base, tid, chunks, meta, c)  # [16 rows, 2 blocks]
            for b in range(2):
                part = np.zeros((16, m))
                ssum = np.zeros(m)
                for s in range(2):
                    a = np.zeros((16, 16))
                    for p in range(4):  # register p: rows g / g + 8, columns 2t (+8) + {0, 1}
                        for h in range(2):
                            code = (words[:, 2 * b + s] >> (4 * p + 16 * h)) & 15
                            a[g + 8 * (p & 1), 2 * t + 8 * (p >> 1) + h] = code.astype(float) - off
                    bm = np.zeros((16, m))  # B row 2t + 8r + h <- x column 32b + 8t + 4s + 2r + h
                    for r in range(2):
                        for h in range(2):
                            cols = c * 64 + 32 * b + 8 * t + 4 * s + 2 * r + h
                            bm[2 * t + 8 * r + h, :] = xs[:, cols].T
                    part += a @ bm
                    ssum += bm.sum(axis=0)
                rows = slice(tile * 16, tile * 16 + 16)
                out[:, rows] += (d[:, b : b + 1] * part).T + (mn[:, b : b + 1] * ssum[None, :]).T
    return torch.from_numpy(out)


def _scales(base: np.ndarray, tid: int, chunks: int, meta: int, c: int):
    """(d, m) [16 rows, 2 blocks] of chunk c, value = d * q + m, from the tile's scale region."""
    region = base[chunks * 512 + c * meta : chunks * 512 + (c + 1) * meta]
    d, m = np.zeros((16, 2)), np.zeros((16, 2))
    for g in range(8):
        for h in range(2):
            r = g + 8 * h
            if tid == 2:
                d[r] = region[g * 8 + h * 4 : g * 8 + h * 4 + 4].view("<f2")
            elif tid == 3:
                dm = region[g * 16 + h * 8 : g * 16 + h * 8 + 8].view("<f2").reshape(2, 2)
                d[r], m[r] = dm[:, 0], dm[:, 1]
            else:
                sb = base[chunks * 576 + (c // 4) * 64 + g * 8 + h * 4 :][:4].view("<f2")
                by = region[g * 8 + h * 4 : g * 8 + h * 4 + 4]
                d[r] = float(sb[0]) * by[0:2]
                m[r] = -float(sb[1]) * by[2:4]
    return d, m


@pytest.mark.parametrize("qtype", list(TYPES))
@pytest.mark.parametrize("m", [1, 3])
def test_mma_emulation_matches_dequantize(qtype: str, m: int) -> None:
    k, n = 512, 32
    w = _weight(qtype, n, k, seed=m)
    tid = TYPES[qtype]
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    got = _emulate(to_tiles(w.data, tid, k), tid, k, x)
    expected = x.double() @ w.dequantize().double().T
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("qtype", list(TYPES))
def test_paired_tiles_round_trip(qtype: str) -> None:
    """A [gate; up] weight with its rows paired (8 gate rows, the same 8 up rows per tile)
    dequantizes as the rows did."""
    w = _weight(qtype, 64, 256, seed=7)
    paired = w.as_tiles(pairs=True)
    assert paired.layout == "tile16x2" and paired.rows == 64
    assert torch.equal(paired.as_rows().data, w.data)
    assert torch.equal(paired.dequantize(), w.dequantize())
    assert torch.equal(w.as_tiles().as_tiles(pairs=True).data, paired.data)
    gate, up = w.data[:32], w.data[32:]
    tile1 = torch.cat((gate[8:16], up[8:16]))  # tile 1: gate rows 8-15, then up rows 8-15
    assert torch.equal(paired.data[1], gguf_tile_rows_to_tiles(tile1, TYPES[qtype], 256)[0])


def gguf_tile_rows_to_tiles(rows: torch.Tensor, tid: int, k: int) -> torch.Tensor:
    return to_tiles(rows, tid, k)

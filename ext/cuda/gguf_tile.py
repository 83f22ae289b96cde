"""GGUF 4-bit weights (Q4_0, Q4_1, Q4_K) in a tensor-core tile layout (`gguf_tile.cu`):
`to_tiles` / `from_tiles` (pure torch, exact inverses) and `torch.ops.tandem.gguf_tile_linear`.

A tile is 16 weight rows over all K columns: first the 4-bit codes of each 64-column chunk in
the order of the m16n8k16 MMA's A fragments (512 bytes: 16 per lane), then each chunk's block
scales (Q4_0 d; Q4_1 d, m; Q4_K 8-bit sub-block scales and mins), then (Q4_K) each superblock's
d, dmin. The bytes stay packed: Q4_0 and Q4_1 take exactly their GGUF size, Q4_K 2.8% more
(its 6-bit scales widened to bytes). Up to `MAX_ROWS` rows of x: one pass over the tiles with
the MMA (weights decoded in registers, fp32 accumulation); more rows: dequantize into a scratch
buffer, then cuBLAS. A gated MLP's gate_up weight may pair its rows (8 gate rows, then the same
8 up rows, in every tile) so that one GEMV also applies silu(gate) * up (`gguf_tile_swiglu`). Knows nothing about models.
"""

from __future__ import annotations

import torch

from tandem.ext.cuda._loader import i32, i64, launch, ptr

MAX_ROWS = 16
# Types whose GEMV turns codes into (magic + q) and removes magic through x's block sums (which
# their mins need anyway): fewer instructions a chunk. Q4_0 keeps one fma per code pair: the
# fold would add the block-sum MMAs and registers past its 4 CTAs an SM. (Benchmarks edit it.)
FOLD_TYPES = {3, 12}
# Types whose GEMV is launched with programmatic dependent launch. Q4_0 gained (8B linears
# alone 2.06 -> 2.02 ms, engine graph 2.58 -> 2.42 ms with the other kernels'); Q4_K lost (2.74
# -> 2.89 ms: its CTAs, up to 3 an SM, launched early pile onto the SMs that free first), so
# Q4_1 and Q4_K launch plainly (docs/BENCHMARKS.md).
PDL_TYPES = {2}
_DT = {torch.float16: 0, torch.bfloat16: 1}
# ggml type id -> (name, GGUF bytes per 32/256-value block, values per block, meta bytes per
# 64-column chunk of a tile, bytes per 256-column superblock of a tile)
TILE_TYPES = {
    2: ("Q4_0", 18, 32, 64, 0),
    3: ("Q4_1", 20, 32, 128, 0),
    12: ("Q4_K", 144, 256, 64, 64),
}
_NAMES = {v[0]: k for k, v in TILE_TYPES.items()}
_CHUNK_ROWS = 4096  # rows converted at a time: bounds the temporaries


def type_id_of(qtype: str) -> int | None:
    return _NAMES.get(qtype)


def tile_bytes(type_id: int, k: int) -> int:
    _, _, _, meta, sb = TILE_TYPES[type_id]
    return k // 64 * (512 + meta) + k // 256 * sb


def supports(type_id: int, n: int, k: int) -> bool:
    """Whether a [n, k] weight of this type can take the tile layout."""
    if type_id not in TILE_TYPES:
        return False
    return n % 16 == 0 and k % (256 if type_id == 12 else 64) == 0


def _lane_index(device: torch.device) -> torch.Tensor:
    """[32 lanes, 4 words, 8 nibbles] -> row * 64 + column inside a (16-row, 64-column) chunk.

    Word kt of lane (g, t) feeds the k-tile kt of the chunk (block b = kt // 2, half s = kt % 2);
    nibbles p and p + 4 form A register p: p = 0 row g, 1 row g + 8, 2 row g, 3 row g + 8, at
    columns 32b + 8t + 4s + 2 (p >> 1) + {0, 1}. Column order inside a k-tile is permuted so
    that the same lane's x values are 8 consecutive columns (one 16-byte load)."""
    lane = torch.arange(32).view(32, 1, 1)
    kt = torch.arange(4).view(1, 4, 1)
    pos = torch.arange(8).view(1, 1, 8)
    g, t, p, h = lane // 4, lane % 4, pos % 4, pos // 4
    row = g + 8 * (p & 1)
    col = 32 * (kt // 2) + 8 * t + 4 * (kt % 2) + 2 * (p >> 1) + h
    return (row * 64 + col).to(device)


def _codes(blocks: torch.Tensor, type_id: int) -> torch.Tensor:
    """GGUF blocks [n, blocks, bytes] -> 4-bit codes [n, k] uint8 in column order."""
    n = blocks.shape[0]
    if type_id == 12:
        qs = blocks[..., 16:144].reshape(n, -1, 4, 1, 32)
        return torch.cat((qs & 15, qs >> 4), dim=3).reshape(n, -1)
    qs = blocks[..., -16:].reshape(n, -1, 1, 16)
    return torch.cat((qs & 15, qs >> 4), dim=2).reshape(n, -1)


def _k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K 12-byte scales [..., 12] -> 6-bit scales and mins [..., 8] uint8."""
    lo_d, lo_m, hi = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat((lo_d & 63, (hi & 15) | ((lo_d >> 2) & 48)), dim=-1)
    mn = torch.cat((lo_m & 63, (hi >> 4) | ((lo_m >> 2) & 48)), dim=-1)
    return sc, mn


def _k_pack(sc: torch.Tensor, mn: torch.Tensor) -> torch.Tensor:
    """Inverse of `_k_scales`."""
    lo_d = (sc[..., 0:4] & 63) | ((sc[..., 4:8] >> 4) << 6)
    lo_m = (mn[..., 0:4] & 63) | ((mn[..., 4:8] >> 4) << 6)
    hi = (sc[..., 4:8] & 15) | ((mn[..., 4:8] & 15) << 4)
    return torch.cat((lo_d, lo_m, hi), dim=-1)


def _rows_to_tiles(data: torch.Tensor, type_id: int, k: int) -> torch.Tensor:
    _, bsize, bvals, _, _ = TILE_TYPES[type_id]
    n = data.shape[0]
    tiles, chunks = n // 16, k // 64
    blocks = data.view(n, k // bvals, bsize)
    q = _codes(blocks, type_id).view(tiles, 16, chunks, 64).transpose(1, 2)
    nib = q.reshape(tiles, chunks, 1024)[:, :, _lane_index(data.device).view(-1)]
    codes = (nib[..., 0::2] | (nib[..., 1::2] << 4)).reshape(tiles, -1)
    parts = [codes]
    if type_id == 2:  # d [n, k/32]: chunk c, lane group g -> (row g: b0, b1), (row g + 8: b0, b1)
        d = blocks[..., 0:2].reshape(tiles, 2, 8, chunks, 4)
        parts.append(d.permute(0, 3, 2, 1, 4).reshape(tiles, -1))
    elif type_id == 3:  # (d, m) per block
        dm = blocks[..., 0:4].reshape(tiles, 2, 8, chunks, 8)
        parts.append(dm.permute(0, 3, 2, 1, 4).reshape(tiles, -1))
    else:
        sc, mn = _k_scales(blocks[..., 4:16])  # [n, k/256, 8]
        sm = torch.stack(
            (sc.reshape(tiles, 2, 8, chunks, 2), mn.reshape(tiles, 2, 8, chunks, 2)), 4
        )
        parts.append(sm.permute(0, 3, 2, 1, 4, 5).reshape(tiles, -1))
        dd = blocks[..., 0:4].reshape(tiles, 2, 8, k // 256, 4)
        parts.append(dd.permute(0, 3, 2, 1, 4).reshape(tiles, -1))
    return torch.cat(parts, dim=1)


def _tiles_to_rows(tiles_data: torch.Tensor, type_id: int, k: int) -> torch.Tensor:
    _, bsize, bvals, meta, _ = TILE_TYPES[type_id]
    tiles = tiles_data.shape[0]
    n, chunks = tiles * 16, k // 64
    codes = tiles_data[:, : chunks * 512].reshape(tiles, chunks, 512)
    nib = torch.stack((codes & 15, codes >> 4), dim=-1).reshape(tiles, chunks, 1024)
    q = torch.empty_like(nib)
    q[:, :, _lane_index(tiles_data.device).view(-1)] = nib
    q = q.view(tiles, chunks, 16, 64).transpose(1, 2).reshape(n, k)
    m0 = chunks * 512
    scales = tiles_data[:, m0 : m0 + chunks * meta]
    if type_id == 12:
        sb = tiles_data[:, m0 + chunks * meta :].reshape(tiles, k // 256, 8, 2, 4)
        dd = sb.permute(0, 3, 2, 1, 4).reshape(n, k // 256, 4)
        sm = scales.reshape(tiles, chunks, 8, 2, 2, 2).permute(0, 3, 2, 1, 4, 5)
        sm = sm.reshape(n, k // 256, 4, 2, 2).transpose(2, 3).reshape(n, k // 256, 2, 8)
        qs = q.view(n, k // 256, 4, 2, 32)
        packed = qs[:, :, :, 0] | (qs[:, :, :, 1] << 4)
        return torch.cat(
            (dd, _k_pack(sm[:, :, 0], sm[:, :, 1]), packed.reshape(n, -1, 128)), -1
        ).reshape(n, -1)
    width = 4 if type_id == 2 else 8
    head = scales.reshape(tiles, chunks, 8, 2, width).permute(0, 3, 2, 1, 4)
    head = head.reshape(n, k // 32, bsize - 16)
    qs = q.view(n, k // 32, 2, 16)
    packed = qs[:, :, 0] | (qs[:, :, 1] << 4)
    return torch.cat((head, packed), -1).reshape(n, -1)


def to_tiles(data: torch.Tensor, type_id: int, k: int) -> torch.Tensor:
    """GGUF rows [N, row_bytes] uint8 -> tiles [N / 16, tile_bytes] uint8 (same device)."""
    if not supports(type_id, data.shape[0], k):
        raise ValueError(f"type {type_id} [{data.shape[0]}, {k}] has no tile layout")
    step = _CHUNK_ROWS
    parts = [_rows_to_tiles(data[i : i + step], type_id, k) for i in range(0, data.shape[0], step)]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def from_tiles(tiles_data: torch.Tensor, type_id: int, k: int) -> torch.Tensor:
    """Inverse of `to_tiles`: the GGUF rows, byte for byte."""
    step = _CHUNK_ROWS // 16
    parts = [
        _tiles_to_rows(tiles_data[i : i + step], type_id, k)
        for i in range(0, tiles_data.shape[0], step)
    ]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def tiles_per_cta(type_id: int, n: int) -> int:
    """Tiles one CTA of the GEMV takes: for the types with mins, 2 (sharing x's loads and block
    sums) where that still leaves several CTAs per SM; else 1 (Q4_0 measured faster at one
    tile and three CTAs an SM)."""
    return 2 if type_id != 2 and n >= 16384 and n % 32 == 0 else 1


_SMS: dict[int, int] = {}


def warps_per_cta(type_id: int, n: int, m: int, device: torch.device) -> int:
    """Warps splitting a tile's chunks: 16 where the tiles alone would leave SMs with few
    warps (Q4_0 at up to 8 rows of x, whose registers allow two such CTAs an SM), else 8."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    sms = _SMS.get(index)
    if sms is None:
        sms = _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return 16 if type_id == 2 and m <= 8 and n // 16 <= 2 * sms else 8


def pair_rows(data: torch.Tensor) -> torch.Tensor:
    """A [gate; up] weight's rows (any per-row layout) -> blocks of 8 gate rows, then the 8 up
    rows of the same indices (a copy), so that a tile's rows g and g + 8 are gate and up."""
    n = data.shape[0]
    if n % 16:
        raise ValueError("pairing needs N % 16 == 0")
    return data.reshape(2, n // 16, 8, -1).transpose(0, 1).reshape(n, *data.shape[1:])


def unpair_rows(data: torch.Tensor) -> torch.Tensor:
    """Inverse of `pair_rows`."""
    n = data.shape[0]
    return data.reshape(n // 16, 2, 8, -1).transpose(0, 1).reshape(n, *data.shape[1:])


def _check(tiles_data: torch.Tensor, type_id: int, k: int, device: torch.device) -> int:
    if type_id not in TILE_TYPES or k % (256 if type_id == 12 else 64):
        raise ValueError(f"type {type_id} with K={k} has no tile layout")
    if tiles_data.dtype != torch.uint8 or tiles_data.dim() != 2 or not tiles_data.is_contiguous():
        raise ValueError("tiles must be a contiguous 2-D uint8 tensor")
    if tiles_data.shape[1] != tile_bytes(type_id, k) or tiles_data.device != device:
        raise ValueError(f"tiles must be [N/16, {tile_bytes(type_id, k)}] on {device}")
    if tiles_data.data_ptr() % 16:
        raise ValueError("tiles must be 16-byte aligned")
    return tiles_data.shape[0] * 16


def launch_gemv(
    x: torch.Tensor,
    tiles_data: torch.Tensor,
    type_id: int,
    out: torch.Tensor,
    swiglu: bool = False,
    warps: int | None = None,
    depth: int = 2,
    fold: bool | None = None,
) -> None:
    """out[M, N] = x[M, K] @ W^T, 1 <= M <= MAX_ROWS, x/out fp16 or bf16, 16-byte rows.
    `swiglu`: W's rows are paired (`pair_rows`) and out[M, N / 2] = silu(gate) * up.
    `warps` (8 or 16; default `warps_per_cta`) and `depth` (chunks in flight per warp, 2 or 4)
    are for benchmarks, and `fold` (default: type in `FOLD_TYPES`): the codes' offset subtracted
    through x's block sums instead of one fma per code pair. Types in `PDL_TYPES` launch with
    programmatic dependent launch where the device has it."""
    if warps not in (None, 8, 16) or depth not in (2, 4):
        raise ValueError("warps must be 8 or 16, depth 2 or 4")
    m, k = x.shape
    n = _check(tiles_data, type_id, k, x.device)
    if not 1 <= m <= MAX_ROWS or x.dtype not in _DT or out.dtype != x.dtype:
        raise ValueError(f"x must be [1..{MAX_ROWS}, K] fp16/bf16, out the same dtype")
    n_out = n // 2 if swiglu else n
    if out.shape != (m, n_out) or x.stride(1) != 1 or out.stride(1) != 1:
        raise ValueError(f"out must be [{m}, {n_out}] with contiguous rows")
    if x.stride(0) % 8 or x.data_ptr() % 16:
        raise ValueError("x rows must be 16-byte aligned")
    r = tiles_per_cta(type_id, n)
    w = warps or warps_per_cta(type_id, n, m, x.device)
    launch(
        "gguf_tile.cu",
        f"gguf_tile_gemv_kernel<{type_id},{m},{_DT[x.dtype]},{r},{int(swiglu)},{w},{depth},"
        f"{int(type_id in FOLD_TYPES if fold is None else fold)}>",
        x.device,
        (n // (16 * r), 1, 1),
        (32 * w, 1, 1),
        (ptr(x), ptr(tiles_data), ptr(out), i32(k), i64(x.stride(0)), i64(out.stride(0))),
        pdl=type_id in PDL_TYPES,
    )


def launch_dequant(tiles_data: torch.Tensor, type_id: int, k: int, out: torch.Tensor) -> None:
    """out[N, K] (fp16/bf16, contiguous) = the tiled weight's values."""
    n = _check(tiles_data, type_id, k, out.device)
    if out.shape != (n, k) or not out.is_contiguous() or out.dtype not in _DT:
        raise ValueError(f"out must be a contiguous [{n}, {k}] fp16/bf16 tensor")
    threads = n // 16 * (k // 64) * 32
    launch(
        "gguf_tile.cu",
        f"gguf_tile_dequant_kernel<{type_id},{_DT[out.dtype]}>",
        out.device,
        (-(-threads // 256), 1, 1),
        (256, 1, 1),
        (ptr(tiles_data), ptr(out), i32(n), i32(k)),
    )


@torch.library.custom_op("tandem::gguf_tile_linear", mutates_args=())
def gguf_tile_linear(
    x: torch.Tensor, tiles_data: torch.Tensor, type_id: int, k: int
) -> torch.Tensor:
    """x[M, K] (fp16/bf16, CUDA) @ W[N, K]^T with W in the tile layout of ggml type `type_id`."""
    m = x.shape[0]
    n = tiles_data.shape[0] * 16
    if 1 <= m <= MAX_ROWS:
        if x.stride(1) != 1 or x.stride(0) % 8 or x.data_ptr() % 16:
            x = x.contiguous()
        out = torch.empty(m, n, device=x.device, dtype=x.dtype)
        launch_gemv(x, tiles_data, type_id, out)
        return out
    w = torch.empty(n, k, device=x.device, dtype=x.dtype)  # scratch, from torch's cache
    launch_dequant(tiles_data, type_id, k, w)
    return torch.nn.functional.linear(x, w)


@gguf_tile_linear.register_fake
def _(x, tiles_data, type_id, k):
    return x.new_empty(x.shape[0], tiles_data.shape[0] * 16)


@torch.library.custom_op("tandem::gguf_tile_swiglu", mutates_args=())
def gguf_tile_swiglu(
    x: torch.Tensor, tiles_data: torch.Tensor, type_id: int, k: int
) -> torch.Tensor:
    """silu(x @ G^T) * (x @ U^T), [M, N / 2], with [G; U] paired (`pair_rows`), then tiled."""
    m = x.shape[0]
    n = tiles_data.shape[0] * 16
    if 1 <= m <= MAX_ROWS:
        if x.stride(1) != 1 or x.stride(0) % 8 or x.data_ptr() % 16:
            x = x.contiguous()
        out = torch.empty(m, n // 2, device=x.device, dtype=x.dtype)
        launch_gemv(x, tiles_data, type_id, out, swiglu=True)
        return out
    w = torch.empty(n, k, device=x.device, dtype=x.dtype)
    launch_dequant(tiles_data, type_id, k, w)
    y = torch.nn.functional.linear(x, w).view(m, n // 16, 2, 8)
    gate, up = y[:, :, 0].reshape(m, n // 2), y[:, :, 1].reshape(m, n // 2)
    return torch.nn.functional.silu(gate) * up


@gguf_tile_swiglu.register_fake
def _(x, tiles_data, type_id, k):
    return x.new_empty(x.shape[0], tiles_data.shape[0] * 8)

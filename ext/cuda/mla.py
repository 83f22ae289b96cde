"""Multi-head latent attention (DeepSeek MLA, absorbed form) on CUDA: the kernels behind the
`torch.ops.tandem.mla_attention` custom op (`mla_sm90.cu` on Hopper for 64-head tiles,
`mla_decode.cu` everywhere else), the choice between them and their split-KV plan.

Each kernel serves decode and extend rows: each query token attends with all its heads to its
causal prefix of the paged latent cache. Validation happens before any launch; launches go on
torch's current stream, read no device value on the host and allocate only the split-KV
scratch from torch's allocator (CUDA-graph safe). The reference is ext/mla_ref.py.
"""

from __future__ import annotations

import logging
import math
from functools import cache

import torch

from tandem.ext.cuda._loader import f32, get_cubin_kernel, i32, i64, launch, launch_cubin, ptr
from tandem.ext.cuda.sm90_build import sm90_cubin

log = logging.getLogger(__name__)

LATENT_DIMS = (128, 256, 512)  # kv_lora_rank values the kernel is built for
ROPE_DIMS = (16, 32, 64)
_DT = {torch.float16: 0, torch.bfloat16: 1}
_LOG2E = 1.4426950408889634
_TILE = 32  # tokens per CTA iteration (MLA_N)
_STAGES = 3
_MIN_PART_LEN = 128  # a partition re-loads its CTA's queries: keep that under half its reads
_MAX_PARTS = 128  # mla_combine_kernel's shared weight array
# Hopper kernel (mla_sm90.cu): wgmma over 64 heads x 64-row tiles, for L = 512, R = 64
SM90_SHAPE = (512, 64)
SM90_HEADS = 64
SM90_TILE = 64
SM90_SMEM = 3 * 64 * 576 * 2 + 64 * 64 * 2 + 3 * 64 * 4 + 1024  # mirrors mla90:: in the .cu
_SM90_DT = {torch.float16: "f16", torch.bfloat16: "bf16"}
# split-KV partition counts the Hopper kernel merges inside one thread-block cluster (no float32
# partials, no combine launch). Not 4: clusters of four one-CTA-per-SM blocks did not all fit
# one wave; other counts take the partials and mla_combine_kernel (docs/mla.md).
SM90_CLUSTERS = (2,)
KERNELS = ("auto", "sm90", "portable")
_MAX_GRID_Y = 65535  # tokens per launch (grid.y); x is the head tile, so both tiles of a token
# run in the same wave and the second reads the latent rows from L2


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def rows_per_cta(num_heads: int) -> int:
    """Heads per CTA (HM): 64 where they divide, else 32, else 16."""
    for hm in (64, 32, 16):
        if num_heads % hm == 0:
            return hm
    raise ValueError(f"num_heads {num_heads} must be a multiple of 16")


def warps_per_cta(latent: int, heads_per_cta: int) -> int:
    """8 warps keep their Q fragments in registers (64 heads: the DeepSeek-V3 case); 32 heads
    a CTA take 16 warps, which hide more latency; 16 heads need 8 (the softmax layout)."""
    return 16 if heads_per_cta == 32 and latent >= 256 else 8


def smem_bytes(latent: int, rope: int, heads_per_cta: int) -> int:
    """Dynamic shared memory of one CTA (mirrors MlaSmem in mla_decode.cu)."""
    rs = latent + rope + 8
    ksplit = warps_per_cta(latent, heads_per_cta) // (heads_per_cta // 16)
    return (
        heads_per_cta * rs * 2
        + _STAGES * _TILE * rs * 2
        + heads_per_cta * (_TILE + 8) * 2
        + ksplit * heads_per_cta * (_TILE + 4) * 4
        + 3 * heads_per_cta * 4
    )


@cache
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def plan_mla(
    num_tokens: int, head_tiles: int, max_seq_len: int, num_sms: int, tile: int = _TILE
) -> tuple[int, int]:
    """Split-KV plan (part_len, num_parts) from host integers only, so a CUDA graph captured
    with an upper bound `max_seq_len` stays valid for shorter contexts. One CTA fits an SM:
    aim for one full wave (never a second, mostly idle one). part_len is a multiple of the
    kernel's `tile`."""
    max_seq_len = max(1, max_seq_len)
    base = max(1, num_tokens * head_tiles)
    want = min(_MAX_PARTS, num_sms // base)
    if want <= 1 or max_seq_len <= _MIN_PART_LEN:
        return max_seq_len, 1
    part_len = max(_MIN_PART_LEN, math.ceil(max_seq_len / want))
    part_len = math.ceil(part_len / tile) * tile
    return part_len, math.ceil(max_seq_len / part_len)


def _check_rows(x: torch.Tensor, name: str, dtype: torch.dtype) -> None:
    _check(x.dim() == 3, f"{name} must be 3-D [tokens, heads, dim], got {tuple(x.shape)}")
    _check(x.dtype == dtype, f"{name} dtype {x.dtype} != latent_cache dtype {dtype}")
    _check(x.stride(2) == 1, f"{name} must be contiguous in its last dim")
    _check(
        x.data_ptr() % 16 == 0 and x.stride(0) % 8 == 0 and x.stride(1) % 8 == 0,
        f"{name} rows must be 16-byte aligned (strides {x.stride()})",
    )


def _check_int(x: torch.Tensor, name: str, dim: int) -> None:
    _check(x.dtype == torch.int32, f"{name} must be int32, got {x.dtype}")
    _check(x.dim() == dim, f"{name} must be {dim}-D, got {tuple(x.shape)}")
    _check(x.stride(-1) == 1, f"{name} must be contiguous in its last dim")


def check_mla_args(
    out: torch.Tensor,
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    latent_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
) -> tuple[int, int, int, int]:
    """Raise ValueError unless the kernel takes these operands; returns (L, R, H, block_size).
    Shapes and dtypes are checked before devices, so the messages are testable on a CPU."""
    _check(
        latent_cache.dim() == 3,
        f"latent_cache must be [num_blocks, block_size, L + R], got {tuple(latent_cache.shape)}",
    )
    dtype = latent_cache.dtype
    _check(dtype in _DT, f"latent_cache dtype must be bf16 or fp16, got {dtype}")
    _check(latent_cache.is_contiguous(), "latent_cache must be contiguous")
    _check(latent_cache.data_ptr() % 16 == 0, "latent_cache must be 16-byte aligned")
    _, block_size, row = latent_cache.shape
    _check(
        block_size > 0 and block_size & (block_size - 1) == 0,
        f"block_size must be a power of 2, got {block_size}",
    )
    _check_rows(q_latent, "q_latent", dtype)
    _check_rows(q_rope, "q_rope", dtype)
    num_tokens, num_heads, latent = q_latent.shape
    rope = q_rope.shape[2]
    _check(
        q_rope.shape[:2] == (num_tokens, num_heads),
        f"q_rope {tuple(q_rope.shape)} does not match q_latent {tuple(q_latent.shape)}",
    )
    _check(latent in LATENT_DIMS, f"latent dim L={latent} not in {LATENT_DIMS}")
    _check(rope in ROPE_DIMS, f"rope dim R={rope} not in {ROPE_DIMS}")
    _check(
        row == latent + rope,
        f"latent_cache rows hold {row} values, expected L + R = {latent + rope}",
    )
    _check(num_heads % 16 == 0, f"num_heads {num_heads} must be a multiple of 16")
    _check(
        out.shape == q_latent.shape and out.dtype == dtype and out.is_contiguous(),
        f"out must be a contiguous {tuple(q_latent.shape)} {dtype} tensor",
    )
    _check_int(query_start_loc, "query_start_loc", 1)
    _check_int(seq_lens, "seq_lens", 1)
    _check_int(block_tables, "block_tables", 2)
    num_seqs = seq_lens.shape[0]
    _check(
        query_start_loc.shape[0] == num_seqs + 1, "query_start_loc must have num_seqs + 1 entries"
    )
    _check(block_tables.shape[0] == num_seqs, "block_tables rows != number of sequences")
    device = latent_cache.device
    _check(device.type == "cuda", f"latent_cache must be on a CUDA device, got {device}")
    for name, t in (
        ("out", out),
        ("q_latent", q_latent),
        ("q_rope", q_rope),
        ("query_start_loc", query_start_loc),
        ("seq_lens", seq_lens),
        ("block_tables", block_tables),
    ):
        _check(t.device == device, f"{name} is on {t.device}, expected {device}")
    return latent, rope, num_heads, block_size


def sm90_kernel_name(dtype: torch.dtype, cluster: int) -> str:
    """The Hopper kernel for `dtype` whose clusters merge `cluster` partitions (1: none)."""
    return f"mla90_{_SM90_DT[dtype]}" if cluster == 1 else f"mla90_c{cluster}_{_SM90_DT[dtype]}"


@cache
def _sm90_device(index: int) -> bool:
    return torch.cuda.get_device_capability(index) == (9, 0)


_sm90_warned = False


@cache
def _sm90_module(index: int) -> str | Exception:
    """The built cubin's path once its kernels load on device `index`, else the error."""
    try:
        path = str(sm90_cubin("mla_sm90.cu"))
        for dtype in _SM90_DT:
            for cl in (1, *SM90_CLUSTERS):
                get_cubin_kernel(path, sm90_kernel_name(dtype, cl), index)
        return path
    except Exception as e:  # no nvcc, a failed build, a driver that refuses the cubin
        return e


def choose_kernel(kernel: str, latent: int, rope: int, num_heads: int, index: int) -> str | None:
    """The sm_90a cubin's path where `kernel` allows it and it covers the shape (L = 512,
    R = 64, heads a multiple of 64, a compute-capability 9.0 device, a cubin that builds and
    loads); None: the portable kernel. `kernel="sm90"` raises instead of falling back."""
    _check(kernel in KERNELS, f"kernel must be one of {KERNELS}, got {kernel!r}")
    if kernel == "portable":
        return None
    covered = (latent, rope) == SM90_SHAPE and num_heads % SM90_HEADS == 0
    if kernel == "sm90":
        _check(covered, f"the sm90 MLA kernel needs L, R = {SM90_SHAPE} and heads % 64 == 0")
        _check(_sm90_device(index), "the sm90 MLA kernel needs a compute-capability 9.0 GPU")
    elif not covered or not _sm90_device(index):
        return None
    got = _sm90_module(index)
    if not isinstance(got, Exception):
        return got
    if kernel == "sm90":
        raise RuntimeError(f"the sm90 MLA kernel is unavailable: {got}") from got
    global _sm90_warned
    if not _sm90_warned:
        _sm90_warned = True
        log.warning("MLA: the Hopper kernel is unavailable, using the portable one (%s)", got)
    return None


def launch_mla_attention(
    out: torch.Tensor,
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    latent_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_seq_len: int,
    kernel: str = "auto",
) -> None:
    """Fill out `[T, H, L]`; `max_seq_len` (>= every seq_len; <= 0: the block table's width)
    sizes the split-KV grid. `kernel`: "auto" (the Hopper kernel where it applies), "sm90"
    or "portable" (benchmarks and tests)."""
    latent, rope, num_heads, block_size = check_mla_args(
        out, q_latent, q_rope, latent_cache, query_start_loc, seq_lens, block_tables
    )
    num_tokens, num_seqs = q_latent.shape[0], seq_lens.shape[0]
    if num_tokens == 0:
        return
    if max_seq_len <= 0:
        max_seq_len = block_tables.shape[1] * block_size
    device = latent_cache.device
    index = device.index if device.index is not None else torch.cuda.current_device()
    cubin = choose_kernel(kernel, latent, rope, num_heads, index)
    hm = SM90_HEADS if cubin else rows_per_cta(num_heads)
    head_tiles = num_heads // hm
    tile = SM90_TILE if cubin else _TILE
    part_len, num_parts = plan_mla(num_tokens, head_tiles, max_seq_len, _num_sms(index), tile)
    cluster = num_parts if cubin and num_parts in SM90_CLUSTERS else 1
    partials = num_parts // cluster  # float32 partials for the combine kernel (1: none)
    if partials > 1:
        part_out = torch.empty(
            num_tokens, num_heads, partials, latent, dtype=torch.float32, device=device
        )
        part_lse = torch.empty(num_tokens, num_heads, partials, dtype=torch.float32, device=device)
    else:
        part_out = part_lse = None
    dt = _DT[latent_cache.dtype]
    smem = smem_bytes(latent, rope, hm)
    nw = warps_per_cta(latent, hm)
    for tq0 in range(0, num_tokens, _MAX_GRID_Y):
        rows = min(_MAX_GRID_Y, num_tokens - tq0)
        args = (
            ptr(out),
            ptr(part_out),
            ptr(part_lse),
            ptr(q_latent),
            ptr(q_rope),
            ptr(latent_cache),
            ptr(query_start_loc),
            ptr(seq_lens),
            ptr(block_tables),
            i32(tq0),
            i32(num_seqs),
            i32(num_heads),
            i64(q_latent.stride(0)),
            i64(q_latent.stride(1)),
            i64(q_rope.stride(0)),
            i64(q_rope.stride(1)),
            i32(block_tables.stride(0)),
            i32(block_size.bit_length() - 1),
            i32(part_len),
            i32(num_parts),
            f32(scale * _LOG2E),
        )
        grid = (head_tiles, rows, num_parts)
        if cubin:
            name = sm90_kernel_name(latent_cache.dtype, cluster)
            launch_cubin(cubin, name, device, grid, (256, 1, 1), args, shared_mem=SM90_SMEM)
        else:
            name = f"mla_attention_kernel<{dt},{latent},{rope},{hm // 16},{nw}>"
            launch("mla_decode.cu", name, device, grid, (nw * 32, 1, 1), args, shared_mem=smem)
        if partials > 1:
            launch(
                "mla_decode.cu",
                f"mla_combine_kernel<{dt},{latent}>",
                device,
                (num_heads, rows, 1),
                (128, 1, 1),
                (
                    ptr(out),
                    ptr(part_out),
                    ptr(part_lse),
                    ptr(query_start_loc),
                    ptr(seq_lens),
                    i32(tq0),
                    i32(num_seqs),
                    i32(num_heads),
                    i32(part_len),
                    i32(num_parts),
                ),
            )


@torch.library.custom_op("tandem::mla_attention", mutates_args=("out",))
def mla_attention_op(
    out: torch.Tensor,
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    latent_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_seq_len: int,
    kernel: str = "auto",
) -> None:
    launch_mla_attention(
        out, q_latent, q_rope, latent_cache, query_start_loc, seq_lens, block_tables, scale,
        max_seq_len, kernel,
    )  # fmt: skip


@mla_attention_op.register_fake
def _(out, q_latent, q_rope, latent_cache, query_start_loc, seq_lens, block_tables, scale,
      max_seq_len, kernel="auto") -> None:  # fmt: skip
    return None


def mla_attention_cuda(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    latent_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_seq_len: int | None = None,
    out: torch.Tensor | None = None,
    kernel: str = "auto",
) -> torch.Tensor:
    """MLA of a ragged batch: q_latent `[T, H, L]`, q_rope `[T, H, R]`; sequence i owns rows
    `query_start_loc[i]:query_start_loc[i+1]` (int32 `[S + 1]`), the last tokens of its
    `seq_lens[i]` (int32 `[S]`), whose rows are already in latent_cache `[num_blocks,
    block_size, L + R]`; block_tables int32 `[S, max_blocks]`. Decode (one row per sequence)
    and extend rows alike. `max_seq_len`: a host bound on seq_lens (default: table width).
    `kernel`: see `launch_mla_attention`. Returns `[T, H, L]` in the cache dtype."""
    if out is None:
        out = torch.empty(q_latent.shape, dtype=q_latent.dtype, device=q_latent.device)
    torch.ops.tandem.mla_attention(
        out, q_latent, q_rope, latent_cache, query_start_loc, seq_lens, block_tables,
        float(scale), int(max_seq_len or 0), kernel,
    )  # fmt: skip
    return out

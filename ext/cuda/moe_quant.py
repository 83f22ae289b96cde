"""A MoE layer's routed experts from packed weights on CUDA (`moe_quant.cu`):
`torch.ops.tandem.qmoe_decode_experts` (a decode step from the router's logits: route + sort,
gate_up, down summed per token; three kernels) and `torch.ops.tandem.qmoe_routed_experts` (from
routed ids; biases and GPT-OSS's clamped SwiGLU) read the routed experts' packed bytes in place
with no host sync, so they capture into CUDA graphs; `dequantize_experts` writes the routed
experts into a 16-bit scratch for grouped GEMMs at prefill sizes. Formats: Q4_0, Q8_0 and MXFP4
as planes (codes and scales apart), Q4_1, Q4_K, Q5_K and Q6_K as GGUF rows (layouts:
models/quant/experts.py). The reference is models.gguf_dequant + the torch expert loop. Knows
nothing about models.
"""

from __future__ import annotations

import torch

from tandem.ext.cuda import moe_stage
from tandem.ext.cuda._loader import f32, i32, i64, launch, ptr
from tandem.ext.cuda.gguf_linear import QTYPES as _GGUF_QTYPES
from tandem.ext.cuda.skinny import sort_slots

_DT = {torch.float16: 0, torch.bfloat16: 1}
MXFP4 = 39
# ggml type id -> (elements per block, bytes per block)
QTYPES = {**_GGUF_QTYPES, MXFP4: (32, 17)}
# planar types: ggml type id -> (scale bytes, code bytes) per 32-value block
PLANAR = {2: (2, 16), 8: (2, 32), MXFP4: (1, 16)}
_THREADS = 256
DOWN_MAX_TOP_K = 16  # qmoe_down_kernel: one template instance per top_k
DECODE_MAX_TOKENS = 16  # steps up to here take the token-major down pass
# (alpha, limit) of GPT-OSS's clamped SwiGLU; None: silu(gate) * up
Activation = tuple[float, float] | None


INT4_BASE = 1000  # int4 with groups of G (GPTQ / AWQ): type id INT4_BASE + G
FP8_BASE = 2000  # e4m3 with a float32 scale per B columns: type id FP8_BASE + B


def _block(type_id: int) -> int | None:
    """Values per block (the K granularity), None for an unknown type."""
    for base in (FP8_BASE, INT4_BASE):
        if type_id > base:
            g = type_id - base
            return g if g % 32 == 0 and g < base else None
    return QTYPES[type_id][0] if type_id in QTYPES else None


def row_bytes(type_id: int, k: int) -> tuple[int, int]:
    """(code or GGUF row bytes, scale bytes) of a row of k values."""
    if type_id > FP8_BASE:
        return k, k // (type_id - FP8_BASE) * 4
    if type_id > INT4_BASE:
        return k // 2, k // (type_id - INT4_BASE) * 3
    if type_id in PLANAR:
        sb, cb = PLANAR[type_id]
        return k // 32 * cb, k // 32 * sb
    block, size = QTYPES[type_id]
    return k // block * size, 0


def _check_weight(
    data: torch.Tensor, scales: torch.Tensor | None, type_id: int, rows: int | None, k: int
) -> bool:
    rb, srb = row_bytes(type_id, k)
    if data.dim() != 3 or data.dtype != torch.uint8 or not data.is_contiguous():
        return False
    if data.shape[2] != rb or (rows is not None and data.shape[1] != rows):
        return False
    if (scales is None) != (srb == 0):
        return False
    if scales is not None and (
        scales.dtype != torch.uint8
        or not scales.is_contiguous()
        or tuple(scales.shape) != (data.shape[0], data.shape[1], srb)
        or scales.device != data.device
    ):
        return False
    return data.data_ptr() % 16 == 0


def supported(
    x: torch.Tensor,
    data13: torch.Tensor,
    scales13: torch.Tensor | None,
    data2: torch.Tensor,
    scales2: torch.Tensor | None,
    type_id: int,
) -> bool:
    """Whether the kernels take these operands: fp16/bf16 x [T, H] on CUDA, the experts'
    [E, rows, bytes] uint8 codes (and scales) contiguous on its device, H and I multiples of
    the block (and of 8)."""
    block = _block(type_id)
    if block is None or not x.is_cuda or x.dtype not in _DT or x.dim() != 2:
        return False
    if data13.dim() != 3 or not (data13.device == data2.device == x.device):
        return False
    e, two_i, _ = data13.shape
    h, inter = x.shape[1], two_i // 2
    if two_i % 2 or h % block or inter % block or h % 8 or inter % 8:
        return False
    return (
        _check_weight(data13, scales13, type_id, None, h)
        and _check_weight(data2, scales2, type_id, h, inter)
        and data2.shape[0] == e
    )


def launch_gemv(
    x: torch.Tensor,  # glu: hidden [T, K]; else act [S, K]
    data: torch.Tensor,  # [E, rows, row_bytes] uint8
    scales: torch.Tensor | None,  # [E, rows, scale bytes] uint8 (planar types)
    type_id: int,
    sorted_ids: torch.Tensor,
    order: torch.Tensor,
    offsets: torch.Tensor | None,
    slot_weights: torch.Tensor | None,  # [S] float32 (down pass)
    bias: torch.Tensor | None,  # [E, rows] x's dtype
    out: torch.Tensor,  # glu: [S, N] x's dtype; else [S, N] float32
    top_k: int,
    glu: bool,
    activation: Activation = None,
) -> None:
    """One pass over the slots sorted by expert (see skinny.launch_moe_gemv for the contract)."""
    e, rows, rb = data.shape
    k = x.shape[1]
    n = rows // 2 if glu else rows
    s = sorted_ids.numel()
    srb = row_bytes(type_id, k)[1]
    if (
        not _check_weight(data, scales, type_id, None, k)
        or out.shape != (s, n)
        or x.dtype not in _DT
    ):
        raise ValueError(
            f"shapes do not match: x {tuple(x.shape)}, data {tuple(data.shape)} (type "
            f"{type_id}), out {tuple(out.shape)}, {s} slots"
        )
    if out.dtype != (x.dtype if glu else torch.float32):
        raise ValueError(f"out must be {x.dtype if glu else torch.float32}, got {out.dtype}")
    if x.stride(1) != 1 or x.stride(0) % 8 or x.data_ptr() % 16 or out.stride(1) != 1:
        raise ValueError("x rows must be contiguous and 16-byte aligned, out rows contiguous")
    if bias is not None and (
        bias.shape != (e, rows) or bias.dtype != x.dtype or not bias.is_contiguous()
    ):
        raise ValueError(f"bias must be contiguous {x.dtype} [{e}, {rows}]")
    if not glu and (slot_weights is None or slot_weights.dtype != torch.float32):
        raise ValueError("the down pass needs float32 slot_weights")
    if s == 0:
        return
    alpha, limit = activation if activation is not None else (0.0, 0.0)
    most = x.shape[0] if glu else s // top_k  # slots one expert can have: one per token
    m_max = 1 if most <= 1 else 2 if most == 2 else 4 if most <= 4 else 8
    grid = (-(-n // (_THREADS // 32)), e if offsets is not None else s, 1)
    launch(
        "moe_quant.cu",
        f"qmoe_gemv_kernel<{type_id},{_DT[x.dtype]},{int(glu)},{int(activation is not None)},"
        f"{m_max}>",
        x.device,
        grid,
        (_THREADS, 1, 1),
        (ptr(x), ptr(data), ptr(scales), ptr(sorted_ids), ptr(order), ptr(offsets),
         ptr(slot_weights), ptr(bias), ptr(out), i32(n), i32(k), i64(rb), i64(srb), i32(s),
         i32(e), i32(top_k), i64(x.stride(0)), i64(out.stride(0)), f32(alpha), f32(limit)),
    )  # fmt: skip


def dequantize_experts(
    data: torch.Tensor,  # [E, rows, row_bytes] uint8, cuda
    scales: torch.Tensor | None,  # [E, rows, scale bytes] (planar types)
    type_id: int,
    k: int,
    dtype: torch.dtype,
    offsets: torch.Tensor | None = None,  # [E + 1] int64: only experts with slots
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """[E, rows, k] in dtype (fp16/bf16); with `offsets`, experts without slots unwritten."""
    e, rows, rb = data.shape
    if _block(type_id) is None or not _check_weight(data, scales, type_id, None, k):
        raise ValueError(f"data {tuple(data.shape)} is not type {type_id} rows of {k} values")
    if not data.is_cuda or dtype not in _DT:
        raise ValueError("data must be on CUDA, dtype fp16 or bf16")
    srb = row_bytes(type_id, k)[1]
    if out is None:
        out = torch.empty(e, rows, k, dtype=dtype, device=data.device)
    if out.shape != (e, rows, k) or not out.is_contiguous() or out.dtype != dtype:
        raise ValueError(f"out must be contiguous {dtype} [{e}, {rows}, {k}]")
    if offsets is not None and (offsets.numel() != e + 1 or offsets.dtype != torch.int64):
        raise ValueError(f"offsets must be int64 [{e + 1}]")
    threads = rows * (k // 32)
    if threads == 0 or e == 0:
        return out
    launch(
        "moe_quant.cu",
        f"qmoe_dequant_kernel<{type_id},{_DT[dtype]}>",
        data.device,
        (-(-threads // _THREADS), e, 1),
        (_THREADS, 1, 1),
        (ptr(data), ptr(scales), ptr(offsets), ptr(out), i32(rows), i32(k), i64(rb), i64(srb)),
    )
    return out


def _aligned(x: torch.Tensor) -> torch.Tensor:
    if x.stride(1) != 1 or x.stride(0) % 8 or x.data_ptr() % 16:
        return x.contiguous()
    return x


def launch_down(
    act: torch.Tensor,  # [T * k, I]
    data2: torch.Tensor,  # [E, H, row_bytes(I)]
    scales2: torch.Tensor | None,
    type_id: int,
    ids: torch.Tensor,  # [T, k] int64
    weights: torch.Tensor,  # [T, k] float32
    bias: torch.Tensor | None,  # [E, H] act's dtype
    out: torch.Tensor,  # [T, H] act's dtype
) -> None:
    """out[t] = sum_j weights[t, j] * (w2[ids[t, j]] @ act[t * k + j] + b2[ids[t, j]]), token by
    token, summed and rounded once in the kernel (ids outside [0, E) add nothing)."""
    t, top_k = ids.shape
    e, h, _ = data2.shape
    inter = act.shape[1]
    if not _check_weight(data2, scales2, type_id, h, inter) or act.shape[0] != t * top_k:
        raise ValueError(f"act {tuple(act.shape)} does not fit w2 {tuple(data2.shape)}")
    if not 1 <= top_k <= DOWN_MAX_TOP_K or out.shape != (t, h) or out.dtype != act.dtype:
        raise ValueError(f"top_k 1..{DOWN_MAX_TOP_K} and out [{t}, {h}] in act's dtype")
    if ids.dtype != torch.int64 or weights.dtype != torch.float32:
        raise ValueError("ids must be int64 and weights float32")
    if not (ids.is_contiguous() and weights.is_contiguous()) or out.stride(1) != 1:
        raise ValueError("ids and weights contiguous, out rows contiguous")
    if act.stride(1) != 1 or act.stride(0) % 8 or act.data_ptr() % 16:
        raise ValueError("act rows must be contiguous and 16-byte aligned")
    if bias is not None and (bias.shape != (e, h) or bias.dtype != act.dtype):
        raise ValueError(f"bias must be {act.dtype} [{e}, {h}]")
    if t == 0:
        return
    rb, srb = row_bytes(type_id, inter)
    launch(
        "moe_quant.cu",
        f"qmoe_down_kernel<{type_id},{top_k},{_DT[act.dtype]}>",
        act.device,
        (-(-h // (_THREADS // 32)), t, 1),
        (_THREADS, 1, 1),
        (ptr(act), ptr(data2), ptr(scales2), ptr(ids), ptr(weights), ptr(bias), ptr(out),
         i32(h), i32(inter), i64(rb), i64(srb), i32(e), i64(act.stride(0)), i64(out.stride(0))),
    )  # fmt: skip


def _experts(hidden, ids, weights, sorted_ids, order, d13, s13, d2, s2, type_id, b13, b2,
             activation: Activation) -> torch.Tensor:  # fmt: skip
    """The two passes over routed slots (sorted by expert): gate_up per expert run, then down
    token-major up to DECODE_MAX_TOKENS tokens, else per expert run plus a sum."""
    t, top_k = ids.shape
    e, h, _ = d2.shape
    inter = d13.shape[1] // 2
    s = ids.numel()
    offsets = None
    if s > e:  # a block row per expert beats one per sorted position
        bounds = torch.arange(e + 1, device=ids.device, dtype=sorted_ids.dtype)
        offsets = torch.searchsorted(sorted_ids, bounds)
    x = _aligned(hidden)
    act = torch.empty(s, inter, device=hidden.device, dtype=hidden.dtype)
    launch_gemv(x, d13, s13, type_id, sorted_ids, order, offsets, None, b13, act, top_k, True,
                activation)  # fmt: skip
    w = weights.reshape(-1).float().contiguous()
    if t <= DECODE_MAX_TOKENS and top_k <= DOWN_MAX_TOP_K:
        out = torch.empty(t, h, device=hidden.device, dtype=hidden.dtype)
        launch_down(act, d2, s2, type_id, ids.contiguous(), w.view(t, top_k), b2, out)
        return out
    y = torch.zeros(s, h, device=hidden.device, dtype=torch.float32)  # skipped slots stay 0
    launch_gemv(act, d2, s2, type_id, sorted_ids, order, offsets, w, b2, y, top_k, False)
    return y.view(t, top_k, h).sum(dim=1).to(hidden.dtype)


@torch.library.custom_op("tandem::qmoe_routed_experts", mutates_args=())
def qmoe_routed_experts(
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    data13: torch.Tensor,
    scales13: torch.Tensor | None,
    data2: torch.Tensor,
    scales2: torch.Tensor | None,
    type_id: int,
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    alpha: float = 0.0,
    limit: float = 0.0,
) -> torch.Tensor:
    """sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(hidden[t]) with the experts' w13
    [E, 2I, H] / w2 [E, H, I] packed as `data13` (+ `scales13`) / `data2` (+ `scales2`) of ggml
    type `type_id`; hidden [T, H] fp16/bf16, topk_ids [T, k] int64 (ids outside [0, E) add
    nothing), topk_weights [T, k] -> [T, H] in hidden's dtype, with no host sync. With biases
    b13 [E, 2I] / b2 [E, H] (hidden's dtype) the activation is GPT-OSS's clamped SwiGLU
    (alpha, limit), else silu(gate) * up. The caller checks `supported`."""
    if not supported(hidden, data13, scales13, data2, scales2, type_id):
        raise ValueError("qmoe_routed_experts: operands the kernels do not take (supported)")
    sorted_ids, order, _ = sort_slots(topk_ids, data2.shape[0], offsets=False)
    act_fn = (alpha, limit) if b13 is not None else None
    return _experts(hidden, topk_ids, topk_weights, sorted_ids, order, data13, scales13, data2,
                    scales2, type_id, b13, b2, act_fn)  # fmt: skip


@qmoe_routed_experts.register_fake
def _(hidden, topk_ids, topk_weights, data13, scales13, data2, scales2, type_id, b13=None,
      b2=None, alpha=0.0, limit=0.0):  # fmt: skip
    return torch.empty_like(hidden)


def decode_supported(
    hidden: torch.Tensor, logits: torch.Tensor, num_experts: int, top_k: int
) -> bool:
    """Whether `qmoe_decode_experts` takes this step's routing (the weights: `supported`)."""
    if not logits.is_cuda or logits.dim() != 2 or logits.dtype != hidden.dtype:
        return False
    t, e = logits.shape
    return (
        logits.stride(1) == 1
        and t == hidden.shape[0] <= DECODE_MAX_TOKENS
        and e == num_experts <= moe_stage.MAX_EXPERTS
        and 1 <= top_k <= min(DOWN_MAX_TOP_K, e)
        and t * top_k <= moe_stage.MAX_SORT_SLOTS
    )


@torch.library.custom_op("tandem::qmoe_decode_experts", mutates_args=())
def qmoe_decode_experts(
    hidden: torch.Tensor,
    logits: torch.Tensor,
    data13: torch.Tensor,
    scales13: torch.Tensor | None,
    data2: torch.Tensor,
    scales2: torch.Tensor | None,
    type_id: int,
    top_k: int,
    renormalize: bool,
) -> torch.Tensor:
    """A decode-sized step from the router's logits [T, E] (softmax, top-k, optional
    renormalize) in three kernels: route + sort (moe_stage.route_sort), gate_up per expert run,
    down summed per token. The caller checks `supported` and `decode_supported`."""
    if not (supported(hidden, data13, scales13, data2, scales2, type_id)
            and decode_supported(hidden, logits, data2.shape[0], top_k)):  # fmt: skip
        raise ValueError("qmoe_decode_experts: operands it does not take")
    ids, weights, sorted_ids, order = moe_stage.route_sort(logits, top_k, renormalize)
    return _experts(hidden, ids, weights, sorted_ids, order, data13, scales13, data2, scales2,
                    type_id, None, None, None)  # fmt: skip


@qmoe_decode_experts.register_fake
def _(hidden, logits, data13, scales13, data2, scales2, type_id, top_k, renormalize):
    return torch.empty_like(hidden)

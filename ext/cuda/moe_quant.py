"""A MoE layer's routed experts from packed weights on CUDA (`moe_quant.cu`):
`torch.ops.tandem.qmoe_routed_experts` (decode-sized steps: the routed experts' packed rows read
in place, no host sync, so it captures into CUDA graphs) and `dequantize_routed` (the routed
experts into a 16-bit scratch for grouped GEMMs at prefill sizes). Formats: GGUF Q4_0, Q4_1,
Q8_0, Q4_K, Q5_K, Q6_K and MXFP4 (ggml's 17-byte block). The reference is
models.gguf_dequant + the torch expert loop. Knows nothing about models.
"""

from __future__ import annotations

import torch

from tandem.ext.cuda._loader import f32, i32, i64, launch, ptr
from tandem.ext.cuda.gguf_linear import QTYPES as _GGUF_QTYPES
from tandem.ext.cuda.skinny import sort_slots

_DT = {torch.float16: 0, torch.bfloat16: 1}
MXFP4 = 39
# ggml type id -> (elements per block, bytes per block)
QTYPES = {**_GGUF_QTYPES, MXFP4: (32, 17)}
_THREADS = 256
# (alpha, limit) of GPT-OSS's clamped SwiGLU; None: silu(gate) * up
Activation = tuple[float, float] | None


def row_bytes(type_id: int, k: int) -> int:
    block, size = QTYPES[type_id]
    return k // block * size


def supported(x: torch.Tensor, data13: torch.Tensor, data2: torch.Tensor, type_id: int) -> bool:
    """Whether the kernels take these operands: fp16/bf16 x on CUDA, [E, rows, row_bytes] uint8
    contiguous packed weights on its device, K and I multiples of the block."""
    if type_id not in QTYPES or not x.is_cuda or x.dtype not in _DT or x.dim() != 2:
        return False
    if data13.dim() != 3 or data2.dim() != 3 or data13.dtype != torch.uint8 != data2.dtype:
        return False
    if not (data13.device == data2.device == x.device):
        return False
    if not (data13.is_contiguous() and data2.is_contiguous()):
        return False
    e, two_i, rb13 = data13.shape
    h = x.shape[1]
    block, _ = QTYPES[type_id]
    inter = two_i // 2
    return (
        two_i % 2 == 0
        and h % block == 0
        and inter % block == 0
        and h % 8 == 0
        and rb13 == row_bytes(type_id, h)
        and tuple(data2.shape) == (e, h, row_bytes(type_id, inter))
    )


def launch_gemv(
    x: torch.Tensor,  # glu: hidden [T, K]; else act [S, K]
    data: torch.Tensor,  # [E, rows, row_bytes] uint8
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
    if rb != row_bytes(type_id, k) or out.shape != (s, n) or x.dtype not in _DT:
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
        (ptr(x), ptr(data), ptr(sorted_ids), ptr(order), ptr(offsets), ptr(slot_weights),
         ptr(bias), ptr(out), i32(n), i32(k), i64(rb), i32(s), i32(e), i32(top_k),
         i64(x.stride(0)), i64(out.stride(0)), f32(alpha), f32(limit)),
    )  # fmt: skip


def dequantize_experts(
    data: torch.Tensor,  # [E, rows, row_bytes] uint8, cuda
    type_id: int,
    k: int,
    dtype: torch.dtype,
    offsets: torch.Tensor | None = None,  # [E + 1] int64: only experts with slots
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """[E, rows, k] in dtype (fp16/bf16); with `offsets`, experts without slots unwritten."""
    e, rows, rb = data.shape
    if type_id not in QTYPES or rb != row_bytes(type_id, k) or dtype not in _DT:
        raise ValueError(f"data {tuple(data.shape)} is not type {type_id} rows of {k} values")
    if not data.is_cuda or not data.is_contiguous():
        raise ValueError("data must be contiguous on CUDA")
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
        (ptr(data), ptr(offsets), ptr(out), i32(rows), i32(k), i64(rb)),
    )
    return out


def _aligned(x: torch.Tensor) -> torch.Tensor:
    if x.stride(1) != 1 or x.stride(0) % 8 or x.data_ptr() % 16:
        return x.contiguous()
    return x


@torch.library.custom_op("tandem::qmoe_routed_experts", mutates_args=())
def qmoe_routed_experts(
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    data13: torch.Tensor,
    data2: torch.Tensor,
    type_id: int,
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    alpha: float = 0.0,
    limit: float = 0.0,
) -> torch.Tensor:
    """sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(hidden[t]) with the experts' w13
    [E, 2I, H] / w2 [E, H, I] packed as `data13` / `data2` ([E, rows, row_bytes] uint8, ggml
    type `type_id`); hidden [T, H] fp16/bf16, topk_ids [T, k] int64 (ids outside [0, E) add
    nothing), topk_weights [T, k] -> [T, H] in hidden's dtype, with no host sync. With biases
    b13 [E, 2I] / b2 [E, H] (hidden's dtype) the activation is GPT-OSS's clamped SwiGLU
    (alpha, limit), else silu(gate) * up. The caller checks `supported`."""
    if not supported(hidden, data13, data2, type_id):
        raise ValueError("qmoe_routed_experts: operands the kernels do not take (supported)")
    t, top_k = topk_ids.shape
    e, h, _ = data2.shape
    inter = data13.shape[1] // 2
    s = topk_ids.numel()
    sorted_ids, order, offsets = sort_slots(topk_ids, e, offsets=s > e)
    x = _aligned(hidden)
    act_fn = (alpha, limit) if b13 is not None else None
    act = torch.empty(s, inter, device=hidden.device, dtype=hidden.dtype)
    launch_gemv(x, data13, type_id, sorted_ids, order, offsets, None, b13, act, top_k, True, act_fn)
    y = torch.zeros(s, h, device=hidden.device, dtype=torch.float32)  # skipped slots stay 0
    w = topk_weights.reshape(-1).float().contiguous()
    launch_gemv(act, data2, type_id, sorted_ids, order, offsets, w, b2, y, top_k, False)
    return y.view(t, top_k, h).sum(dim=1).to(hidden.dtype)


@qmoe_routed_experts.register_fake
def _(hidden, topk_ids, topk_weights, data13, data2, type_id, b13=None, b2=None, alpha=0.0,
      limit=0.0):  # fmt: skip
    return torch.empty_like(hidden)

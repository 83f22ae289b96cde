"""The GPU side of a CPU-pool MoE layer in two kernels (`moe_stage.cu`), and the router of
the all-GPU decode path.

`route_stage`: router softmax + top-k (+ renormalisation) per token, the routing counts, and the
pool's inputs (hidden as fp32, CPU-routed ids, weights) written straight into the pinned
staging buffers through UVA: one kernel instead of the router's ~6 kernels, two conversions
and three device-to-host copies. `gather`: the pool's fp32 output (pinned) plus the
GPU-resident experts' part, rounded to the model dtype on the device: one kernel (read through
UVA for small calls; above `ZERO_COPY_BYTES` a host-to-device copy first, PCIe copies being
faster than a kernel's remote reads in bulk).

`route_sort` (for the "gpu" expert backend, every expert on the GPU): the router of a decode-sized
step and its (token, expert) slots sorted by expert, in one kernel.

All launch on torch's current stream and are capturable in CUDA graphs. `route_stage_ref`
is the torch expression they replace (and the fall-back where the kernel does not apply).
"""

from __future__ import annotations

import torch

from tandem.ext.cuda._loader import i32, i64, launch, ptr

_DT = {torch.float16: 0, torch.bfloat16: 1}
MAX_EXPERTS = 1024
MAX_TOP_K = 32
ZERO_COPY_BYTES = 256 << 10


def route_ref(
    logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (topk_ids [T, k] int64, topk_weights [T, k] float32), as the MoE
    block's torch router computes them."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights


def supported(hidden: torch.Tensor, logits: torch.Tensor, top_k: int) -> bool:
    """Whether `route_stage` takes these operands."""
    if not (hidden.is_cuda and logits.is_cuda and hidden.dtype == logits.dtype):
        return False
    if hidden.dtype not in _DT or hidden.dim() != 2 or logits.dim() != 2:
        return False
    if hidden.stride(1) != 1 or logits.stride(1) != 1 or hidden.shape[0] != logits.shape[0]:
        return False
    return 1 <= top_k <= min(MAX_TOP_K, logits.shape[1]) and logits.shape[1] <= MAX_EXPERTS


def route_stage(
    hidden: torch.Tensor,  # [T, H] bf16/fp16, cuda
    logits: torch.Tensor,  # [T, E] same dtype (the router's output)
    top_k: int,
    renormalize: bool,
    x_h: torch.Tensor,  # [>=T, H] float32, pinned host
    ids_h: torch.Tensor,  # [>=T, k] int64, pinned host: CPU-routed ids (-1: on the GPU)
    w_h: torch.Tensor,  # [>=T, k] float32, pinned host
    local: torch.Tensor | None = None,  # [E] int64 cuda: >= 0 where the expert is on the GPU
    counts: torch.Tensor | None = None,  # [E] int64 cuda: += 1 per routed slot
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (topk_ids [T, k] int64, topk_weights [T, k] float32) on the device; fills the pinned
    rows [0, T) of x_h / ids_h / w_h. The caller checked `supported`."""
    T, H = hidden.shape
    E = logits.shape[1]
    if not supported(hidden, logits, top_k):
        raise ValueError("route_stage: operands not supported (see moe_stage.supported)")
    for name, t, dt, cols in (("x_h", x_h, torch.float32, H), ("ids_h", ids_h, torch.int64, top_k),
                              ("w_h", w_h, torch.float32, top_k)):  # fmt: skip
        if t.dtype != dt or t.dim() != 2 or t.shape[0] < T or t.shape[1] != cols:
            raise ValueError(
                f"{name} must be [>= {T}, {cols}] {dt}, got {tuple(t.shape)} {t.dtype}"
            )
        if not (t.is_pinned() and t.is_contiguous()):
            raise ValueError(f"{name} must be contiguous pinned host memory")
    for name, t in (("local", local), ("counts", counts)):
        if t is not None and (
            t.shape != (E,) or t.dtype != torch.int64 or t.device != hidden.device
        ):
            raise ValueError(f"{name} must be [{E}] int64 on {hidden.device}")
    ids = torch.empty(T, top_k, dtype=torch.int64, device=hidden.device)
    weights = torch.empty(T, top_k, dtype=torch.float32, device=hidden.device)
    if T == 0:
        return ids, weights
    launch(
        "moe_stage.cu",
        f"moe_route_stage_kernel<{_DT[hidden.dtype]}>",
        hidden.device,
        (T, 1, 1),
        (256, 1, 1),
        (ptr(hidden), i64(hidden.stride(0)), ptr(logits), i64(logits.stride(0)), i32(H), i32(E),
         i32(top_k), i32(int(renormalize)), ptr(local), ptr(ids), ptr(weights), ptr(x_h),
         ptr(ids_h), ptr(w_h), ptr(counts)),
    )  # fmt: skip
    return ids, weights


def gather(
    pool_out: torch.Tensor,  # [T, H] float32, pinned host (rows [0, T) of the staging buffer)
    extra: torch.Tensor | None,  # [T, H] float32 cuda or None
    dtype: torch.dtype,
    staging: torch.Tensor | None = None,  # [>=T, H] float32 cuda, for the copy of large calls
) -> torch.Tensor:
    """pool_out (+ extra) as a new [T, H] tensor of `dtype` on the device."""
    T, H = pool_out.shape
    device = extra.device if extra is not None else (staging.device if staging is not None
                                                     else torch.device("cuda"))  # fmt: skip
    out = torch.empty(T, H, dtype=dtype, device=device)
    if T == 0:
        return out
    if dtype not in _DT or not pool_out.is_contiguous():
        raise ValueError("gather: fp16/bf16 output and a contiguous pool_out")
    src = pool_out
    if T * H * 4 > ZERO_COPY_BYTES and staging is not None:
        src = staging[:T]
        src.copy_(pool_out, non_blocking=True)
    n = T * H
    launch(
        "moe_stage.cu",
        f"moe_gather_kernel<{_DT[dtype]}>",
        out.device,
        (min(-(-n // 256), 1024), 1, 1),
        (256, 1, 1),
        (ptr(src), ptr(extra), ptr(out), i64(n)),
    )
    return out


MAX_SORT_SLOTS = 256  # moe_route_sort_kernel: tokens x top_k of one step, in one block


def route_sort(
    logits: torch.Tensor,  # [T, E] fp16/bf16 cuda (the router's output)
    top_k: int,
    renormalize: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The router of a decode-sized step and its slots sorted by expert, in one kernel:
    -> (topk_ids [T, k] int64, topk_weights [T, k] float32, sorted_ids [T * k] int64 ascending,
    order [T * k] int64: the slot t * k + j at each sorted position; a stable sort)."""
    if not (logits.is_cuda and logits.dtype in _DT and logits.dim() == 2):
        raise ValueError("route_sort: logits must be 2-D fp16/bf16 on CUDA")
    T, E = logits.shape
    if logits.stride(1) != 1 or E > MAX_EXPERTS or not 1 <= top_k <= min(MAX_TOP_K, E):
        raise ValueError(
            f"route_sort: contiguous rows of at most {MAX_EXPERTS} experts and 1 <= top_k <= "
            f"min({MAX_TOP_K}, E), got {tuple(logits.shape)}, top_k {top_k}"
        )
    if T * top_k > MAX_SORT_SLOTS:
        raise ValueError(f"route_sort: at most {MAX_SORT_SLOTS} slots, got {T} x {top_k}")
    dev = logits.device
    ids = torch.empty(T, top_k, dtype=torch.int64, device=dev)
    weights = torch.empty(T, top_k, dtype=torch.float32, device=dev)
    sorted_ids = torch.empty(T * top_k, dtype=torch.int64, device=dev)
    order = torch.empty(T * top_k, dtype=torch.int64, device=dev)
    if T:
        launch(
            "moe_stage.cu",
            f"moe_route_sort_kernel<{_DT[logits.dtype]}>",
            dev,
            (1, 1, 1),
            (256, 1, 1),
            (ptr(logits), i64(logits.stride(0)), i32(T), i32(E), i32(top_k),
             i32(int(renormalize)), ptr(ids), ptr(weights), ptr(sorted_ids), ptr(order)),
        )  # fmt: skip
    return ids, weights, sorted_ids, order

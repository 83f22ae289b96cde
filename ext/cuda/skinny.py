"""Skinny GEMM (`y = x @ W^T` for a few rows of x) for decode steps on CUDA.

`launch_skinny_gemm` checks its operands and launches `skinny_gemm.cu` on torch's current
stream; `skinny_linear` is the torch custom op (`torch.ops.tandem.skinny_linear`) that models
call, with a fallback to `torch.nn.functional.linear` where the kernel does not apply.
`MAX_ROWS` bounds the rows of x the kernel takes (above it cuBLAS' tensor-core GEMM wins).
`moe_routed_experts` (`torch.ops.tandem.moe_routed_experts`) runs a MoE layer's routed experts
through the same reduction, every (token, expert) slot of a step grouped by expert;
`moe_decode_experts` does a decode-sized step from the router's logits in three kernels.
"""

from __future__ import annotations

import os

import torch

from tandem.ext.attention_ref import rotate_neox, write_kv
from tandem.ext.cuda import moe_stage
from tandem.ext.cuda._loader import i32, i64, launch, ptr

MAX_ROWS = 8
_DT = {torch.float16: 0, torch.bfloat16: 1}
_THREADS = 256
# (rows per warp, steps in flight) per row count of x, from tools/bench_skinny_gemm.py sweeps
# on an H100 over the Llama-3 8B/1B projections: at 1 row (1, 2) is fastest or within 1% on all
# of them (and 5 us a layer faster than (2, 4) on the 8B), at 2 rows (2, 4).
_TILES = {1: (1, 2), 2: (2, 4), 3: (2, 2), 4: (2, 2)}
_TILE_DEFAULT = (1, 2)


def _env_tile(var: str) -> tuple[int, int] | None:
    """A "R,U" tile from the environment variable `var` (an override for tuning runs)."""
    env = os.environ.get(var)
    if not env:
        return None
    r, u = (int(v) for v in env.split(","))
    return r, u


def tile_for(m: int) -> tuple[int, int]:
    return _env_tile("TANDEM_SKINNY_TILE") or _TILES.get(m, _TILE_DEFAULT)


def supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the kernel takes this product (else use F.linear)."""
    if not (x.is_cuda and weight.is_cuda and x.dtype == weight.dtype and x.dtype in _DT):
        return False
    if weight.dim() != 2 or not weight.is_contiguous() or weight.shape[1] % 8:
        return False
    rows = x.numel() // max(x.shape[-1], 1)
    if x.shape[-1] != weight.shape[1] or rows == 0 or rows > MAX_ROWS:
        return False
    return weight.data_ptr() % 16 == 0


def launch_skinny_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    out: torch.Tensor,
    tile: tuple[int, int] | None = None,
    glu: bool = False,
) -> None:
    """out[M, N] = x[M, K] @ weight[N, K]^T, M <= MAX_ROWS. With `glu`, weight is a gated MLP's
    gate_up [2N, K] (gate rows first) and out[M, N] = silu(x @ gate^T) * (x @ up^T)."""
    if x.dim() != 2 or out.dim() != 2 or weight.dim() != 2:
        raise ValueError("skinny_gemm takes 2-D x, weight and out")
    m, k = x.shape
    n = weight.shape[0]
    if glu:
        if n % 2:
            raise ValueError(f"a gate_up weight has an even number of rows, got {n}")
        n //= 2
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"skinny_gemm takes 1..{MAX_ROWS} rows, got {m}")
    if weight.shape[1] != k or out.shape != (m, n):
        raise ValueError(
            f"shapes do not match: x {tuple(x.shape)}, weight {tuple(weight.shape)}, out {tuple(out.shape)}"
        )
    if not (x.dtype == weight.dtype == out.dtype and x.dtype in _DT):
        raise ValueError(
            f"dtypes must be one of fp16/bf16 and equal, got {x.dtype}, {weight.dtype}, {out.dtype}"
        )
    if not (x.device == weight.device == out.device and x.is_cuda):
        raise ValueError("x, weight and out must be on one CUDA device")
    if k % 8 or not weight.is_contiguous() or x.stride(1) != 1 or out.stride(1) != 1:
        raise ValueError("K must be a multiple of 8 and the inner dimensions contiguous")
    if x.stride(0) % 8 or x.data_ptr() % 16 or weight.data_ptr() % 16:
        raise ValueError("x rows and weight must be 16-byte aligned")
    r, u = tile or tile_for(m)
    warps = _THREADS // 32
    grid = (-(-n // (warps * r)), 1, 1)
    launch(
        "skinny_gemm.cu",
        f"skinny_gemm_kernel<{m},{r},{u},{_DT[x.dtype]},{int(glu)}>",
        x.device,
        grid,
        (_THREADS, 1, 1),
        (ptr(x), ptr(weight), ptr(out), i32(n), i32(k), i64(x.stride(0)), i64(out.stride(0))),
    )


def _aligned_rows(x: torch.Tensor) -> torch.Tensor:
    """x as 2-D rows the kernel can read: contiguous inner dim, 16-byte aligned rows."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(1) != 1 or x2.stride(0) % 8 or x2.data_ptr() % 16:
        x2 = x2.contiguous()
    return x2


@torch.library.custom_op("tandem::skinny_linear", mutates_args=())
def skinny_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x[..., K] @ weight[N, K]^T by the skinny kernel when it applies, else F.linear."""
    if not supported(x, weight):
        return torch.nn.functional.linear(x, weight)
    x2 = _aligned_rows(x)
    out = torch.empty(x2.shape[0], weight.shape[0], device=x.device, dtype=x.dtype)
    launch_skinny_gemm(x2, weight, out)
    return out.reshape(*x.shape[:-1], weight.shape[0])


@skinny_linear.register_fake
def _(x, weight):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _linear_grads(ctx, grad_y, x, weight):
    """Gradients of y = x @ weight^T for the inputs that need them."""
    grad_x = grad_y @ weight if ctx.needs_input_grad[0] else None
    grad_w = None
    if ctx.needs_input_grad[1]:
        grad_w = grad_y.reshape(-1, grad_y.shape[-1]).t() @ x.reshape(-1, x.shape[-1])
    return grad_x, grad_w


def _backward(ctx, grad):
    return _linear_grads(ctx, grad, *ctx.saved_tensors)


skinny_linear.register_autograd(_backward, setup_context=_setup_context)


def _swiglu_ref(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    gate, up = torch.nn.functional.linear(x, weight).chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


@torch.library.custom_op("tandem::skinny_swiglu", mutates_args=())
def skinny_swiglu(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """silu(x @ gate^T) * (x @ up^T) for a gate_up weight [2I, K] (gate rows first): the gated
    MLP's first half in one kernel when it applies, else in torch."""
    if not supported(x, weight) or weight.shape[0] % 2:
        return _swiglu_ref(x, weight)
    x2 = _aligned_rows(x)
    out = torch.empty(x2.shape[0], weight.shape[0] // 2, device=x.device, dtype=x.dtype)
    launch_skinny_gemm(x2, weight, out, glu=True)
    return out.reshape(*x.shape[:-1], weight.shape[0] // 2)


@skinny_swiglu.register_fake
def _(x, weight):
    return x.new_empty(*x.shape[:-1], weight.shape[0] // 2)


def _swiglu_backward(ctx, grad):
    x, weight = ctx.saved_tensors
    gate, up = torch.nn.functional.linear(x, weight).float().chunk(2, dim=-1)
    s = torch.sigmoid(gate)
    g = grad.float()
    d_gate_up = torch.cat((g * up * s * (1 + gate * (1 - s)), g * gate * s), dim=-1).to(x.dtype)
    return _linear_grads(ctx, d_gate_up, x, weight)


skinny_swiglu.register_autograd(_swiglu_backward, setup_context=_setup_context)


# ------------------------------------------------------------ qkv + rotary + KV write, fused


def _qkv_rope_ref(
    x, weight, bias, cos, sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads
):
    """The unfused computation (and the op's fallback): qkv projection, neox rotary of q and k,
    k and v into their slots (slot < 0 skipped). Returns q `[T, H, D]`."""
    t = x.shape[0]
    d = k_cache.shape[-1]
    qkv = torch.nn.functional.linear(x, weight, bias)
    q, k, v = qkv.split([num_heads * d, num_kv_heads * d, num_kv_heads * d], dim=-1)
    cos, sin = cos.reshape(t, 1, d), sin.reshape(t, 1, d)
    q = rotate_neox(q.reshape(t, num_heads, d), cos, sin)
    k = rotate_neox(k.reshape(t, num_kv_heads, d), cos, sin)
    keep = slot_mapping >= 0
    write_kv(k_cache, v_cache, k[keep], v.reshape(t, num_kv_heads, d)[keep], slot_mapping[keep])
    return q


def launch_skinny_qkv_rope(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_out: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    tile: tuple[int, int] | None = None,
) -> None:
    """q_out[M, H, D] = rotary(x @ Wq^T + bq); k, v of each row into k_cache/v_cache at its slot."""
    if x.dim() != 2 or not 1 <= x.shape[0] <= MAX_ROWS:
        raise ValueError(f"x must be [1..{MAX_ROWS}, K], got {tuple(x.shape)}")
    m, k = x.shape
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            "k_cache/v_cache must be equal [num_blocks, block_size, kv_heads, head_dim]"
        )
    d = k_cache.shape[3]
    if k_cache.shape[2] != num_kv_heads or d % 16:
        raise ValueError(
            f"cache {tuple(k_cache.shape)} does not hold {num_kv_heads} heads of an even dim"
        )
    rows = (num_heads + 2 * num_kv_heads) * d
    if weight.shape != (rows, k) or not weight.is_contiguous() or k % 8:
        raise ValueError(
            f"weight must be contiguous [{rows}, {k}] with K % 8 == 0, got {tuple(weight.shape)}"
        )
    if bias is not None and (bias.shape != (rows,) or not bias.is_contiguous()):
        raise ValueError(f"bias must be contiguous [{rows}]")
    if (
        cos.shape != (m, d)
        or sin.shape != (m, d)
        or cos.stride() != sin.stride()
        or cos.stride(1) != 1
    ):
        raise ValueError(f"cos/sin must be [{m}, {d}] with equal strides, contiguous rows")
    if q_out.shape != (m, num_heads, d) or not q_out.is_contiguous():
        raise ValueError(f"q_out must be contiguous [{m}, {num_heads}, {d}]")
    if (
        slot_mapping.dtype != torch.int64
        or slot_mapping.shape != (m,)
        or not slot_mapping.is_contiguous()
    ):
        raise ValueError(f"slot_mapping must be contiguous int64 [{m}]")
    tensors = (x, weight, cos, sin, q_out, k_cache, v_cache) + (() if bias is None else (bias,))
    if any(t.dtype != x.dtype for t in tensors) or x.dtype not in _DT:
        raise ValueError(
            "x, weight, bias, cos, sin, q_out and the caches must share one fp16/bf16 dtype"
        )
    if any(t.device != x.device for t in (*tensors, slot_mapping)) or not x.is_cuda:
        raise ValueError("all operands must be on one CUDA device")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("caches must be contiguous")
    if x.stride(1) != 1 or x.stride(0) % 8 or x.data_ptr() % 16 or weight.data_ptr() % 16:
        raise ValueError("x rows and weight must be 16-byte aligned")
    r0, u = tile or tile_for(m)
    warps = _THREADS // 32
    pairs = rows // 2
    launch(
        "skinny_gemm.cu",
        f"skinny_qkv_rope_kernel<{m},{r0},{u},{_DT[x.dtype]}>",
        x.device,
        (-(-pairs // (warps * r0)), 1, 1),
        (_THREADS, 1, 1),
        (
            ptr(x), ptr(weight), ptr(bias), ptr(cos), ptr(sin), ptr(q_out), ptr(k_cache),
            ptr(v_cache), ptr(slot_mapping), i32(num_heads), i32(num_kv_heads), i32(d), i32(k),
            i64(x.stride(0)), i64(cos.stride(0)),
        ),
    )  # fmt: skip


@torch.library.custom_op("tandem::skinny_qkv_rope", mutates_args=("k_cache", "v_cache"))
def skinny_qkv_rope(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
) -> torch.Tensor:
    """An attention layer's decode prologue in one kernel: qkv projection (+ bias), rotary of q
    and k, k/v into the paged cache. x `[T, K]`, cos/sin `[T, D]`; returns q `[T, H, D]`. Falls
    back to torch (same result) where the kernel does not apply."""
    d = k_cache.shape[-1]
    t = x.shape[0]
    ok = supported(x, weight) and x.dim() == 2 and k_cache.dtype == x.dtype and d % 16 == 0
    if ok and (bias is None or bias.dtype == x.dtype):
        q = torch.empty(t, num_heads, d, device=x.device, dtype=x.dtype)
        launch_skinny_qkv_rope(
            _aligned_rows(x),
            weight, bias, cos.contiguous(), sin.contiguous(), q, k_cache, v_cache,
            slot_mapping.contiguous(), num_heads, num_kv_heads,
        )  # fmt: skip
        return q
    return _qkv_rope_ref(
        x, weight, bias, cos, sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads
    )


@skinny_qkv_rope.register_fake
def _(x, weight, bias, cos, sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads):
    return x.new_empty(x.shape[0], num_heads, k_cache.shape[-1])


# ------------------------------------------------------------------ routed experts (MoE)

# (rows per warp, steps in flight) of moe_gemv_kernel: gate_up (GLU) and down passes
_MOE_TILES = {True: (1, 2), False: (2, 2)}


def moe_tile(glu: bool) -> tuple[int, int]:
    return _env_tile("TANDEM_MOE_TILE_GLU" if glu else "TANDEM_MOE_TILE_DOWN") or _MOE_TILES[glu]


def sort_slots(
    topk_ids: torch.Tensor, num_experts: int, offsets: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A step's (token, expert) slots grouped by expert, on the device (no host sync):
    (sorted_ids [S] int64 ascending, order [S]: the slot t * k + j at each sorted position, a
    stable sort; offsets [E + 1] int64: expert e's run is [offsets[e], offsets[e + 1]), ids < 0
    sort before offsets[0]; None unless asked for)."""
    flat = topk_ids.reshape(-1)
    sorted_ids, order = torch.sort(flat, stable=True)
    if not offsets:
        return sorted_ids, order, None
    bounds = torch.arange(num_experts + 1, device=flat.device, dtype=flat.dtype)
    return sorted_ids, order, torch.searchsorted(sorted_ids, bounds)


def moe_supported(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """Whether moe_gemv_kernel takes a layer with these operands (else torch computes it)."""
    if not (hidden.is_cuda and w13.is_cuda and w2.is_cuda) or hidden.dtype not in _DT:
        return False
    if not (hidden.dtype == w13.dtype == w2.dtype) or hidden.dim() != 2:
        return False
    if w13.dim() != 3 or w2.dim() != 3 or not (w13.is_contiguous() and w2.is_contiguous()):
        return False
    e, two_i, h = w13.shape
    if two_i % 2 or w2.shape != (e, h, two_i // 2) or hidden.shape[1] != h:
        return False
    return h % 8 == 0 and (two_i // 2) % 8 == 0 and w13.data_ptr() % 16 == w2.data_ptr() % 16 == 0


def launch_moe_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    sorted_ids: torch.Tensor,
    order: torch.Tensor,
    offsets: torch.Tensor | None,
    slot_weights: torch.Tensor | None,
    out: torch.Tensor,
    top_k: int,
    glu: bool,
    tile: tuple[int, int] | None = None,
) -> None:
    """One pass of a MoE layer's routed experts over the S (token, expert) slots of a step,
    sorted by expert (`sorted_ids`, `order` [S] int64, from a stable sort of topk_ids.view(-1)).

    glu: weight = w13 [E, 2N, K], x = hidden [T, K] (slot s reads row s // top_k), out = act
    [S, N] in x's dtype = silu(gate) * up. Else: weight = w2 [E, N, K], x = act [S, K], out =
    float32 [S, N] = (act @ W_e^T) * slot_weights[s]. offsets [E + 1] int64 (run bounds of each
    expert in the sorted positions) makes the grid one block row per expert; None, one per
    sorted position (fewer blocks when S < E)."""
    if x.dim() != 2 or weight.dim() != 3 or out.dim() != 2:
        raise ValueError("moe_gemv takes 2-D x and out and a 3-D [E, rows, K] weight")
    e, rows, k = weight.shape
    n = rows // 2 if glu else rows
    s = sorted_ids.numel()
    if glu and rows % 2:
        raise ValueError(f"a w13 weight has an even number of rows, got {rows}")
    if x.shape[1] != k or out.shape != (s, n) or not 1 <= top_k:
        raise ValueError(
            f"shapes do not match: x {tuple(x.shape)}, weight {tuple(weight.shape)}, "
            f"out {tuple(out.shape)}, {s} slots"
        )
    if x.shape[0] * (top_k if glu else 1) != s:
        raise ValueError(f"x has {x.shape[0]} rows for {s} slots (top_k {top_k}, glu {glu})")
    if not (x.dtype == weight.dtype and x.dtype in _DT):
        raise ValueError(f"x and weight must share fp16/bf16, got {x.dtype}, {weight.dtype}")
    if out.dtype != (x.dtype if glu else torch.float32):
        raise ValueError(f"out must be {x.dtype if glu else torch.float32}, got {out.dtype}")
    index = (sorted_ids, order) + (() if offsets is None else (offsets,))
    if any(t.dtype != torch.int64 or not t.is_contiguous() for t in index):
        raise ValueError("sorted_ids, order and offsets must be contiguous int64")
    if order.numel() != s or (offsets is not None and offsets.numel() != e + 1):
        raise ValueError(f"order must have {s} entries and offsets {e + 1}")
    if not glu and (
        slot_weights is None
        or slot_weights.dtype != torch.float32
        or slot_weights.numel() != s
        or not slot_weights.is_contiguous()
    ):
        raise ValueError(f"the down pass needs contiguous float32 slot_weights [{s}]")
    tensors = (x, weight, out, *index) + (() if slot_weights is None else (slot_weights,))
    if not x.is_cuda or any(t.device != x.device for t in tensors):
        raise ValueError("all operands must be on one CUDA device")
    if k % 8 or not weight.is_contiguous() or x.stride(1) != 1 or out.stride(1) != 1:
        raise ValueError("K must be a multiple of 8 and the inner dimensions contiguous")
    if x.stride(0) % 8 or x.data_ptr() % 16 or weight.data_ptr() % 16:
        raise ValueError("x rows and weight must be 16-byte aligned")
    if s == 0:
        return
    r, u = tile or moe_tile(glu)
    warps = _THREADS // 32
    grid = (-(-n // (warps * r)), e if offsets is not None else s, 1)
    launch(
        "skinny_gemm.cu",
        f"moe_gemv_kernel<{r},{u},{_DT[x.dtype]},{int(glu)}>",
        x.device,
        grid,
        (_THREADS, 1, 1),
        (
            ptr(x), ptr(weight), ptr(sorted_ids), ptr(order), ptr(offsets), ptr(slot_weights),
            ptr(out), i32(n), i32(k), i32(s), i32(top_k), i64(x.stride(0)), i64(out.stride(0)),
        ),
    )  # fmt: skip


@torch.library.custom_op("tandem::moe_routed_experts", mutates_args=())
def moe_routed_experts(
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    skip_negative: bool = False,
) -> torch.Tensor:
    """sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(hidden[t]), hidden [T, H], topk_ids
    [T, k] int64, topk_weights [T, k] float32, w13 [E, 2I, H], w2 [E, H, I] -> [T, H] in hidden's
    dtype: two moe_gemv passes with no host sync (so it captures into CUDA graphs). With
    `skip_negative`, ids < 0 are slots computed elsewhere (the CPU pool's) and add nothing. The
    caller checks `moe_supported` (models/layers/gpu_experts.py computes other layers in torch)."""
    if not moe_supported(hidden, w13, w2):
        raise ValueError("moe_routed_experts: operands the kernel does not take (moe_supported)")
    t, top_k = topk_ids.shape
    e, h, inter = w2.shape
    s = topk_ids.numel()
    # offsets: a block row per expert, which beats one per sorted position when S > E
    sorted_ids, order, offsets = sort_slots(topk_ids, e, offsets=s > e)
    x = _aligned_rows(hidden)
    act = torch.empty(s, inter, device=hidden.device, dtype=hidden.dtype)
    launch_moe_gemv(x, w13, sorted_ids, order, offsets, None, act, top_k, glu=True)
    alloc = torch.zeros if skip_negative else torch.empty  # skipped slots' rows stay zero
    y = alloc(s, h, device=hidden.device, dtype=torch.float32)
    w = topk_weights.reshape(-1).float().contiguous()
    launch_moe_gemv(act, w2, sorted_ids, order, offsets, w, y, top_k, glu=False)
    return y.view(t, top_k, h).sum(dim=1).to(hidden.dtype)


@moe_routed_experts.register_fake
def _(hidden, topk_ids, topk_weights, w13, w2, skip_negative=False):
    return torch.empty_like(hidden)


MOE_DOWN_MAX_TOP_K = 16  # moe_down_kernel keeps every slot's loads of a token in registers


def launch_moe_down(
    act: torch.Tensor,  # [T * k, I]
    w2: torch.Tensor,  # [E, H, I]
    ids: torch.Tensor,  # [T, k] int64
    weights: torch.Tensor,  # [T, k] float32
    out: torch.Tensor,  # [T, H], act's dtype
) -> None:
    """out[t] = sum_j weights[t, j] * (w2[ids[t, j]] @ act[t * k + j]): the down pass of a
    decode-sized step, token by token, summed and rounded once in the kernel."""
    if act.dim() != 2 or w2.dim() != 3 or ids.dim() != 2 or out.dim() != 2:
        raise ValueError("moe_down takes act [T*k, I], w2 [E, H, I], ids [T, k], out [T, H]")
    t, top_k = ids.shape
    e, h, inter = w2.shape
    if act.shape != (t * top_k, inter) or out.shape != (t, h) or weights.shape != (t, top_k):
        raise ValueError(
            f"shapes do not match: act {tuple(act.shape)}, w2 {tuple(w2.shape)}, ids "
            f"{tuple(ids.shape)}, weights {tuple(weights.shape)}, out {tuple(out.shape)}"
        )
    if not 1 <= top_k <= MOE_DOWN_MAX_TOP_K:
        raise ValueError(f"moe_down takes top_k 1..{MOE_DOWN_MAX_TOP_K}, got {top_k}")
    if not (act.dtype == w2.dtype == out.dtype and act.dtype in _DT):
        raise ValueError(f"act, w2 and out must share fp16/bf16, got {act.dtype}, {w2.dtype}")
    if ids.dtype != torch.int64 or weights.dtype != torch.float32:
        raise ValueError("ids must be int64 and weights float32")
    if not (ids.is_contiguous() and weights.is_contiguous() and w2.is_contiguous()):
        raise ValueError("ids, weights and w2 must be contiguous")
    tensors = (act, w2, ids, weights, out)
    if not act.is_cuda or any(x.device != act.device for x in tensors):
        raise ValueError("all operands must be on one CUDA device")
    if inter % 8 or act.stride(1) != 1 or act.stride(0) % 8 or act.data_ptr() % 16:
        raise ValueError("act rows must be 16-byte aligned and I a multiple of 8")
    if w2.data_ptr() % 16 or out.stride(1) != 1:
        raise ValueError("w2 must be 16-byte aligned and out rows contiguous")
    if t == 0:
        return
    unroll = 2 if top_k <= 8 else 1
    launch(
        "skinny_gemm.cu",
        f"moe_down_kernel<{top_k},{unroll},{_DT[act.dtype]}>",
        act.device,
        (-(-h // (_THREADS // 32)), t, 1),
        (_THREADS, 1, 1),
        (ptr(act), ptr(w2), ptr(ids), ptr(weights), ptr(out), i32(h), i32(inter),
         i64(act.stride(0)), i64(out.stride(0))),
    )  # fmt: skip


def moe_decode_supported(
    hidden: torch.Tensor, logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int
) -> bool:
    """Whether `moe_decode_experts` takes this step (else route in torch, then
    `moe_routed_experts` or grouped GEMMs)."""
    if not moe_supported(hidden, w13, w2) or not logits.is_cuda or logits.dim() != 2:
        return False
    t, e = logits.shape
    return (
        logits.dtype == hidden.dtype
        and logits.stride(1) == 1
        and t == hidden.shape[0]
        and e == w13.shape[0] <= moe_stage.MAX_EXPERTS
        and 1 <= top_k <= min(MOE_DOWN_MAX_TOP_K, e)
        and t * top_k <= moe_stage.MAX_SORT_SLOTS
    )


@torch.library.custom_op("tandem::moe_decode_experts", mutates_args=())
def moe_decode_experts(
    hidden: torch.Tensor,
    logits: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    top_k: int,
    renormalize: bool,
) -> torch.Tensor:
    """A decode-sized MoE step from the router's logits in three kernels: route + sort
    (moe_stage.route_sort), gate_up + SiLU-mul per expert run (moe_gemv_kernel), down summed
    per token (moe_down_kernel). hidden [T, H], logits [T, E] -> [T, H] in hidden's dtype. The
    caller checks `moe_decode_supported`."""
    if not moe_decode_supported(hidden, logits, w13, w2, top_k):
        raise ValueError("moe_decode_experts: operands it does not take (moe_decode_supported)")
    t, h = hidden.shape
    ids, weights, sorted_ids, order = moe_stage.route_sort(logits, top_k, renormalize)
    x = _aligned_rows(hidden)
    act = torch.empty(t * top_k, w2.shape[2], device=hidden.device, dtype=hidden.dtype)
    launch_moe_gemv(x, w13, sorted_ids, order, None, None, act, top_k, glu=True)
    out = torch.empty(t, h, device=hidden.device, dtype=hidden.dtype)
    launch_moe_down(act, w2, ids, weights, out)
    return out


@moe_decode_experts.register_fake
def _(hidden, logits, w13, w2, top_k, renormalize):
    return torch.empty_like(hidden)

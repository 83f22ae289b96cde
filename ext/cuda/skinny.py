"""Skinny GEMM (`y = x @ W^T` for a few rows of x) for decode steps on CUDA.

`launch_skinny_gemm` checks its operands and launches `skinny_gemm.cu` on torch's current
stream; `skinny_linear` is the torch custom op (`torch.ops.tandem.skinny_linear`) that models
call, with a fallback to `torch.nn.functional.linear` where the kernel does not apply.
`MAX_ROWS` bounds the rows of x the kernel takes (above it cuBLAS' tensor-core GEMM wins).
"""

from __future__ import annotations

import os

import torch

from ext.attention_ref import rotate_neox, write_kv
from ext.cuda._loader import i32, i64, launch, ptr

MAX_ROWS = 8
_DT = {torch.float16: 0, torch.bfloat16: 1}
_THREADS = 256
# (rows per warp, steps in flight) per row count of x, from tools/bench_skinny_gemm.py sweeps
# on an H100 over the Llama-3 8B/1B projections: at 1 row (1, 2) is fastest or within 1% on all
# of them (and 5 us a layer faster than (2, 4) on the 8B), at 2 rows (2, 4).
_TILES = {1: (1, 2), 2: (2, 4), 3: (2, 2), 4: (2, 2)}
_TILE_DEFAULT = (1, 2)


def tile_for(m: int) -> tuple[int, int]:
    env = os.environ.get("TANDEM_SKINNY_TILE")  # "R,U" override for tuning runs
    if env:
        r, u = (int(v) for v in env.split(","))
        return r, u
    return _TILES.get(m, _TILE_DEFAULT)


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

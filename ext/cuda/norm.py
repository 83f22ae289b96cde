"""RMSNorm in one CUDA kernel (`rms_norm.cu`), as the torch custom op `torch.ops.tandem.rms_norm`;
a residual add and the norm after it in one (`torch.ops.tandem.add_rms_norm`).

`rms_norm_ref` is the torch expression models used before (HF transformers' LlamaRMSNorm: the
mean of squares in float32, the normalized value rounded to the input dtype, then times the
weight); the op falls back to it wherever the kernel does not apply (CPU, fp32, a width not a
multiple of 8, unaligned rows, a weight of another dtype). At decode batch sizes the torch
expression is ~7 launch-bound kernels; the fused one is one.
"""

from __future__ import annotations

import torch

from tandem.ext.cuda._loader import f32, i32, i64, launch, ptr

_DT = {torch.float16: 0, torch.bfloat16: 1}


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x[..., D] normalized over D (float32 statistics) times weight[D], in x's dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the kernel takes this norm (else `rms_norm_ref`)."""
    if not (x.is_cuda and weight.is_cuda and x.dtype == weight.dtype and x.dtype in _DT):
        return False
    d = x.shape[-1]
    if weight.shape != (d,) or d % 8 or d == 0 or weight.data_ptr() % 16:
        return False
    return x.numel() > 0


def _check_rows(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> None:
    if x.dim() != 2 or out.shape != x.shape or weight.shape != (x.shape[1],):
        raise ValueError(f"shapes: x {tuple(x.shape)}, weight {tuple(weight.shape)}, "
                         f"out {tuple(out.shape)}")  # fmt: skip
    if not (x.dtype == weight.dtype == out.dtype and x.dtype in _DT):
        raise ValueError(f"dtypes must be fp16/bf16 and equal, got {x.dtype}, {weight.dtype}, "
                         f"{out.dtype}")  # fmt: skip
    if x.shape[1] % 8 or x.stride(1) != 1 or out.stride(1) != 1 or not weight.is_contiguous():
        raise ValueError("D must be a multiple of 8 and the inner dimensions contiguous")
    if (
        x.stride(0) % 8
        or out.stride(0) % 8
        or (x.data_ptr() | out.data_ptr() | weight.data_ptr()) % 16
    ):
        raise ValueError("x, out and weight rows must be 16-byte aligned")


def launch_rms_norm(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, eps: float) -> None:
    """out[R, D] = rms_norm(x[R, D]) * weight[D] (2-D, inner dimension contiguous, rows 16-byte
    aligned, D % 8 == 0; fp16/bf16, all one dtype and device)."""
    _check_rows(x, weight, out)
    rows, d = x.shape
    tpr = 32 if d <= 1024 else 256
    per_block = 256 // tpr
    launch(
        "rms_norm.cu",
        f"rms_norm_kernel<{tpr},{_DT[x.dtype]}>",
        x.device,
        (-(-rows // per_block), 1, 1),
        (256, 1, 1),
        (ptr(x), ptr(weight), ptr(out), i32(rows), i32(d), i64(x.stride(0)), i64(out.stride(0)),
         f32(eps)),
        pdl=True,
    )  # fmt: skip


@torch.library.custom_op("tandem::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x[..., D] with weight[D]: the fused kernel when it applies, else the torch
    expression."""
    if not supported(x, weight):
        return rms_norm_ref(x, weight, eps)
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(1) != 1 or x2.stride(0) % 8 or x2.data_ptr() % 16:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, device=x.device, dtype=x.dtype)
    launch_rms_norm(x2, weight, out, eps)
    return out.reshape(x.shape)


@rms_norm.register_fake
def _(x, weight, eps):
    return torch.empty_like(x)


def _setup_context(ctx, inputs, output):
    x, weight, eps = inputs
    ctx.save_for_backward(x, weight)
    ctx.eps = eps


def _backward(ctx, grad):
    x, weight = ctx.saved_tensors
    with torch.enable_grad():
        xr = x.detach().requires_grad_(ctx.needs_input_grad[0])
        wr = weight.detach().requires_grad_(ctx.needs_input_grad[1])
        y = rms_norm_ref(xr, wr, ctx.eps)
        inputs = [t for t in (xr, wr) if t.requires_grad]
        grads = iter(torch.autograd.grad(y, inputs, grad) if inputs else ())
    return (next(grads) if ctx.needs_input_grad[0] else None,
            next(grads) if ctx.needs_input_grad[1] else None, None)  # fmt: skip


rms_norm.register_autograd(_backward, setup_context=_setup_context)


def add_rms_norm_ref(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, rms_norm(x + delta)): the residual stream and its norm, as torch computes them."""
    s = x + delta
    return s, rms_norm_ref(s, weight, eps)


def launch_add_rms_norm(
    x: torch.Tensor,
    delta: torch.Tensor,
    weight: torch.Tensor,
    s: torch.Tensor,
    out: torch.Tensor,
    eps: float,
) -> None:
    """s[R, D] = x + delta (rounded to the dtype), out[R, D] = rms_norm(s) * weight; the same
    layout rules as `launch_rms_norm` for every operand."""
    if delta.shape != x.shape or s.shape != x.shape or delta.dtype != x.dtype or s.dtype != x.dtype:
        raise ValueError(f"delta and s must match x {tuple(x.shape)} {x.dtype}")
    if delta.dim() != 2 or delta.stride(1) != 1 or s.stride(1) != 1:
        raise ValueError("the inner dimensions must be contiguous")
    if delta.stride(0) % 8 or s.stride(0) % 8 or (delta.data_ptr() | s.data_ptr()) % 16:
        raise ValueError("delta and s rows must be 16-byte aligned")
    _check_rows(x, weight, out)
    rows, d = x.shape
    tpr = 32 if d <= 1024 else 256
    launch(
        "rms_norm.cu",
        f"add_rms_norm_kernel<{tpr},{_DT[x.dtype]}>",
        x.device,
        (-(-rows // (256 // tpr)), 1, 1),
        (256, 1, 1),
        (ptr(x), ptr(delta), ptr(weight), ptr(s), ptr(out), i32(rows), i32(d), i64(x.stride(0)),
         i64(delta.stride(0)), i64(s.stride(0)), i64(out.stride(0)), f32(eps)),
        pdl=True,
    )  # fmt: skip


@torch.library.custom_op("tandem::add_rms_norm", mutates_args=())
def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, its RMSNorm with weight[D]): one kernel when it applies, else torch's."""
    if delta.shape != x.shape or delta.dtype != x.dtype or not delta.is_cuda:
        return add_rms_norm_ref(x, delta, weight, eps)
    if not supported(x, weight):
        return add_rms_norm_ref(x, delta, weight, eps)
    x2, d2 = x.reshape(-1, x.shape[-1]), delta.reshape(-1, x.shape[-1])
    if x2.stride(1) != 1 or x2.stride(0) % 8 or x2.data_ptr() % 16:
        x2 = x2.contiguous()
    if d2.stride(1) != 1 or d2.stride(0) % 8 or d2.data_ptr() % 16:
        d2 = d2.contiguous()
    s = torch.empty(x2.shape, device=x.device, dtype=x.dtype)
    out = torch.empty_like(s)
    launch_add_rms_norm(x2, d2, weight, s, out, eps)
    return s.reshape(x.shape), out.reshape(x.shape)


@add_rms_norm.register_fake
def _(x, delta, weight, eps):
    return torch.empty_like(x), torch.empty_like(x)

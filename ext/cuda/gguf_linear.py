"""GGUF-packed linear on CUDA (`gguf_linear.cu`): `torch.ops.tandem.gguf_linear`.

Up to `MAX_ROWS` rows of x: one pass over the packed weight, dequantized in registers (the
decode path, inside CUDA graphs like any op on torch's current stream). More rows: the weight
dequantized into a scratch buffer, then cuBLAS (prefill). Reference: models.gguf_dequant +
F.linear. Knows nothing about models.
"""

from __future__ import annotations

import torch

from tandem.ext.cuda._loader import i32, i64, launch, ptr

MAX_ROWS = 16
_DT = {torch.float16: 0, torch.bfloat16: 1}
# ggml type id -> (elements per block, bytes per block)
QTYPES = {2: (32, 18), 3: (32, 20), 8: (32, 34), 12: (256, 144), 13: (256, 176), 14: (256, 210)}


def _check(data: torch.Tensor, type_id: int, k: int, device: torch.device) -> int:
    if type_id not in QTYPES:
        raise ValueError(f"ggml type {type_id} is not served by gguf_linear")
    block, size = QTYPES[type_id]
    if k % block or data.dim() != 2 or data.dtype != torch.uint8 or not data.is_contiguous():
        raise ValueError(
            f"data must be contiguous [N, {k // block * size}] uint8, K % {block} == 0"
        )
    if data.shape[1] != k // block * size or data.device != device:
        raise ValueError(f"data must be [N, {k // block * size}] on {device}")
    if data.data_ptr() % 16:
        raise ValueError("data must be 16-byte aligned")
    return data.shape[0]


def launch_gemv(x: torch.Tensor, data: torch.Tensor, type_id: int, out: torch.Tensor) -> None:
    """out[M, N] = x[M, K] @ W^T, 1 <= M <= MAX_ROWS, x/out fp16 or bf16 with 16-byte rows."""
    m, k = x.shape
    n = _check(data, type_id, k, x.device)
    if not 1 <= m <= MAX_ROWS or x.dtype not in _DT or out.dtype != x.dtype:
        raise ValueError(f"x must be [1..{MAX_ROWS}, K] fp16/bf16, out the same dtype")
    if out.shape != (m, n) or x.stride(1) != 1 or out.stride(1) != 1:
        raise ValueError(f"out must be [{m}, {n}] with contiguous rows")
    if x.stride(0) % 8 or x.data_ptr() % 16:
        raise ValueError("x rows must be 16-byte aligned")
    launch(
        "gguf_linear.cu",
        f"gguf_gemv_kernel<{type_id},{m},{_DT[x.dtype]}>",
        x.device,
        (-(-n // 8), 1, 1),
        (256, 1, 1),
        (ptr(x), ptr(data), ptr(out), i32(n), i32(k), i64(data.shape[1]), i64(x.stride(0)),
         i64(out.stride(0))),
    )  # fmt: skip


def launch_dequant(data: torch.Tensor, type_id: int, k: int, out: torch.Tensor) -> None:
    """out[N, K] (fp16/bf16, contiguous) = the packed weight's values."""
    n = _check(data, type_id, k, out.device)
    if out.shape != (n, k) or not out.is_contiguous() or out.dtype not in _DT:
        raise ValueError(f"out must be a contiguous [{n}, {k}] fp16/bf16 tensor")
    threads = n * (k // 32)
    launch(
        "gguf_linear.cu",
        f"gguf_dequant_kernel<{type_id},{_DT[out.dtype]}>",
        out.device,
        (-(-threads // 256), 1, 1),
        (256, 1, 1),
        (ptr(data), ptr(out), i32(n), i32(k), i64(data.shape[1])),
    )


@torch.library.custom_op("tandem::gguf_linear", mutates_args=())
def gguf_linear(x: torch.Tensor, data: torch.Tensor, type_id: int, k: int) -> torch.Tensor:
    """x[M, K] (fp16/bf16, CUDA) @ W[N, K]^T with W packed as ggml type `type_id`."""
    m = x.shape[0]
    n = data.shape[0]
    if 1 <= m <= MAX_ROWS:
        if x.stride(1) != 1 or x.stride(0) % 8 or x.data_ptr() % 16:
            x = x.contiguous()
        out = torch.empty(m, n, device=x.device, dtype=x.dtype)
        launch_gemv(x, data, type_id, out)
        return out
    w = torch.empty(n, k, device=x.device, dtype=x.dtype)  # scratch, from torch's cache
    launch_dequant(data, type_id, k, w)
    return torch.nn.functional.linear(x, w)


@gguf_linear.register_fake
def _(x, data, type_id, k):
    return x.new_empty(x.shape[0], data.shape[0])

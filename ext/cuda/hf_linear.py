"""GPTQ/AWQ int4 and FP8 e4m3 linears on CUDA (`hf_linear.cu`): `torch.ops.tandem.int4_linear`
and `torch.ops.tandem.fp8_linear`, in the serving layouts of models/quant/int4.py and fp8.py.

Decode sizes (inside CUDA graphs like any op on torch's current stream): `MMA_MIN_ROWS` to
`MMA_MAX_ROWS` rows of x through tensor-core MMAs over weight fragments decoded in registers
(32 rows of x a pass; needs K % 128 == 0 and one scale per row per 128 columns); otherwise up
to `GEMV_MAX_ROWS` rows the row-per-warp GEMV, one pass over the packed weight. More rows: the
weight dequantized into a scratch buffer, then cuBLAS (prefill). `fp8_scaled_mm` is the FP8 tensor-core
alternative for per-row-scaled weights (activations quantized per row). Reference: the tensors'
`dequantize()` + F.linear. Knows nothing about models.
"""

from __future__ import annotations

import torch

from tandem.ext.cuda._loader import i32, i64, launch, ptr

MAX_ROWS = 16  # the GEMV's largest instantiation
_DT = {torch.float16: 0, torch.bfloat16: 1}
INT4, FP8 = 0, 1
# Row counts up to which the GEMV beats dequantize + cuBLAS on the 8B-shaped linear stack (H100,
# tools/bench_hf_quant_gpu.py --crossover; docs/BENCHMARKS.md): its cost grows with every row of
# x (each lane re-reads x per weight row), the scratch path's does not.
GEMV_MAX_ROWS = {INT4: 8, FP8: 6}
# Where the tensor-core kernel takes a weight it serves MMA_MIN_ROWS..MMA_MAX_ROWS rows: from 2
# (int4; level with the GEMV at 1) or 1 (fp8) rows up to 64, where it is still below
# dequantize + cuBLAS (docs/BENCHMARKS.md, `--crossover`).
MMA_MIN_ROWS = {INT4: 2, FP8: 1}
MMA_MAX_ROWS = 64
_MMA_PASS = 32  # rows of x per pass of the MMA kernel (8 per MMA column tile, 4 tiles)
_SMS: dict[int, int] = {}


def _check_common(x: torch.Tensor, wq: torch.Tensor, k: int) -> None:
    if x.dtype not in _DT or x.device.type != "cuda" or x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x must be a 2-D fp16/bf16 CUDA tensor of {k} columns")
    if wq.device != x.device or not wq.is_contiguous() or wq.data_ptr() % 16 or k % 32:
        raise ValueError("packed weights must be contiguous, 16-byte aligned, on x's device")


def _args_int4(codes, scales, zeros, group, k):
    n = codes.shape[0]
    if codes.dtype != torch.uint8 or tuple(codes.shape) != (n, k // 2):
        raise ValueError(f"codes must be [N, {k // 2}] uint8")
    if group % 32 or k % group or tuple(scales.shape) != (n, k // group):
        raise ValueError(f"scales must be [N, {k // max(group, 1)}] with group % 32 == 0")
    if scales.dtype not in _DT or zeros.dtype != torch.uint8 or zeros.shape != scales.shape:
        raise ValueError("scales must be fp16/bf16 and zeros uint8 of the same shape")
    if not scales.is_contiguous() or not zeros.is_contiguous():
        raise ValueError("scales and zeros must be contiguous")
    return n, _DT[scales.dtype], (ptr(codes), ptr(scales), ptr(zeros)), (group, 0, 0)


def _args_fp8(data, scale, br, bc, k):
    n = data.shape[0]
    cols = -(-k // bc)
    if data.dtype != torch.float8_e4m3fn or tuple(data.shape) != (n, k):
        raise ValueError(f"data must be [N, {k}] float8_e4m3fn")
    if bc % 32 or br < 1 or tuple(scale.shape) != (-(-n // br), cols):
        raise ValueError("scale must tile the weight in br x bc blocks with bc % 32 == 0")
    if scale.dtype != torch.float32 or not scale.is_contiguous():
        raise ValueError("scale must be contiguous float32")
    return n, 0, (ptr(data), ptr(scale), ptr(None)), (br, bc, cols)


def _gemv(fmt: int, sdt: int, x: torch.Tensor, bufs, geo, n: int) -> torch.Tensor:
    m, k = x.shape
    if x.stride(1) != 1 or x.stride(0) % 8 or x.data_ptr() % 16:
        x = x.contiguous()
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    launch(
        "hf_linear.cu",
        f"hf_gemv_kernel<{fmt},{sdt},{m},{_DT[x.dtype]}>",
        x.device,
        (-(-n // 8), 1, 1),
        (256, 1, 1),
        (ptr(x), *bufs, ptr(out), i32(n), i32(k), *(i32(g) for g in geo), i64(x.stride(0)),
         i64(out.stride(0))),
    )  # fmt: skip
    return out


def mma_supported(fmt: int, geo, k: int) -> bool:
    """Whether the tensor-core kernel takes this weight (one scale per row per 128 columns)."""
    if k % 128:
        return False
    return geo[0] % 128 == 0 if fmt == INT4 else geo[1] % 128 == 0


def _mma(fmt: int, sdt: int, x: torch.Tensor, bufs, geo, n: int) -> torch.Tensor:
    m, k = x.shape
    if x.stride(1) != 1 or x.stride(0) % 8 or x.data_ptr() % 16:
        x = x.contiguous()
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    sms = _SMS.get(index)
    if sms is None:
        sms = _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    for m0 in range(0, m, _MMA_PASS):
        rows = min(_MMA_PASS, m - m0)
        mt = -(-rows // 8)
        mt = 4 if mt > 2 else mt
        r = 2 if mt <= 2 and n >= 64 * sms else 1  # two tiles a CTA only where CTAs abound
        xs, os_ = x[m0 : m0 + rows], out[m0 : m0 + rows]
        launch(
            "hf_linear.cu",
            f"hf_mma_kernel<{fmt},{sdt},{mt},{_DT[x.dtype]},{r},8>",
            x.device,
            (-(-n // (16 * r)), 1, 1),
            (256, 1, 1),
            (ptr(xs), *bufs, ptr(os_), i32(rows), i32(n), i32(k), *(i32(g) for g in geo),
             i64(x.stride(0)), i64(out.stride(0))),
        )  # fmt: skip
    return out


def dequantize_into(fmt: int, sdt: int, bufs, geo, out: torch.Tensor) -> None:
    """out [N, K] (fp16/bf16, contiguous) = the packed weight's values."""
    n, k = out.shape
    launch(
        "hf_linear.cu",
        f"hf_dequant_kernel<{fmt},{sdt},{_DT[out.dtype]}>",
        out.device,
        (-(-n * (k // 32) // 256), 1, 1),
        (256, 1, 1),
        (*bufs, ptr(out), i32(n), i32(k), *(i32(g) for g in geo)),
    )


def _run(fmt, sdt, x, bufs, geo, n) -> torch.Tensor:
    m = x.shape[0]
    if MMA_MIN_ROWS[fmt] <= m <= MMA_MAX_ROWS and mma_supported(fmt, geo, x.shape[1]):
        return _mma(fmt, sdt, x, bufs, geo, n)
    if 1 <= m <= min(GEMV_MAX_ROWS[fmt], MAX_ROWS):
        return _gemv(fmt, sdt, x, bufs, geo, n)
    w = torch.empty(n, x.shape[1], device=x.device, dtype=x.dtype)  # scratch, torch's cache
    dequantize_into(fmt, sdt, bufs, geo, w)
    return torch.nn.functional.linear(x, w)


@torch.library.custom_op("tandem::int4_linear", mutates_args=())
def int4_linear(
    x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int
) -> torch.Tensor:
    """x[M, K] (fp16/bf16, CUDA; columns in the codes' order) @ W[N, K]^T, W int4 groups."""
    k = codes.shape[1] * 2
    _check_common(x, codes, k)
    n, sdt, bufs, geo = _args_int4(codes, scales, zeros, group, k)
    return _run(INT4, sdt, x, bufs, geo, n)


@int4_linear.register_fake
def _(x, codes, scales, zeros, group):
    return x.new_empty(x.shape[0], codes.shape[0])


@torch.library.custom_op("tandem::fp8_linear", mutates_args=())
def fp8_linear(
    x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, block_rows: int, block_cols: int
) -> torch.Tensor:
    """x[M, K] (fp16/bf16, CUDA) @ W[N, K]^T, W e4m3 with fp32 scales per block."""
    k = data.shape[1]
    _check_common(x, data, k)
    n, sdt, bufs, geo = _args_fp8(data, scale, block_rows, block_cols, k)
    return _run(FP8, sdt, x, bufs, geo, n)


@fp8_linear.register_fake
def _(x, data, scale, block_rows, block_cols):
    return x.new_empty(x.shape[0], data.shape[0])


def fp8_scaled_mm(x: torch.Tensor, data: torch.Tensor, row_scale: torch.Tensor) -> torch.Tensor:
    """FP8 tensor cores: x quantized to e4m3 per row (dynamic scale), W [N, K] e4m3 with one
    scale per row (`row_scale` [N] float32); torch._scaled_mm with row-wise scales."""
    amax = x.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12)
    sx = amax / 448.0  # [M, 1]
    xq = (x.float() / sx).to(torch.float8_e4m3fn)
    return torch._scaled_mm(
        xq, data.t(), scale_a=sx, scale_b=row_scale.reshape(1, -1), out_dtype=x.dtype
    )

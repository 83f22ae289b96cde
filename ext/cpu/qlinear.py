"""`CpuQuantLinearPool`: the Python face of the C++ GGUF-packed linear (ext/cpu/qlinear.*).

y[M, N] = x[M, K] @ W[N, K]^T with W in a GGUF block type, read in place, synchronous, GIL
released. Validates every tensor before its address reaches C++. Knows nothing about models.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .build import load_extension
from .pool_env import int_path_enabled, isa_from_env
from .tensor_checks import output_buffer

# ggml type name -> (id, elements per block, bytes per block)
QTYPES: dict[str, tuple[int, int, int]] = {
    "Q4_0": (2, 32, 18),
    "Q4_1": (3, 32, 20),
    "Q8_0": (8, 32, 34),
    "Q4_K": (12, 256, 144),
    "Q5_K": (13, 256, 176),
    "Q6_K": (14, 256, 210),
}


@dataclass(frozen=True)
class PackedRows:
    """A GGUF-packed weight [rows, cols] that `CpuQuantLinearPool.packed` has checked."""

    data: torch.Tensor  # [rows, cols / block * type_size] uint8, CPU, contiguous
    type_id: int
    rows: int
    cols: int


class CpuQuantLinearPool:
    """Runs `linear` on the calling thread plus num_threads - 1 helper threads, which take a
    share of a call only when awake for it (ext/cpu/helpers.h).

    int8: GGUF weights (Q4_0 / Q4_1 / Q8_0 and the k-quants) take the int8-activation kernel
    (activations quantized per 32 values, integer dot products; `int8_isa` names it, "" where
    the CPU has none; `int8_serves` says per type). None: on unless $TANDEM_CPU_INT_PATH is
    off. The HF formats keep float activations."""

    def __init__(
        self, num_threads: int = 1, isa: str | None = None, int8: bool | None = None
    ) -> None:
        if not isinstance(num_threads, int) or num_threads < 1:
            raise ValueError(f"num_threads must be a positive int, got {num_threads!r}")
        isa = isa_from_env(isa)
        if int8 is None:
            int8 = int_path_enabled()
        self._pool = load_extension().QLinearPool(num_threads, isa or "", int8)

    @property
    def isa(self) -> str:
        return self._pool.isa

    @property
    def num_threads(self) -> int:
        return self._pool.num_threads

    @property
    def int8_isa(self) -> str:
        return self._pool.int8_isa

    def int8_serves(self, qtype: str) -> bool:
        """Whether `qtype` weights take the int8-activation kernel in this pool."""
        if qtype not in QTYPES:
            raise ValueError(f"qtype must be one of {tuple(QTYPES)}, got {qtype!r}")
        return bool(self._pool.int8_serves(QTYPES[qtype][0]))

    def packed(self, data: torch.Tensor, qtype: str, cols: int) -> PackedRows:
        """data [N, cols / block * type_size] uint8 checked once for `run_packed`."""
        if qtype not in QTYPES:
            raise ValueError(f"qtype must be one of {tuple(QTYPES)}, got {qtype!r}")
        type_id, block, size = QTYPES[qtype]
        if cols <= 0 or cols % block:
            raise ValueError(f"K must be a positive multiple of {block}, got {cols}")
        if (
            not isinstance(data, torch.Tensor)
            or data.dtype != torch.uint8
            or data.device.type != "cpu"
            or data.dim() != 2
            or not data.is_contiguous()
            or data.shape[1] != cols // block * size
        ):
            raise ValueError(
                f"data must be a contiguous [N, {cols // block * size}] uint8 CPU tensor"
            )
        return PackedRows(data, type_id, data.shape[0], cols)

    def run_packed(
        self,
        x: torch.Tensor,  # [M, K] float32 or bfloat16, CPU
        w: PackedRows,
        out: torch.Tensor | None = None,  # [M, N] float32 or bfloat16; default x's dtype
    ) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or x.device.type != "cpu" or x.dim() != 2:
            raise ValueError("x must be a 2-D CPU tensor")
        if x.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"x must be float32 or bfloat16, got {x.dtype}")
        M, K = x.shape
        if M == 0 or K != w.cols:
            raise ValueError(f"x must be [M >= 1, {w.cols}], got {tuple(x.shape)}")
        x = x.contiguous()
        out = output_buffer(out, M, w.rows, x.dtype)
        self._pool.run(
            w.type_id, w.data.data_ptr(), w.data.shape[1], w.rows, K, x.data_ptr(),
            x.dtype == torch.bfloat16, M, out.data_ptr(), out.dtype == torch.bfloat16,
        )  # fmt: skip
        return out

    def linear(
        self,
        x: torch.Tensor,  # [M, K] float32 or bfloat16, CPU
        data: torch.Tensor,  # [N, K / block * type_size] uint8, CPU, contiguous
        qtype: str,
        out: torch.Tensor | None = None,  # [M, N] float32 or bfloat16; default x's dtype
    ) -> torch.Tensor:
        if qtype not in QTYPES:
            raise ValueError(f"qtype must be one of {tuple(QTYPES)}, got {qtype!r}")
        if not isinstance(x, torch.Tensor) or x.device.type != "cpu" or x.dim() != 2:
            raise ValueError("x must be a 2-D CPU tensor")
        if x.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"x must be float32 or bfloat16, got {x.dtype}")
        block = QTYPES[qtype][1]
        if x.shape[0] == 0 or x.shape[1] % block:
            raise ValueError(
                f"x must be [M >= 1, K] with K a multiple of {block}, got {tuple(x.shape)}"
            )
        return self.run_packed(x, self.packed(data, qtype, x.shape[1]), out)

    def _check_x(self, x: torch.Tensor, K: int) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or x.device.type != "cpu" or x.dim() != 2:
            raise ValueError("x must be a 2-D CPU tensor")
        if x.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"x must be float32 or bfloat16, got {x.dtype}")
        if x.shape[0] == 0 or x.shape[1] != K:
            raise ValueError(f"x must be [M >= 1, {K}], got {tuple(x.shape)}")
        return x.contiguous()

    def linear_int4(
        self,
        x: torch.Tensor,  # [M, K] float32 or bfloat16, CPU (columns in the codes' order)
        codes: torch.Tensor,  # [N, K / 2] uint8 (models/quant/int4.py's nibble order)
        scales: torch.Tensor,  # [N, K / group] float16
        zeros: torch.Tensor,  # [N, K / group] uint8
        group: int,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """GPTQ/AWQ int4 with group scales and zero points (AVX-512 BF16 kernel only)."""
        N, K = codes.shape[0], codes.shape[1] * 2
        _check_packed(codes, torch.uint8, (N, K // 2), "codes")
        if group < 32 or group % 32 or K % group:
            raise ValueError(f"group must be a multiple of 32 dividing K={K}, got {group}")
        _check_packed(scales, torch.float16, (N, K // group), "scales")
        _check_packed(zeros, torch.uint8, (N, K // group), "zeros")
        x = self._check_x(x, K)
        out = output_buffer(out, x.shape[0], N, x.dtype)
        self._pool.run_scaled(
            QT_INT4G, codes.data_ptr(), K // 2, N, K, x.data_ptr(), x.dtype == torch.bfloat16,
            x.shape[0], out.data_ptr(), out.dtype == torch.bfloat16, scales.data_ptr(),
            zeros.data_ptr(), group, 0, 0, 0,
        )  # fmt: skip
        return out

    def linear_fp8(
        self,
        x: torch.Tensor,  # [M, K] float32 or bfloat16, CPU
        data: torch.Tensor,  # [N, K] float8_e4m3fn
        scale: torch.Tensor,  # [ceil(N / block[0]), ceil(K / block[1])] float32
        block: tuple[int, int],
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """FP8 e4m3 with block scales; block[1] a multiple of 32 or K (AVX-512 BF16 only)."""
        N, K = data.shape
        _check_packed(data, torch.float8_e4m3fn, (N, K), "data")
        if K % 32 or block[1] % 32 or block[0] < 1:
            raise ValueError(f"fp8 needs K and block columns multiples of 32, got {K}, {block}")
        cols = -(-K // block[1])
        _check_packed(scale, torch.float32, (-(-N // block[0]), cols), "scale")
        x = self._check_x(x, K)
        out = output_buffer(out, x.shape[0], N, x.dtype)
        self._pool.run_scaled(
            QT_FP8, data.data_ptr(), K, N, K, x.data_ptr(), x.dtype == torch.bfloat16,
            x.shape[0], out.data_ptr(), out.dtype == torch.bfloat16, scale.data_ptr(), 0, 0,
            block[0], block[1], cols,
        )  # fmt: skip
        return out


QT_INT4G, QT_FP8 = 100, 101  # ext/cpu/qlinear.h's ids of the HF formats' layouts


def _check_packed(t: torch.Tensor, dtype: torch.dtype, shape: tuple[int, int], what: str) -> None:
    if (
        not isinstance(t, torch.Tensor)
        or t.dtype != dtype
        or t.device.type != "cpu"
        or tuple(t.shape) != shape
        or not t.is_contiguous()
    ):
        raise ValueError(f"{what} must be a contiguous {list(shape)} {dtype} CPU tensor")

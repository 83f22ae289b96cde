"""`CpuQuantLinearPool`: the Python face of the C++ GGUF-packed linear (ext/cpu/qlinear.*).

y[M, N] = x[M, K] @ W[N, K]^T with W in a GGUF block type, read in place, synchronous, GIL
released. Validates every tensor before its address reaches C++. Knows nothing about models.
"""

from __future__ import annotations

import torch

from .build import load_extension
from .pool_env import isa_from_env
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


class CpuQuantLinearPool:
    """Runs `linear` on the calling thread plus num_threads - 1 pinned workers."""

    def __init__(self, num_threads: int = 1, isa: str | None = None) -> None:
        if not isinstance(num_threads, int) or num_threads < 1:
            raise ValueError(f"num_threads must be a positive int, got {num_threads!r}")
        isa = isa_from_env(isa)
        self._pool = load_extension().QLinearPool(num_threads, isa or "")

    @property
    def isa(self) -> str:
        return self._pool.isa

    def linear(
        self,
        x: torch.Tensor,  # [M, K] float32 or bfloat16, CPU
        data: torch.Tensor,  # [N, K / block * type_size] uint8, CPU, contiguous
        qtype: str,
        out: torch.Tensor | None = None,  # [M, N] float32 or bfloat16; default x's dtype
    ) -> torch.Tensor:
        if qtype not in QTYPES:
            raise ValueError(f"qtype must be one of {tuple(QTYPES)}, got {qtype!r}")
        type_id, block, size = QTYPES[qtype]
        if not isinstance(x, torch.Tensor) or x.device.type != "cpu" or x.dim() != 2:
            raise ValueError("x must be a 2-D CPU tensor")
        if x.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"x must be float32 or bfloat16, got {x.dtype}")
        M, K = x.shape
        if M == 0 or K % block:
            raise ValueError(
                f"x must be [M >= 1, K] with K a multiple of {block}, got {tuple(x.shape)}"
            )
        if (
            not isinstance(data, torch.Tensor)
            or data.dtype != torch.uint8
            or data.device.type != "cpu"
            or data.dim() != 2
            or not data.is_contiguous()
            or data.shape[1] != K // block * size
        ):
            raise ValueError(f"data must be a contiguous [N, {K // block * size}] uint8 CPU tensor")
        N = data.shape[0]
        x = x.contiguous()
        out = output_buffer(out, M, N, x.dtype)
        self._pool.run(
            type_id, data.data_ptr(), data.shape[1], N, K, x.data_ptr(),
            x.dtype == torch.bfloat16, M, out.data_ptr(), out.dtype == torch.bfloat16,
        )  # fmt: skip
        return out

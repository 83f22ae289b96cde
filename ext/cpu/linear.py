"""`CpuLinearPool` and `PackedWeight`: the Python face of the C++ dense linear (ext/cpu/linear.*).

y[M, N] = x[M, K] @ W[N, K]^T (+ bias) for small M (decode), synchronous, GIL released. bf16
weights are read in place from the caller's torch tensor; int8 / int4 are packed here with the
expert pool's quantizers (ext/cpu/reference.py::quantize gives the same values). Validates every
tensor before its address reaches C++. Knows nothing about models.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .build import load_extension
from .pool_env import isa_from_env
from .tensor_checks import output_buffer

FORMATS = ("bf16", "int8", "int4", "bf16_vnni")
_FMT_CODE = {"bf16": 0, "int8": 1, "int4": 2, "bf16_vnni": 3}
VNNI_ISAS = ("avx512", "amx")  # pools that run "bf16_vnni" (VNNI dot products; AMX tiles)
K_ALIGN = 64  # kKAlign in kernels.h


@dataclass(frozen=True)
class PackedWeight:
    """W [N, K] as the kernels read it. `data` is the caller's bf16 tensor itself for "bf16";
    int8: [N, Kp] int8 + scales [N]; int4: [N, Kp // 2] uint8 + scales [N, Kp // group];
    bf16_vnni: a bf16 copy [ceil(N / 16), Kp * 16] laid out [N / 16][Kp / 2][16][2], whose
    every output row is summed in one order whatever the number of rows (batch-invariant)."""

    fmt: str
    data: torch.Tensor
    scales: torch.Tensor | None
    group: int
    out_features: int
    in_features: int

    @property
    def padded_in_features(self) -> int:
        return -(-self.in_features // K_ALIGN) * K_ALIGN

    @property
    def nbytes(self) -> int:
        s = self.scales.numel() * 4 if self.scales is not None else 0
        return self.data.numel() * self.data.element_size() + s

    def dequantize(self) -> torch.Tensor:
        """[N, K] float32: the weights the kernels multiply with."""
        N, K, Kp = self.out_features, self.in_features, self.padded_in_features
        if self.fmt == "bf16":
            return self.data.float()
        if self.fmt == "bf16_vnni":
            w = self.data.view(-1, Kp // 2, 16, 2).permute(0, 2, 1, 3).reshape(-1, Kp)
            return w[:N, :K].float()
        if self.fmt == "int8":
            return (self.data.float() * self.scales[:, None])[:, :K]
        b = self.data.view(N, Kp // 64, 32).long()
        q = torch.cat([b & 15, b >> 4], dim=-1).reshape(N, Kp).float() - 8.0
        s = self.scales.repeat_interleave(self.group, dim=1)
        return (q * s)[:, :K]


def pack_weight(weight: torch.Tensor, fmt: str = "bf16", group_size: int = 64) -> PackedWeight:
    """weight [N, K] (any float dtype, CPU). "bf16" needs a contiguous bf16 tensor and keeps it
    (no copy); int8 / int4 quantize as ext/cpu/reference.py::quantize does."""
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.device.type != "cpu":
        raise ValueError("weight must be a 2-D CPU tensor")
    if not weight.dtype.is_floating_point:
        raise ValueError(f"weight must be floating point, got {weight.dtype}")
    N, K = weight.shape
    if N == 0 or K == 0:
        raise ValueError(f"weight must be non-empty, got {tuple(weight.shape)}")
    if fmt == "bf16":
        if weight.dtype != torch.bfloat16 or not weight.is_contiguous():
            raise ValueError("bf16 format reads the weight in place: pass a contiguous bf16 tensor")
        return PackedWeight("bf16", weight, None, 0, N, K)
    Kp = -(-K // K_ALIGN) * K_ALIGN
    if fmt == "bf16_vnni":
        Np = -(-N // 16) * 16
        wb = F.pad(weight.to(torch.bfloat16), (0, Kp - K, 0, Np - N))
        data = wb.view(Np // 16, 16, Kp // 2, 2).permute(0, 2, 1, 3).reshape(Np // 16, Kp * 16)
        return PackedWeight("bf16_vnni", data.contiguous(), None, 0, N, K)
    w = F.pad(weight.float(), (0, Kp - K))
    if fmt == "int8":
        scale = w.abs().amax(dim=1) / 127.0  # [N]
        q = torch.where(scale[:, None] > 0, torch.round(w / scale[:, None]), torch.zeros_like(w))
        return PackedWeight("int8", q.clamp(-127, 127).to(torch.int8), scale, 0, N, K)
    if group_size not in (32, 64):
        raise ValueError(f"int4 group_size must be 32 or 64, got {group_size}")
    wg = w.reshape(N, Kp // group_size, group_size)
    peak = wg.gather(-1, wg.abs().argmax(dim=-1, keepdim=True))  # first max on ties
    scale = peak / -8.0
    q = torch.where(scale != 0, torch.round(wg / scale), torch.zeros_like(wg)).clamp(-8, 7)
    nib = (q + 8).to(torch.uint8).reshape(N, Kp // 64, 64)
    data = (nib[..., :32] | (nib[..., 32:] << 4)).reshape(N, Kp // 2).contiguous()
    return PackedWeight("int4", data, scale.reshape(N, -1).contiguous(), group_size, N, K)


class CpuLinearPool:
    """Runs `linear` on the calling thread plus num_threads - 1 pinned workers (which spin for
    ~0.1 ms after a call, then sleep); calls of fewer than `parallel_min_rows` rows on the
    calling thread alone. Calls from several threads are serialized."""

    def __init__(
        self, num_threads: int | None = None, isa: str | None = None, parallel_min_rows: int = 1
    ) -> None:
        if num_threads is None:
            num_threads = torch.get_num_threads()
        if not isinstance(num_threads, int) or num_threads < 1:
            raise ValueError(f"num_threads must be a positive int, got {num_threads!r}")
        isa = isa_from_env(isa)
        if not isinstance(parallel_min_rows, int) or parallel_min_rows < 1:
            raise ValueError(f"parallel_min_rows must be a positive int, got {parallel_min_rows!r}")
        self._pool = load_extension().LinearPool(num_threads, isa or "", parallel_min_rows)

    @property
    def isa(self) -> str:
        return self._pool.isa

    @property
    def num_threads(self) -> int:
        return self._pool.num_threads

    def linear(
        self,
        x: torch.Tensor,  # [M, K] float32 or bfloat16, CPU
        w: PackedWeight,
        bias: torch.Tensor | None = None,  # [N] float32
        out: torch.Tensor | None = None,  # [M, N] float32 or bfloat16; default x's dtype
    ) -> torch.Tensor:
        """out = x @ W^T (+ bias), computed with bf16 products and fp32 sums (avx512) or fp32
        (avx2, scalar). Returns out."""
        if not isinstance(x, torch.Tensor) or x.device.type != "cpu":
            raise ValueError("x must be a CPU tensor")
        if x.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"x must be float32 or bfloat16, got {x.dtype}")
        N, K = w.out_features, w.in_features
        if x.dim() != 2 or x.shape[1] != K:
            raise ValueError(f"x must be [M, {K}], got {tuple(x.shape)}")
        M = x.shape[0]
        if M == 0:
            raise ValueError("x must have at least one row")
        x = x.contiguous()
        out = output_buffer(out, M, N, x.dtype)
        if bias is not None and (
            not isinstance(bias, torch.Tensor)
            or bias.dtype != torch.float32
            or tuple(bias.shape) != (N,)
            or not bias.is_contiguous()
            or bias.device.type != "cpu"
        ):
            raise ValueError(f"bias must be a contiguous [{N}] float32 CPU tensor")
        if w.fmt == "bf16_vnni" and self.isa not in VNNI_ISAS:
            raise ValueError(
                f"bf16_vnni weights need the avx512 or amx kernels; this pool runs {self.isa}"
            )
        data = w.data
        self._pool.run(
            _FMT_CODE[w.fmt],
            data.data_ptr(),
            data.shape[1] * data.element_size(),
            w.scales.data_ptr() if w.scales is not None else 0,
            w.group,
            N,
            K,
            w.padded_in_features,
            x.data_ptr(),
            x.dtype == torch.bfloat16,
            M,
            bias.data_ptr() if bias is not None else 0,
            out.data_ptr(),
            out.dtype == torch.bfloat16,
        )
        return out

"""`Int4Tensor`: GPTQ and AWQ int4 weights in one serving layout (4-bit codes, a scale and an
integer zero point per group of input channels), converted once at load from the checkpoints'
int32 packings, plus its reference dequantization. Knows nothing of layers or kernels.

Serving layout, for W [N, K] with groups of G input channels:
- `codes` [N, K / 2] uint8: per 32-value chunk c of a row, byte c*16 + i holds value c*32 + i in
  its low nibble and value c*32 + 16 + i in its high one (GGUF Q4_0's order, so the CPU kernels'
  nibble expansion applies);
- `scales` [N, K / G] as the checkpoint stores them (float16 usually), `zeros` [N, K / G] uint8;
- W[n, k] = scales[n, k // G] * (code[n, k] - zeros[n, k // G]).
- `perm` [K] int32 or None: GPTQ act-order. Its columns are stored sorted by group, so the
  weight read by a kernel is W[:, perm] and the kernel is given x[:, perm] (one gather of the
  activations per call; no gather inside the kernel).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.models.config import UnsupportedModelError

INT4_FORMATS = ("gptq", "awq")
# AWQ (GEMM version) packs the 8 output columns of an int32 in this nibble order.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


@dataclass
class Int4Tensor:
    qtype: str  # "gptq" | "awq": where it came from; one layout
    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    group: int
    perm: torch.Tensor | None = None

    def __post_init__(self) -> None:
        n, half = self.codes.shape
        k = half * 2
        if self.codes.dtype != torch.uint8 or k % 32 or self.group % 32 or k % self.group:
            raise ValueError(
                f"int4 codes [{n}, {half}] with group {self.group}: K must be a multiple of 32 "
                "and of the group, the group a multiple of 32"
            )
        if (
            tuple(self.scales.shape) != (n, k // self.group)
            or self.zeros.shape != self.scales.shape
        ):
            raise ValueError(
                f"int4 scales/zeros must be [{n}, {k // self.group}], got "
                f"{tuple(self.scales.shape)} and {tuple(self.zeros.shape)}"
            )

    @property
    def rows(self) -> int:
        return self.codes.shape[0]

    @property
    def cols(self) -> int:
        return self.codes.shape[1] * 2

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.cols)

    @property
    def data(self) -> torch.Tensor:  # the bulk buffer (QuantLinear counts bytes by it)
        return self.codes

    @property
    def nbytes(self) -> int:
        parts = [self.codes, self.scales, self.zeros]
        if self.perm is not None:
            parts.append(self.perm)
        return sum(p.numel() * p.element_size() for p in parts)

    def unpacked(self) -> torch.Tensor:
        """[N, K] uint8 codes in stored (permuted) column order."""
        c = self.codes.view(self.rows, -1, 16)
        return torch.cat([c & 15, c >> 4], dim=-1).reshape(self.rows, self.cols)

    def dequantize_stored(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """W[:, perm] (the stored column order) in `dtype`, computed in float32."""
        q = self.unpacked().float().view(self.rows, -1, self.group)
        w = (q - self.zeros.float()[..., None]) * self.scales.float()[..., None]
        return w.reshape(self.rows, self.cols).to(dtype)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[N, K] in the checkpoint's column order: the values every kernel must reproduce."""
        w = self.dequantize_stored(torch.float32)
        if self.perm is not None:
            w = torch.empty_like(w).index_copy_(1, self.perm.long(), w)
        return w.to(dtype)

    def to(self, device: torch.device | str) -> Int4Tensor:
        perm = None if self.perm is None else self.perm.to(device)
        return Int4Tensor(
            self.qtype, self.codes.to(device), self.scales.to(device), self.zeros.to(device),
            self.group, perm,
        )  # fmt: skip


def pack_codes(q: torch.Tensor) -> torch.Tensor:
    """[N, K] codes 0-15 (any int dtype) -> [N, K / 2] uint8 in the serving nibble order."""
    n, k = q.shape
    c = q.to(torch.uint8).reshape(n, k // 32, 2, 16)
    return (c[:, :, 0] | (c[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """int32 [..., P] -> [..., P, 8] int16, nibble i of each word at index i."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    return ((packed.to(torch.int32)[..., None] >> shifts) & 15).to(torch.int16)


def _group_order(g_idx: torch.Tensor, group: int, name: str) -> torch.Tensor | None:
    """The column order that makes act-order groups contiguous, or None when already so."""
    k = g_idx.numel()
    g = g_idx.to(torch.int64)
    plain = torch.arange(k, dtype=torch.int64) // group
    if torch.equal(g, plain):
        return None
    perm = torch.argsort(g, stable=True)
    if not torch.equal(g[perm], plain):
        raise UnsupportedModelError(
            f"GPTQ tensor {name!r}: g_idx does not assign {group} input channels to each group "
            "(no column order makes its groups contiguous); load it with --dequantize"
        )
    return perm


def from_gptq(
    name: str,
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None,
    group: int,
    zero_offset: int = 1,
) -> Int4Tensor:
    """AutoGPTQ's 4-bit layout: qweight int32 [K / 8, N] (input channel 8i + j in nibble j),
    qzeros int32 [groups, N / 8] (output channel 8i + j in nibble j; stored minus 1, modulo
    16, in the "gptq" (v1) checkpoint format, `zero_offset` 1; "gptq_v2" stores it as is, 0), scales
    [groups, N], g_idx int32 [K] (input channel -> group; act-order permutes it)."""
    k8, n = qweight.shape
    k = k8 * 8
    if group <= 0:
        group = k
    groups = scales.shape[0]
    if (
        qweight.dtype != torch.int32
        or qzeros.shape != (groups, n // 8)
        or scales.shape != (groups, n)
        or k % group
        or groups != k // group
    ):
        raise UnsupportedModelError(
            f"GPTQ tensor {name!r}: qweight {tuple(qweight.shape)}, qzeros "
            f"{tuple(qzeros.shape)}, scales {tuple(scales.shape)} are not a 4-bit layout with "
            f"group size {group}"
        )
    q = _nibbles(qweight).permute(1, 0, 2).reshape(n, k)  # [N, K]
    z = (_nibbles(qzeros).reshape(groups, n).t() + zero_offset) & 15  # [N, groups]
    perm = None
    if g_idx is not None:
        if g_idx.numel() != k:
            raise UnsupportedModelError(f"GPTQ tensor {name!r}: g_idx has {g_idx.numel()} != {k}")
        perm = _group_order(g_idx, group, name)
    if perm is not None:
        q = q[:, perm]
    return Int4Tensor(
        "gptq", pack_codes(q), scales.t().contiguous(), z.to(torch.uint8).contiguous(), group,
        None if perm is None else perm.to(torch.int32),
    )  # fmt: skip


def from_awq(
    name: str, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group: int
) -> Int4Tensor:
    """AutoAWQ's GEMM layout: qweight int32 [K, N / 8] and qzeros [groups, N / 8], the 8
    output columns of a word in AWQ_ORDER; scales [groups, N]; no zero offset."""
    k, n8 = qweight.shape
    n = n8 * 8
    if group <= 0:
        group = k
    groups = scales.shape[0]
    if (
        qweight.dtype != torch.int32
        or qzeros.shape != (groups, n8)
        or scales.shape != (groups, n)
        or k % group
        or groups != k // group
    ):
        raise UnsupportedModelError(
            f"AWQ tensor {name!r}: qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)}"
            f", scales {tuple(scales.shape)} are not the GEMM 4-bit layout with group {group}"
        )
    where = torch.tensor([AWQ_ORDER.index(j) for j in range(8)])  # column j -> its nibble
    q = _nibbles(qweight)[..., where].reshape(k, n).t()
    z = _nibbles(qzeros)[..., where].reshape(groups, n).t()
    return Int4Tensor(
        "awq", pack_codes(q), scales.t().contiguous(), z.to(torch.uint8).contiguous(), group
    )


def merge_int4(parts: list[Int4Tensor]) -> Int4Tensor | None:
    """Stack row parts into one tensor when they share group, scale dtype and column order."""
    first = parts[0]
    for p in parts[1:]:
        same_perm = (p.perm is None and first.perm is None) or (
            p.perm is not None and first.perm is not None and torch.equal(p.perm, first.perm)
        )
        if p.group != first.group or p.scales.dtype != first.scales.dtype or not same_perm:
            return None
        if p.cols != first.cols:
            return None
    if len(parts) == 1:
        return first
    return Int4Tensor(
        first.qtype,
        torch.cat([p.codes for p in parts]),
        torch.cat([p.scales for p in parts]),
        torch.cat([p.zeros for p in parts]),
        first.group,
        first.perm,
    )

"""`PackedExperts`: a MoE block's routed experts kept in a checkpoint's packed format (GGUF block
types, MXFP4 in ggml's 17-byte block), stacked as the block's w13 `[E, 2I, H]` (gate rows, then
up rows) and w2 `[E, H, I]` would be. Q4_0, Q8_0 and MXFP4 are split once at load into two
planes of the same bytes (per row the blocks' codes, then the blocks' scales), so a kernel reads
32 values with one aligned 16-byte load; the other types keep their GGUF rows. The block then
holds `PackedExpertWeight` views in place of its w13 / w2 tensors; the "gpu" expert backend runs
them (ext/cuda/moe_quant.py) and every other path dequantizes them (`dequantize`, the reference).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tandem.models.config import UnsupportedModelError
from tandem.models.gguf_dequant import dequantize
from tandem.models.gguf_reader import GGML_TYPES
from tandem.models.quant.fp8 import Fp8Tensor
from tandem.models.quant.int4 import Int4Tensor
from tandem.models.quant.tensor import QuantizedTensor, ggml_block

# Expert types kept packed for the gpu backend: the GGUF types its kernels decode, MXFP4, and
# GPTQ / AWQ int4 (without act-order).
EXPERT_KEPT_TYPES: tuple[str, ...] = (
    "Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "MXFP4", "int4", "fp8",
)  # fmt: skip
INT4_TYPE_BASE = 1000  # the kernels' type id of int4 with groups of G: INT4_TYPE_BASE + G
FP8_TYPE_BASE = 2000  # e4m3 with a float32 scale per B columns of a row: FP8_TYPE_BASE + B
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
_TYPE_IDS = {name: type_id for type_id, (name, _, _) in GGML_TYPES.items()}
# type -> (scale bytes at the start of each block, code bytes after them): kept as planes
PLANAR: dict[str, tuple[int, int]] = {"Q4_0": (2, 16), "Q8_0": (2, 32), "MXFP4": (1, 16)}


def to_planes(rows: torch.Tensor, qtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """GGUF rows [..., R, nb * size] of a `PLANAR` type -> (codes [..., R, nb * code bytes],
    scales [..., R, nb * scale bytes]), the same bytes regrouped."""
    sb, cb = PLANAR[qtype]
    blocks = rows.reshape(*rows.shape[:-1], -1, sb + cb)
    codes = blocks[..., sb:].reshape(*rows.shape[:-1], -1)
    return codes.contiguous(), blocks[..., :sb].reshape(*rows.shape[:-1], -1).contiguous()


def from_planes(codes: torch.Tensor, scales: torch.Tensor, qtype: str) -> torch.Tensor:
    """The inverse of `to_planes`: GGUF rows."""
    sb, cb = PLANAR[qtype]
    lead = codes.shape[:-1]
    blocks = torch.cat(
        (scales.reshape(*lead, -1, sb), codes.reshape(*lead, -1, cb)), dim=-1
    )  # [..., nb, sb + cb]
    return blocks.reshape(*lead, -1)


def expert_names(prefix: str, first: int, count: int) -> list[str]:
    """The canonical per-expert weight names of experts [first, first + count), three each."""
    return [f"{prefix}experts.{first + j}.{p}.weight" for j in range(count) for p in PROJECTIONS]


class PackedExperts(nn.Module):
    """The packed bytes of E experts: `data13` [E, 2I, row_bytes(H)] and `data2`
    [E, H, row_bytes(I)] uint8 buffers (GGUF rows), or for a `PLANAR` type their codes there and
    their scales in `scales13` / `scales2` (else None); allocated with the model, filled by
    `set_part` as the loader streams each expert's gate / up / down tensor by."""

    def __init__(self, source_names: list[str], qtype: str, hidden: int, inter: int) -> None:
        """Buffers on the default device: meta inside `build_model`'s `prepare`, materialized
        on the model's device with the rest of its tensors. "int4" (GPTQ / AWQ): codes in
        `data*` as Q4_0's planes; `scales*` [E, rows, 3 * groups] (per group its fp16 scale's
        two bytes, then its zero point). "fp8": the e4m3 bytes, `scales*` [E, rows, 4 * K / B]
        (a float32 per B columns; a block scale repeated on each of its rows). Their scale
        planes are allocated at the first part, which gives the group."""
        super().__init__()
        self.group = 0  # int4: values per scale; fp8: columns per scale
        block, size = (32, 18) if qtype in ("int4", "fp8") else ggml_block(qtype)
        if hidden % block or inter % block:
            raise UnsupportedModelError(
                f"{qtype} experts need hidden ({hidden}) and intermediate ({inter}) sizes that are "
                f"multiples of {block}"
            )
        if len(source_names) % 3:
            raise ValueError("source_names: gate, up and down of each expert")
        self.qtype = qtype
        self.hidden, self.inter = hidden, inter
        self.num_experts = len(source_names) // 3
        self.source_names = list(source_names)
        self._loaded = [False] * len(source_names)
        e = self.num_experts
        self.planar = qtype in PLANAR or qtype in ("int4", "fp8")
        u8 = torch.uint8
        if qtype in ("int4", "fp8"):
            per = 2 if qtype == "int4" else 1  # values per code byte
            self.register_buffer("data13", torch.empty(e, 2 * inter, hidden // per, dtype=u8))
            self.register_buffer("data2", torch.empty(e, hidden, inter // per, dtype=u8))
            self.register_buffer("scales13", None)  # once the group is known
            self.register_buffer("scales2", None)
        elif self.planar:
            sb, cb = PLANAR[qtype]
            nb13, nb2 = hidden // block, inter // block
            self.register_buffer("data13", torch.empty(e, 2 * inter, nb13 * cb, dtype=u8))
            self.register_buffer("data2", torch.empty(e, hidden, nb2 * cb, dtype=u8))
            self.register_buffer("scales13", torch.empty(e, 2 * inter, nb13 * sb, dtype=u8))
            self.register_buffer("scales2", torch.empty(e, hidden, nb2 * sb, dtype=u8))
        else:
            rb13, rb2 = hidden // block * size, inter // block * size
            self.register_buffer("data13", torch.empty(e, 2 * inter, rb13, dtype=u8))
            self.register_buffer("data2", torch.empty(e, hidden, rb2, dtype=u8))
            self.scales13 = self.scales2 = None

    @property
    def type_id(self) -> int:
        if self.qtype in ("int4", "fp8"):
            base = INT4_TYPE_BASE if self.qtype == "int4" else FP8_TYPE_BASE
            return base + self.group
        return _TYPE_IDS[self.qtype]

    @property
    def nbytes(self) -> int:
        parts = (self.data13, self.data2, self.scales13, self.scales2)
        return sum(t.numel() for t in parts if t is not None)

    def set_part(self, index: int, tensor: QuantizedTensor | Int4Tensor | Fp8Tensor) -> None:
        expert, proj = divmod(index, 3)
        rows, cols = (self.hidden, self.inter) if proj == 2 else (self.inter, self.hidden)
        name = self.source_names[index]
        if self.qtype in ("int4", "fp8"):
            set_hf = self._set_int4 if self.qtype == "int4" else self._set_fp8
            set_hf(expert, proj, name, tensor, (rows, cols))
            self._loaded[index] = True
            return
        if not isinstance(tensor, QuantizedTensor) or tensor.qtype != self.qtype:
            kind = getattr(tensor, "qtype", type(tensor).__name__)
            raise UnsupportedModelError(f"tensor {name!r} is {kind}, expected {self.qtype}")
        if tensor.shape != (rows, cols):
            raise UnsupportedModelError(
                f"tensor {name!r} has shape {tensor.shape}, expected {(rows, cols)}"
            )
        data = tensor.as_rows().data
        parts = to_planes(data, self.qtype) if self.planar else (data,)
        dsts = (self.data2, self.scales2) if proj == 2 else (self.data13, self.scales13)
        for src, dst in zip(parts, dsts, strict=False):
            if proj == 2:
                dst[expert].copy_(src)
            else:
                dst[expert, proj * self.inter : (proj + 1) * self.inter].copy_(src)
        self._loaded[index] = True

    def _set_int4(self, expert: int, proj: int, name: str, tensor, shape: tuple[int, int]):
        if not isinstance(tensor, Int4Tensor):
            raise UnsupportedModelError(
                f"tensor {name!r} is {type(tensor).__name__}, expected int4"
            )
        if tensor.shape != shape:
            raise UnsupportedModelError(
                f"tensor {name!r} has shape {tensor.shape}, expected {shape}"
            )
        if tensor.perm is not None:
            raise UnsupportedModelError(
                f"tensor {name!r}: GPTQ act-order (g_idx) experts cannot stay packed on the GPU; "
                "pass --quantization none to dequantize them at load"
            )
        self._planes_for(tensor.group, 3, name)
        scales = tensor.scales.to(torch.float16)
        if not torch.equal(scales.to(tensor.scales.dtype), tensor.scales):
            raise UnsupportedModelError(f"tensor {name!r}: scales not exact in float16")
        plane = torch.cat(
            (scales.view(torch.uint8).view(*scales.shape, 2), tensor.zeros.unsqueeze(-1)), dim=-1
        ).reshape(scales.shape[0], -1)  # [rows, groups * 3]
        self._store(expert, proj, tensor.codes, plane)

    def _planes_for(self, group: int, per_group: int, name: str) -> None:
        """Allocate the scale planes at the first part (its group fixes their size)."""
        if self.group == 0:
            if self.hidden % group or self.inter % group or group % 32:
                raise UnsupportedModelError(
                    f"{self.qtype} experts with {group} values per scale need hidden "
                    f"({self.hidden}) and intermediate ({self.inter}) sizes that are multiples"
                    " of it, and it a multiple of 32"
                )
            self.group = group
            u8, dev, e = torch.uint8, self.data13.device, self.num_experts
            width = (self.hidden // group * per_group, self.inter // group * per_group)
            self.scales13 = torch.empty(e, 2 * self.inter, width[0], dtype=u8, device=dev)
            self.scales2 = torch.empty(e, self.hidden, width[1], dtype=u8, device=dev)
        elif group != self.group:
            raise UnsupportedModelError(
                f"tensor {name!r} has {group} values per scale, not {self.group}"
            )

    def _store(self, expert: int, proj: int, codes: torch.Tensor, plane: torch.Tensor) -> None:
        if proj == 2:
            self.data2[expert].copy_(codes)
            self.scales2[expert].copy_(plane)
        else:
            rows = slice(proj * self.inter, (proj + 1) * self.inter)
            self.data13[expert, rows].copy_(codes)
            self.scales13[expert, rows].copy_(plane)

    def _set_fp8(self, expert: int, proj: int, name: str, tensor, shape: tuple[int, int]):
        if not isinstance(tensor, Fp8Tensor):
            raise UnsupportedModelError(f"tensor {name!r} is {type(tensor).__name__}, expected fp8")
        if tensor.shape != shape:
            raise UnsupportedModelError(
                f"tensor {name!r} has shape {tensor.shape}, expected {shape}"
            )
        g0, g1 = tensor.block
        self._planes_for(g1, 4, name)
        scale = tensor.scale.float().repeat_interleave(g0, dim=0)[: shape[0]]  # [rows, K / B]
        codes = tensor.data.view(torch.uint8)
        self._store(expert, proj, codes, scale.contiguous().view(torch.uint8))

    def _fp8(self, codes: torch.Tensor, plane: torch.Tensor) -> Fp8Tensor:
        n = codes.shape[0] * codes.shape[1]
        scale = plane.reshape(n, -1).contiguous().view(torch.float32)
        return Fp8Tensor(codes.reshape(n, -1).view(torch.float8_e4m3fn), scale, (1, self.group))

    def _int4(self, codes: torch.Tensor, plane: torch.Tensor) -> Int4Tensor:
        """[E, rows, ...] int4 buffers as one Int4Tensor of E * rows rows (the reference)."""
        n = codes.shape[0] * codes.shape[1]
        p = plane.reshape(n, -1, 3)
        scales = p[..., :2].contiguous().view(torch.float16).reshape(n, -1)
        return Int4Tensor("gptq", codes.reshape(n, -1), scales, p[..., 2].contiguous(), self.group)

    def finalize(self) -> None:
        pass

    def dequantize(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13 [E, 2I, H], w2 [E, H, I]) in `dtype`: the values every kernel must reproduce."""
        e = self.num_experts
        if self.qtype in ("int4", "fp8"):
            hf = self._int4 if self.qtype == "int4" else self._fp8
            w13 = hf(self.data13, self.scales13).dequantize(dtype)
            w2 = hf(self.data2, self.scales2).dequantize(dtype)
            return w13.view(e, 2 * self.inter, self.hidden), w2.view(e, self.hidden, self.inter)
        tid = self.type_id
        rows13, rows2 = self.data13, self.data2
        if self.planar:
            rows13 = from_planes(self.data13, self.scales13, self.qtype)
            rows2 = from_planes(self.data2, self.scales2, self.qtype)
        w13 = dequantize(rows13.reshape(-1), tid, (e * 2 * self.inter, self.hidden), dtype)
        w2 = dequantize(rows2.reshape(-1), tid, (e * self.hidden, self.inter), dtype)
        return w13.view(e, 2 * self.inter, self.hidden), w2.view(e, self.hidden, self.inter)

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, hidden={self.hidden}, inter={self.inter}, {self.qtype}"


@dataclass(frozen=True)
class PackedExpertWeight:
    """What a MoE block passes as w13 ("13") or w2 ("2") when its experts are packed: a view
    of its `PackedExperts` (which owns the buffers, so device moves stay with the module)."""

    owner: PackedExperts
    which: str

    @property
    def data(self) -> torch.Tensor:
        return self.owner.data13 if self.which == "13" else self.owner.data2

    @property
    def scales(self) -> torch.Tensor | None:
        return self.owner.scales13 if self.which == "13" else self.owner.scales2

    @property
    def shape(self) -> tuple[int, int, int]:
        o = self.owner
        if self.which == "13":
            return (o.num_experts, 2 * o.inter, o.hidden)
        return (o.num_experts, o.hidden, o.inter)

    @property
    def device(self) -> torch.device:
        return self.data.device


def is_packed(w: object) -> bool:
    return isinstance(w, PackedExpertWeight)


def swap_experts(block: nn.Module, prefix: str, kept: dict[str, str]) -> list[str]:
    """Replace `block`'s w13 / w2 by packed views where its backend is "gpu" and every one of
    its experts' tensors is in `kept` (canonical name -> type) with one type of
    `EXPERT_KEPT_TYPES`; the (canonical) names swapped."""
    if getattr(getattr(block, "backend", None), "name", None) != "gpu":
        return []
    w13, w2 = getattr(block, "w13", None), getattr(block, "w2", None)
    if not isinstance(w13, torch.Tensor) or not isinstance(w2, torch.Tensor):
        return []
    names = expert_names(prefix, getattr(block, "expert_start", 0), w13.shape[0])
    types = {kept.get(n) for n in names}
    if len(types) != 1 or next(iter(types)) not in EXPERT_KEPT_TYPES:
        return []
    packed = PackedExperts(names, types.pop(), w13.shape[2], w2.shape[2])
    del block.w13, block.w2
    block.packed_experts = packed
    block.w13 = PackedExpertWeight(packed, "13")
    block.w2 = PackedExpertWeight(packed, "2")
    return names

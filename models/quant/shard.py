"""One tensor-parallel rank's slice of a packed weight, still packed: output rows (a column
split) or input columns (a row split) of a GGUF block tensor, a GPTQ/AWQ `Int4Tensor` or an
`Fp8Tensor`. A row split must fall on quant block / group boundaries: `split_error` says
why one cannot (the loader then dequantizes that layer), `take_packed` refuses it.
Knows nothing of layers or of which weight splits along which dimension.
"""

from __future__ import annotations

import dataclasses

import torch

from tandem.models.config import UnsupportedModelError
from tandem.models.quant.fp8 import Fp8Tensor
from tandem.models.quant.hf_config import HfQuantConfig
from tandem.models.quant.int4 import Int4Tensor, pack_codes
from tandem.models.quant.tensor import QuantizedTensor, ggml_block

PackedWeight = QuantizedTensor | Int4Tensor | Fp8Tensor


def _cut(start: int, length: int, unit: int) -> bool:
    return start % unit != 0 or length % unit != 0


def split_error(
    qtype: str, dim: int, start: int, length: int, full: tuple[int, ...],
    hf_quant: HfQuantConfig | None = None,
) -> str | None:  # fmt: skip
    """Why `[start, start + length)` along `dim` of a `qtype` weight of shape `full` cannot be
    taken packed (a quant block or group would be cut), or None when it can. `qtype`: a ggml
    type, "int4" or "fp8"; `hf_quant` gives the group or scale block of the latter two."""
    if length == full[dim]:
        return None
    if qtype == "int4":
        group = hf_quant.group if hf_quant is not None else 0
        if dim == 1 and (group <= 0 or _cut(start, length, group)):
            what = "one group per row" if group <= 0 else f"groups of {group}"
            return f"int4 with {what} cannot split its {full[1]} input columns at {start}+{length}"
        return None
    if qtype == "fp8":
        block = hf_quant.block if hf_quant is not None else (128, 128)
        if _cut(start, length, block[dim]):
            return f"fp8 scale blocks of {block[dim]} cut by a split at {start}+{length}"
        return None
    elements, _ = ggml_block(qtype)
    if dim == 1 and _cut(start, length, elements):
        return f"{qtype} blocks of {elements} values cut by a split at {start}+{length}"
    return None


def take_packed(tensor: PackedWeight, dim: int, start: int, length: int, name: str) -> PackedWeight:
    """Rows (`dim` 0) or columns (`dim` 1) `[start, start + length)` of `tensor`, still packed.
    Views where the layout allows (a GGUF tensor's rows of a file mapping stay unread until
    copied). Raises `UnsupportedModelError` naming `name` when the split cuts a block/group."""
    if length == tensor.shape[dim]:
        return tensor
    try:
        if isinstance(tensor, QuantizedTensor):
            return _take_gguf(tensor.as_rows(), dim, start, length)
        if isinstance(tensor, Int4Tensor):
            return _take_int4(tensor, dim, start, length)
        return _take_fp8(tensor, dim, start, length)
    except ValueError as exc:
        raise UnsupportedModelError(
            f"tensor {name!r} cannot be split across tensor-parallel ranks packed: {exc}; "
            "pass --dequantize (each rank then holds dense slices)"
        ) from None


def _take_gguf(t: QuantizedTensor, dim: int, start: int, length: int) -> QuantizedTensor:
    if dim == 0:
        return QuantizedTensor(t.qtype, t.data.narrow(0, start, length), t.cols)
    elements, size = ggml_block(t.qtype)
    if _cut(start, length, elements):
        raise ValueError(f"{t.qtype} blocks of {elements} values cut at {start}+{length}")
    data = t.data.narrow(1, start // elements * size, length // elements * size)
    return QuantizedTensor(t.qtype, data, length)


def _take_int4(t: Int4Tensor, dim: int, start: int, length: int) -> Int4Tensor:
    if dim == 0:
        return dataclasses.replace(
            t,
            codes=t.codes.narrow(0, start, length),
            scales=t.scales.narrow(0, start, length),
            zeros=t.zeros.narrow(0, start, length),
        )
    g = t.group
    if t.perm is None:
        if _cut(start, length, g):
            raise ValueError(f"int4 groups of {g} cut at {start}+{length}")
        return dataclasses.replace(
            t,
            codes=t.codes.narrow(1, start // 2, length // 2),
            scales=t.scales.narrow(1, start // g, length // g),
            zeros=t.zeros.narrow(1, start // g, length // g),
        )
    # act-order: stored column j is input column perm[j]; stored groups are contiguous. The
    # slice is packable when every stored group lies wholly inside or outside it.
    perm = t.perm.long()
    inside = ((perm >= start) & (perm < start + length)).view(-1, g)
    whole = inside.all(1)
    if not torch.equal(whole, inside.any(1)):
        raise ValueError(f"act-order groups mix input columns of several ranks ({start}+{length})")
    groups = whole.nonzero().flatten()
    cols = (groups[:, None] * g + torch.arange(g)).flatten()
    codes = t.unpacked()[:, cols]
    local = (perm[cols] - start).to(torch.int32)
    identity = torch.equal(local, torch.arange(length, dtype=torch.int32))
    return Int4Tensor(
        t.qtype, pack_codes(codes), t.scales[:, groups].contiguous(),
        t.zeros[:, groups].contiguous(), g, None if identity else local,
    )  # fmt: skip


def _take_fp8(t: Fp8Tensor, dim: int, start: int, length: int) -> Fp8Tensor:
    unit = t.block[dim]
    if dim == 1 and t.block == (1, t.cols):  # one scale per row: any column split
        return Fp8Tensor(t.data.narrow(1, start, length), t.scale, (1, length))
    if start % unit or (length % unit and start + length != t.shape[dim]):
        raise ValueError(f"fp8 scale blocks of {unit} cut at {start}+{length}")
    scale = t.scale.narrow(dim, start // unit, -(-length // unit))
    return Fp8Tensor(t.data.narrow(dim, start, length), scale, t.block)

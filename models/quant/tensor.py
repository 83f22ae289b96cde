"""`QuantizedTensor`: a 2-D weight kept in a checkpoint's packed format (GGUF block types),
row-major with each row's blocks contiguous (layout "rows") or, on CUDA, re-laid in 16-row
tiles for the tensor-core GEMV (layout "tile16"; "tile16x2": a [gate; up] weight's rows paired
in blocks of 8 before tiling; ext/cuda/gguf_tile.py), plus its reference
dequantization. Knows the byte layouts only through `models.gguf_dequant` and that module's
exact inverse; knows nothing of layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.ext.cuda import gguf_tile
from tandem.models.config import UnsupportedModelError
from tandem.models.gguf_dequant import dequantize
from tandem.models.gguf_reader import GGML_TYPES

# GGUF types served quantized (the rest are dequantized at load or refused with a message).
GGUF_KEPT_TYPES: tuple[str, ...] = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
_TYPE_IDS = {name: type_id for type_id, (name, _, _) in GGML_TYPES.items()}


def ggml_block(qtype: str) -> tuple[int, int]:
    """(elements per block, bytes per block) of a ggml type name."""
    if qtype not in _TYPE_IDS:
        raise UnsupportedModelError(f"unknown ggml type {qtype!r}")
    _, block, size = GGML_TYPES[_TYPE_IDS[qtype]]
    return block, size


@dataclass
class QuantizedTensor:
    """W [rows, cols] as `data` [rows, cols / block * type_size] uint8 (any device), or with
    layout "tile16" / "tile16x2" as [rows / 16, gguf_tile.tile_bytes(type, cols)]."""

    qtype: str
    data: torch.Tensor
    cols: int
    layout: str = "rows"

    def __post_init__(self) -> None:
        block, size = ggml_block(self.qtype)
        if self.data.dtype != torch.uint8 or self.data.dim() != 2:
            raise ValueError(f"{self.qtype} data must be 2-D uint8, got {self.data.dtype}")
        if self.layout in ("tile16", "tile16x2"):
            tid = gguf_tile.type_id_of(self.qtype)
            if tid is None or self.data.shape[1] != gguf_tile.tile_bytes(tid, self.cols):
                raise ValueError(f"{self.qtype} [{self.cols} columns] has no such tile layout")
            return
        if self.layout != "rows":
            raise ValueError(f"unknown layout {self.layout!r}")
        if self.cols % block or self.data.shape[1] != self.cols // block * size:
            raise ValueError(
                f"{self.qtype} rows of {self.cols} values take {self.cols // block * size} bytes,"
                f" got {self.data.shape[1]}"
            )

    @property
    def rows(self) -> int:
        return self.data.shape[0] * (1 if self.layout == "rows" else 16)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.cols)

    @property
    def type_id(self) -> int:
        return _TYPE_IDS[self.qtype]

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[rows, cols] in `dtype` on data's device: the values every kernel must reproduce."""
        data = self.as_rows().data
        return dequantize(data, self.type_id, self.shape, dtype, self.qtype)

    def as_rows(self) -> QuantizedTensor:
        """The same weight in the GGUF row layout (a copy when tiled)."""
        if self.layout == "rows":
            return self
        rows = gguf_tile.from_tiles(self.data, self.type_id, self.cols)
        if self.layout == "tile16x2":
            rows = gguf_tile.unpair_rows(rows)
        return QuantizedTensor(self.qtype, rows, self.cols)

    def as_tiles(self, pairs: bool = False) -> QuantizedTensor:
        """The same weight in the tile layout (a copy; `pairs`: a [gate; up] weight's rows
        paired for `gguf_tile_swiglu`); `gguf_tile.supports` must hold."""
        layout = "tile16x2" if pairs else "tile16"
        if self.layout == layout:
            return self
        rows = self.as_rows().data
        rows = gguf_tile.pair_rows(rows) if pairs else rows
        return QuantizedTensor(
            self.qtype, gguf_tile.to_tiles(rows, self.type_id, self.cols), self.cols, layout
        )

    def take_rows(self, index: torch.Tensor) -> QuantizedTensor:
        """The rows `index` (1-D int64), still packed (in the row layout)."""
        data = self.as_rows().data
        return QuantizedTensor(self.qtype, data.index_select(0, index), self.cols)

    def to(self, device: torch.device | str) -> QuantizedTensor:
        return QuantizedTensor(self.qtype, self.data.to(device), self.cols, self.layout)


def cat_rows(parts: list[QuantizedTensor]) -> QuantizedTensor:
    """Stack same-type tensors along rows (one packed tensor, one kernel call)."""
    first = parts[0]
    if any(p.qtype != first.qtype or p.cols != first.cols or p.layout != "rows" for p in parts):
        raise ValueError("cat_rows needs tensors of one type and width")
    if len(parts) == 1:
        return first
    return QuantizedTensor(first.qtype, torch.cat([p.data for p in parts]), first.cols)

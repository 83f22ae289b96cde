"""`QuantLinear` and `QuantEmbedding`: layers whose weights stay packed (GGUF `QuantizedTensor`;
the linear also GPTQ/AWQ `Int4Tensor` and FP8 `Fp8Tensor`).

A fused projection (qkv, gate_up) is a stack of row parts that may differ in type (a Q4_K_M
file keeps v in Q6_K and q/k in Q4_K); consecutive parts of one type share one segment buffer,
one kernel call each. Without a kernel (`kernel is None`) the forward is the
reference: dequantize through torch, then F.linear. Device kernels are attached from outside
(models.quant.cpu, models.quant.cuda); this module imports none.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tandem.models.config import UnsupportedModelError
from tandem.models.quant.fp8 import Fp8Tensor, merge_fp8
from tandem.models.quant.int4 import Int4Tensor, merge_int4
from tandem.models.quant.tensor import QuantizedTensor, ggml_block

PackedWeight = QuantizedTensor | Int4Tensor | Fp8Tensor
# HF checkpoint formats (part type -> tensor class): each part is kept as read, then runs of
# parts that share a layout are stacked into one segment once all have loaded.
HF_PART_TYPES: dict[str, type] = {"int4": Int4Tensor, "fp8": Fp8Tensor}
# kernel(x [M, K] float, segment) -> [M, segment.rows] in x's dtype
QuantKernel = Callable[[torch.Tensor, PackedWeight], torch.Tensor]


def _merge(parts: list) -> list:
    """Consecutive parts stacked into as few segments as their layouts allow."""
    merge = merge_int4 if isinstance(parts[0], Int4Tensor) else merge_fp8
    out, run = [], [parts[0]]
    for p in parts[1:]:
        if merge(run + [p]) is not None:
            run.append(p)
        else:
            out.append(merge(run))
            run = [p]
    out.append(merge(run))
    return out


class QuantLinear(nn.Module):
    """y = x @ W^T (+ b) with W held as packed row parts named by `source_names`."""

    weight = None  # no dense weight: loaders and fast-path swaps must not look for one

    def __init__(
        self,
        in_features: int,
        part_rows: list[int],
        source_names: list[str],
        bias: bool,
        device: torch.device | str,
        part_types: list[str],
        tied: QuantEmbedding | None = None,
    ) -> None:
        """`part_types`: one ggml type per part; consecutive parts of one type share a buffer
        that each part is copied into as it loads (one copy, no merge). `tied`: the head of
        tied embeddings, which reads the embedding's table."""
        super().__init__()
        self.in_features = in_features
        self.out_features = sum(part_rows)
        self.part_rows = list(part_rows)
        self.source_names = list(source_names)
        self.part_types = list(part_types)
        self.device = torch.device(device)
        self._tied = [tied] if tied is not None else []  # not a submodule
        self._loaded = [False] * len(part_rows)
        self._parts: list = [None] * len(part_rows)  # HF formats: parts until finalize
        self.segments: list[PackedWeight] = []
        self.bias = (
            nn.Parameter(torch.empty(self.out_features), requires_grad=False) if bias else None
        )
        self.kernel: QuantKernel | None = None

    def _segment_of(self, index: int) -> tuple[int, int]:
        """(segment, first row in it) of part `index` under `part_types`' runs."""
        seg, row = 0, 0
        for i in range(index):
            if self.part_types[i + 1] != self.part_types[i]:
                seg, row = seg + 1, 0
            else:
                row += self.part_rows[i]
        return seg, row

    def set_part(self, index: int, tensor: PackedWeight) -> None:
        expected = (self.part_rows[index], self.in_features)
        if tensor.shape != expected:
            raise UnsupportedModelError(
                f"tensor {self.source_names[index]!r} has shape {tensor.shape}, expected {expected}"
            )
        kind = HF_PART_TYPES.get(self.part_types[index])
        if kind is not None:
            if not isinstance(tensor, kind):
                raise UnsupportedModelError(
                    f"tensor {self.source_names[index]!r} is {type(tensor).__name__}, expected "
                    f"{self.part_types[index]}"
                )
            self._parts[index] = tensor.to(self.device)
            self._loaded[index] = True
            return
        if tensor.qtype != self.part_types[index]:
            raise UnsupportedModelError(
                f"tensor {self.source_names[index]!r} is {tensor.qtype}, expected {self.part_types[index]}"
            )
        if not self.segments:
            self._allocate()
        seg, row = self._segment_of(index)
        self.segments[seg].data[row : row + tensor.rows].copy_(tensor.data)  # host or device
        self._loaded[index] = True

    def _allocate(self) -> None:
        runs: list[tuple[str, int]] = []
        for qtype, rows in zip(self.part_types, self.part_rows, strict=True):
            if runs and runs[-1][0] == qtype:
                runs[-1] = (qtype, runs[-1][1] + rows)
            else:
                runs.append((qtype, rows))
        self.segments = []
        for qtype, rows in runs:
            block, size = ggml_block(qtype)
            data = torch.empty(
                rows, self.in_features // block * size, dtype=torch.uint8, device=self.device
            )
            self.segments.append(QuantizedTensor(qtype, data, self.in_features))

    def finalize(self) -> None:
        """A tied head takes the embedding's table once it is loaded; HF-format parts become
        their segments once all have loaded (idempotent)."""
        if any(p is not None for p in self._parts) and all(self._loaded):
            self.segments = _merge(self._parts)
            self._parts = [None] * len(self._parts)
        if self._tied:
            table = self._tied[0].table
            self.segments = [table] if table is not None else []

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.segments)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """[out_features, in_features] in dtype: the reference weight."""
        return torch.cat([s.dequantize(dtype) for s in self.segments])

    def forward(self, x: torch.Tensor, add_bias: bool = True) -> torch.Tensor:
        """x `[..., in_features]` float; `add_bias` False: a row-parallel shard on a rank
        other than 0 (the bias counts once over the ranks)."""
        if not self.segments or not (all(self._loaded) or self._tied):
            raise RuntimeError(f"QuantLinear {self.source_names} used before its weights loaded")
        x2 = x.reshape(-1, self.in_features)
        if self.kernel is None or x2.shape[0] == 0:
            y = F.linear(x2, self.dequantized(x.dtype))
        else:
            ys = [self.kernel(x2, s) for s in self.segments]
            y = ys[0] if len(ys) == 1 else torch.cat(ys, dim=-1)
        if self.bias is not None and add_bias:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        types = "+".join(s.qtype for s in self.segments) or "unloaded"
        return f"in_features={self.in_features}, out_features={self.out_features}, types={types}"


class QuantEmbedding(nn.Module):
    """Embedding lookup that dequantizes only the rows it gathers."""

    weight = None

    def __init__(
        self, num_embeddings: int, dim: int, source_name: str, dtype: torch.dtype, device,
        vocab: VocabSplit | None = None,
    ) -> None:  # fmt: skip
        """`vocab` (tensor parallel): this rank holds `num_embeddings` rows from `vocab.start`;
        other ids look up zeros, and the all-reduce fills them in."""
        super().__init__()
        self.vocab = vocab
        self.num_embeddings = num_embeddings
        self.embedding_dim = dim
        self.source_names = [source_name]
        self.dtype = dtype
        self.device = torch.device(device)
        self.table: QuantizedTensor | None = None

    @property
    def start(self) -> int:
        """The first vocab row this rank holds (tensor_parallel_shards reads it)."""
        return 0 if self.vocab is None else self.vocab.start

    @property
    def num_rows(self) -> int:
        return self.num_embeddings

    def set_part(self, index: int, tensor: QuantizedTensor) -> None:
        if tensor.shape != (self.num_embeddings, self.embedding_dim):
            raise UnsupportedModelError(
                f"tensor {self.source_names[0]!r} has shape {tensor.shape}, expected "
                f"{(self.num_embeddings, self.embedding_dim)}"
            )
        self.table = QuantizedTensor(
            tensor.qtype, tensor.data.to(self.device, copy=True), tensor.cols
        )

    def finalize(self) -> None:
        pass

    @property
    def segments(self) -> list[QuantizedTensor]:
        return [] if self.table is None else [self.table]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        assert self.table is not None
        flat = ids.reshape(-1)
        if self.vocab is None:
            rows = self.table.take_rows(flat).dequantize(self.dtype)  # [T, dim]
            return rows.reshape(*ids.shape, self.embedding_dim)
        local = flat - self.vocab.start
        own = (local >= 0) & (local < self.num_embeddings)
        rows = self.table.take_rows(torch.where(own, local, 0)).dequantize(self.dtype)
        rows = rows * own[:, None].to(rows.dtype)
        return self.vocab.tp.all_reduce(rows).reshape(*ids.shape, self.embedding_dim)


class QuantLogits:
    """compute_logits through a packed head (float32 logits); under tensor parallelism
    (`vocab`) this rank's vocab columns, padded to the ranks' equal share and gathered."""

    def __init__(self, head: QuantLinear, vocab: VocabSplit | None = None) -> None:
        self.head = head
        self.vocab = vocab

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = self.head(hidden).float()
        if self.vocab is None:
            return logits
        pad = self.vocab.per_rank - logits.shape[-1]
        if pad:
            logits = F.pad(logits, (0, pad))
        return self.vocab.tp.gather_columns(logits, self.vocab.size)


@dataclass(frozen=True)
class VocabSplit:
    """A vocabulary split across tensor-parallel ranks: this rank's rows start at `start`;
    every rank's share is padded to `per_rank` rows; `tp` runs the collectives."""

    size: int
    start: int
    per_rank: int
    tp: Any


def quant_modules(model: nn.Module) -> list[QuantLinear | QuantEmbedding]:
    mods: list[QuantLinear | QuantEmbedding] = [
        m for m in model.modules() if isinstance(m, QuantLinear | QuantEmbedding)
    ]
    head = getattr(model, "quant_head", None)
    if head is not None and all(head is not m for m in mods):
        mods.append(head)
    return mods


def quantized_bytes(model: nn.Module) -> int:
    """Packed weight bytes the model holds (a tied head shares its embedding's bytes)."""
    seen: set[int] = set()
    total = 0
    for mod in quant_modules(model):
        for seg in mod.segments:
            if seg.data.data_ptr() not in seen:
                seen.add(seg.data.data_ptr())
                total += seg.nbytes
    return total

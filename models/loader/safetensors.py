"""Reads HF safetensors checkpoints: one file, a directory with `model.safetensors`, or a
sharded directory with `model.safetensors.index.json`. Files are memory-mapped (safe_open);
each tensor is materialized and cast to the target dtype only when the consumer asks for it.

Quantized checkpoints (models/quant/hf_config.py: GPTQ, AWQ, FP8) come one logical weight at a
time: `<module>.weight` assembled from its companions (qweight/qzeros/scales/g_idx, or the fp8
values and their scale), either still packed (names in `packed`: `Int4Tensor` / `Fp8Tensor`)
or dequantized to `dtype`, so no full high-precision copy of the checkpoint ever exists.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from tandem.models.config import UnsupportedModelError
from tandem.models.layers.parallel import Shard
from tandem.models.quant.fp8 import SCALE_SUFFIXES, Fp8Tensor, read_fp8
from tandem.models.quant.hf_config import HfQuantConfig, read_quant_config
from tandem.models.quant.int4 import from_awq, from_gptq
from tandem.models.quant.shard import take_packed

INDEX_NAME = "model.safetensors.index.json"
# Tensors kept in their stored float32 whatever the model dtype: DeepSeek-V3's router
# correction bias (its small differences pick the experts; transformers keeps it float32 too).
KEEP_FLOAT32 = (".e_score_correction_bias",)
INT4_PARTS = (".qzeros", ".scales", ".g_idx")  # companions of "<module>.qweight"
FP8_EXTRA = (".input_scale",)  # static activation scales: Tandem keeps activations unscaled
_FP8_NAMES = ("F8_E4M3", "F8_E5M2")


def safetensors_files(path: str | Path) -> list[Path]:
    """The checkpoint files of `path` (a file or an HF directory), in a stable order."""
    path = Path(path)
    if path.is_file():
        return [path]
    index = path / INDEX_NAME
    if index.exists():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        return [path / f for f in sorted(set(weight_map.values()))]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {path}")
    return files


class _Tensors:
    """Name -> tensor over every file of a checkpoint (files opened once, on first need)."""

    def __init__(self, files: list[Path]) -> None:
        self.where: dict[str, Path] = {}
        self.dtypes: dict[str, str] = {}
        self._open: dict[Path, Any] = {}
        for file in files:
            f = self._file(file)
            for name in f.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                self.where[name] = file
                self.dtypes[name] = f.get_slice(name).get_dtype()

    def _file(self, file: Path) -> Any:
        if file not in self._open:
            self._open[file] = safe_open(str(file), framework="pt", device="cpu")
        return self._open[file]

    def get(self, name: str) -> torch.Tensor | None:
        file = self.where.get(name)
        return None if file is None else self._file(file).get_tensor(name)

    def names(self) -> Iterator[str]:
        return iter(self.where)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._file(self.where[name]).get_slice(name).get_shape())

    def get_part(self, name: str, dim: int, start: int, length: int) -> torch.Tensor:
        """`[start, start + length)` along `dim` of `name`, reading only those bytes."""
        index = [slice(None)] * len(self.shape(name))
        index[dim] = slice(start, start + length)
        return self._file(self.where[name]).get_slice(name)[tuple(index)]


def quantized_weights(tensors: _Tensors) -> dict[str, str]:
    """`<module>.weight` -> "int4" | "fp8" for every quantized weight of the checkpoint (fp8:
    e4m3 or e5m2 values; only e4m3 stays packed)."""
    out: dict[str, str] = {}
    for name, dtype in tensors.dtypes.items():
        if name.endswith(".qweight"):
            out[name[: -len("qweight")] + "weight"] = "int4"
        elif dtype in _FP8_NAMES:
            out[name] = "fp8"
    return out


def _companions(tensors: _Tensors, quantized: dict[str, str]) -> set[str]:
    """The tensors read as part of a quantized weight (never yielded on their own)."""
    skip: set[str] = set()
    for name, kind in quantized.items():
        base = name[: -len(".weight")]
        if kind == "int4":
            names = [base + ".qweight", *(base + p for p in INT4_PARTS)]
        else:
            names = [name + s for s in SCALE_SUFFIXES] + [base + p for p in FP8_EXTRA]
        skip.update(n for n in names if n in tensors.where)
    return skip


def infer_quant_config(tensors: _Tensors, method: str) -> HfQuantConfig:
    """`--quantization gptq|awq|fp8` on a checkpoint whose config.json says nothing: the group
    size from the first int4 weight's scales (GPTQ taken as the v1 "gptq" format)."""
    if method == "fp8":
        return HfQuantConfig("fp8")
    for name in tensors.names():
        if name.endswith(".qweight"):
            qweight = tensors.get(name)
            scales = tensors.get(name[: -len("qweight")] + "scales")
            k = qweight.shape[0] * (8 if method == "gptq" else 1)
            groups = scales.shape[0] if scales is not None else 1
            return HfQuantConfig(method, k // groups, 1 if method == "gptq" else 0)
    raise UnsupportedModelError(f"--quantization {method}: the checkpoint has no qweight tensors")


def read_quantized(tensors: _Tensors, name: str, kind: str, quant: HfQuantConfig | None) -> Any:
    """The quantized weight `name` (`<module>.weight`) as an `Int4Tensor` or `Fp8Tensor`."""
    if kind == "fp8":
        block = quant.block if quant is not None and quant.method == "fp8" else (128, 128)
        return read_fp8(name, tensors.get(name), tensors.get, block)
    if quant is None or quant.method not in ("gptq", "awq"):
        raise UnsupportedModelError(
            f"tensor {name[: -len('weight')]}qweight is int4 but config.json has no GPTQ or AWQ "
            "quantization_config; pass --quantization gptq or --quantization awq"
        )
    base = name[: -len("weight")]
    qweight, qzeros, scales = (tensors.get(base + p) for p in ("qweight", "qzeros", "scales"))
    if qzeros is None or scales is None:
        raise UnsupportedModelError(f"{quant.method.upper()} tensor {name!r} lacks qzeros/scales")
    if quant.method == "gptq":
        g_idx = tensors.get(base + "g_idx")
        return from_gptq(name, qweight, qzeros, scales, g_idx, quant.group, quant.zero_offset)
    return from_awq(name, qweight, qzeros, scales, quant.group)


def read_shard(
    tensors: _Tensors, name: str, kind: str | None, quant: HfQuantConfig | None, shard: Shard
) -> Any | None:
    """This rank's `shard` of weight `name` read alone (dense, or packed `Int4Tensor` /
    `Fp8Tensor`), or None where only the whole tensor can be read (then sliced by the caller):
    a stored shape other than the expected full one, int4 act-order or one group per row
    along the split, or an output split that cuts a packed word of 8 channels."""
    dim, start, length = shard.dim, shard.start, shard.length
    if kind is None:
        return (
            tensors.get_part(name, dim, start, length)
            if tensors.shape(name) == shard.full
            else None
        )
    if kind == "fp8":
        if tensors.shape(name) != shard.full:
            return None
        block = quant.block if quant is not None and quant.method == "fp8" else (128, 128)
        meta = torch.empty(shard.full, dtype=torch.float8_e4m3fn, device="meta")
        part = take_packed(read_fp8(name, meta, tensors.get, block), dim, start, length, name)
        return Fp8Tensor(tensors.get_part(name, dim, start, length), part.scale, part.block)
    if quant is None or quant.method not in ("gptq", "awq") or quant.group <= 0:
        return None
    base, g = name[: -len("weight")], quant.group
    n, k = shard.full
    gptq = quant.method == "gptq"
    if tensors.shape(base + "qweight") != ((k // 8, n) if gptq else (k, n // 8)):
        return None
    if dim == 0:  # output channels: qzeros (and AWQ's qweight) pack 8 of them per word
        if start % 8 or length % 8:
            return None
        w_part = (start, length) if gptq else (start // 8, length // 8)
        z_part, s_part = (start // 8, length // 8), (start, length)
    else:  # input channels, whole groups (GPTQ's qweight packs 8 per word)
        if start % g or length % g:
            return None
        if gptq and base + "g_idx" in tensors.where:
            g_idx = tensors.get(base + "g_idx")
            if not torch.equal(g_idx.long(), torch.arange(k) // g):
                return None  # act-order: converted whole, then cut (or refused) by the caller
        w_part = (start // 8, length // 8) if gptq else (start, length)
        z_part = s_part = (start // g, length // g)
    t_dim = 1 if dim == 0 else 0  # qweight, qzeros and scales all put N on dim 1
    qweight = tensors.get_part(base + "qweight", t_dim, *w_part)
    qzeros = tensors.get_part(base + "qzeros", t_dim, *z_part)
    scales = tensors.get_part(base + "scales", t_dim, *s_part)
    if not gptq:
        return from_awq(name, qweight, qzeros, scales, g)
    g_idx = tensors.get(base + "g_idx") if dim == 0 and base + "g_idx" in tensors.where else None
    return from_gptq(name, qweight, qzeros, scales, g_idx, g, quant.zero_offset)


def iter_safetensors_weights(
    path: str | Path,
    dtype: torch.dtype | None = None,
    select: Callable[[str], bool] | None = None,
    packed: set[str] | frozenset[str] = frozenset(),
    quant: HfQuantConfig | None = None,
    shards: Mapping[str, Shard] | None = None,
) -> Iterator[tuple[str, Any]]:
    """Yield (HF name, CPU tensor) for every tensor, or those whose name `select` accepts (the
    others are never read); floating tensors cast to `dtype`. A quantized weight comes as
    `<module>.weight`: packed when its name is in `packed`, else dequantized. `quant`: the
    checkpoint's format (default: its config.json's). `shards` (tensor parallel): a dense or
    packed tensor named there comes as that slice alone where `read_shard` can read it so."""
    tensors = _Tensors(safetensors_files(path))
    quantized = quantized_weights(tensors)
    if quant is None and quantized:
        quant = read_quant_config(path)
    skip = _companions(tensors, quantized)
    order = [n for n in tensors.names() if n not in skip]
    order += [n for n, kind in quantized.items() if kind == "int4"]
    for name in order:
        if select is not None and not select(name):
            continue
        kind = quantized.get(name)
        shard = shards.get(name) if shards else None
        part = None
        if shard is not None and (kind is None or name in packed):
            part = read_shard(tensors, name, kind, quant, shard)
        if part is not None and kind is not None:
            yield name, part
            continue
        if part is not None:
            tensor = part
        elif kind is not None:
            tensor = read_quantized(tensors, name, kind, quant)
            if name in packed:
                yield name, tensor
                continue
            tensor = tensor.dequantize(torch.float32)
        else:
            tensor = tensors.get(name)
        if name.endswith(KEEP_FLOAT32):
            tensor = tensor.float()
        elif dtype is not None and tensor.is_floating_point() and tensor.dtype != dtype:
            tensor = tensor.to(dtype)
        yield name, tensor


def tensor_names(path: str | Path) -> list[str]:
    """Every tensor name of a safetensors checkpoint, reading no tensor."""
    return list(_Tensors(safetensors_files(path)).names())


def packed_candidates(path: str | Path) -> dict[str, str]:
    """`<module>.weight` -> "int4" | "fp8" of the weights a safetensors checkpoint can keep
    packed (e4m3 only among the fp8 ones), reading no tensor."""
    tensors = _Tensors(safetensors_files(path))
    return {
        n: k
        for n, k in quantized_weights(tensors).items()
        if k == "int4" or tensors.dtypes[n] == "F8_E4M3"
    }


def infer_config(path: str | Path, method: str) -> HfQuantConfig:
    return infer_quant_config(_Tensors(safetensors_files(path)), method)

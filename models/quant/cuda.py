"""Packed linears on CUDA. GGUF: Q4_0, Q4_1 and Q4_K weights re-laid once into 16-row tiles for
ext/cuda's tensor-core GEMV (`gguf_tile_linear`); other types through the row-layout GEMV
(`gguf_linear`). Both dequantize to a scratch buffer + cuBLAS above 16 rows. A gated MLP's
tiled gate_up pairs its rows and applies silu(gate) * up in the same GEMV (`QuantSwigluMLP`).
GPTQ/AWQ int4 and FP8 through hf_linear's ops (register-dequantizing GEMV at decode sizes,
dequantize-to-scratch + cuBLAS above). `use_cuda_quant_kernels(model)` attaches them to every
CUDA `QuantLinear` of a fp16/bf16 model."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem.ext.cuda import gguf_linear, gguf_tile, hf_linear  # noqa: F401  (register the torch.ops)
from tandem.models.layers.mlp import GatedMLP
from tandem.models.layers.parallel import row_parallel
from tandem.models.quant.fp8 import Fp8Tensor
from tandem.models.quant.int4 import Int4Tensor
from tandem.models.quant.linear import PackedWeight, QuantLinear, quant_modules
from tandem.models.quant.tensor import QuantizedTensor


class QuantSwigluMLP(GatedMLP):
    """GatedMLP whose packed gate_up weight has its rows paired (8 gate rows, then the same 8
    up rows, per tile), so that one GEMV also applies silu(gate) * up
    (`torch.ops.tandem.gguf_tile_swiglu`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, hidden] fp16/bf16 on CUDA
        seg = self.gate_up_proj.segments[0]
        if x.dtype not in (torch.float16, torch.bfloat16):
            gate, up = F.linear(x, seg.dequantize(x.dtype)).chunk(2, dim=-1)
            act = F.silu(gate) * up
        else:
            act = torch.ops.tandem.gguf_tile_swiglu(x, seg.data, seg.type_id, seg.cols)
        return row_parallel(self.down_proj, act, self.tp, self.reduce)


def pair_gate_up(mlp: nn.Module) -> bool:
    """Swap a CUDA GatedMLP whose gate_up is one tiled packed segment (no bias) for
    `QuantSwigluMLP`; returns whether it did."""
    lin = getattr(mlp, "gate_up_proj", None)
    if type(mlp) is not GatedMLP or not isinstance(lin, QuantLinear) or lin.bias is not None:
        return False
    if len(lin.segments) != 1 or not isinstance(lin.segments[0], QuantizedTensor):
        return False
    if lin.segments[0].layout != "tile16":
        return False
    lin.segments[0] = lin.segments[0].as_tiles(pairs=True)
    mlp.__class__ = QuantSwigluMLP
    return True


def _hf_linear(x: torch.Tensor, seg: Int4Tensor | Fp8Tensor) -> torch.Tensor | None:
    """GPTQ/AWQ int4 and FP8 e4m3 through hf_linear's ops; None where they do not serve."""
    if isinstance(seg, Int4Tensor) and seg.scales.dtype in (torch.float16, torch.bfloat16):
        xs = x if seg.perm is None else x.index_select(1, seg.perm)
        return torch.ops.tandem.int4_linear(xs, seg.codes, seg.scales, seg.zeros, seg.group)
    if (
        isinstance(seg, Fp8Tensor)
        and seg.data.dtype == torch.float8_e4m3fn
        and seg.block[1] % 32 == 0
    ):
        br, bc = seg.block
        return torch.ops.tandem.fp8_linear(x, seg.data, seg.scale, br, bc)
    return None


class CudaQuantKernel:
    def __call__(self, x: torch.Tensor, seg: PackedWeight) -> torch.Tensor:
        if x.dtype not in (torch.float16, torch.bfloat16):
            return torch.nn.functional.linear(x, seg.dequantize(x.dtype))
        if not isinstance(seg, QuantizedTensor):
            y = _hf_linear(x, seg)
            return y if y is not None else torch.nn.functional.linear(x, seg.dequantize(x.dtype))
        if seg.layout == "tile16":
            return torch.ops.tandem.gguf_tile_linear(x, seg.data, seg.type_id, seg.cols)
        if seg.layout != "rows":  # paired tiles: only QuantSwigluMLP reads them in order
            return torch.nn.functional.linear(x, seg.dequantize(x.dtype))
        if seg.type_id not in gguf_linear.QTYPES:
            return torch.nn.functional.linear(x, seg.dequantize(x.dtype))
        return torch.ops.tandem.gguf_linear(x, seg.data, seg.type_id, seg.cols)


def tile_segments(mod: QuantLinear) -> int:
    """Re-lay the module's tile-able GGUF segments (one at a time, so the extra memory is one
    segment's); a tied head keeps the embedding's rows. Returns how many were re-laid."""
    if mod._tied:
        return 0
    done = 0
    for i, seg in enumerate(mod.segments):
        if not isinstance(seg, QuantizedTensor):
            continue
        if seg.layout == "rows" and gguf_tile.supports(seg.type_id, seg.rows, seg.cols):
            mod.segments[i] = seg.as_tiles()
            done += 1
    return done


def use_cuda_quant_kernels(model: nn.Module) -> int:
    """Attach the kernel to the model's CUDA `QuantLinear`s, re-laying 4-bit weights into
    tiles (and a gated MLP's gate_up into row pairs); returns how many modules."""
    mods = [
        m for m in quant_modules(model) if isinstance(m, QuantLinear) and m.device.type == "cuda"
    ]
    kernel = CudaQuantKernel()
    for m in mods:
        tile_segments(m)
        m.kernel = kernel
    for mlp in list(model.modules()):
        pair_gate_up(mlp)
    if mods:
        torch.cuda.empty_cache()  # the row-layout copies: give them back before KV sizing
    return len(mods)

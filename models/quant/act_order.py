"""GPTQ act-order folded out of the down projections. A down_proj stored in act-order column
order (`Int4Tensor.perm`) must be given h[:, perm]; since h = silu(gate) * up is elementwise in
the intermediate channel, permuting the rows of gate_up the same way produces exactly that h,
so the per-call gather goes away. qkv, o and gate_up keep theirs (their inputs cannot be
reordered)."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from tandem.models.quant.fp8 import Fp8Tensor
from tandem.models.quant.int4 import Int4Tensor
from tandem.models.quant.linear import PackedWeight, QuantLinear
from tandem.models.quant.tensor import QuantizedTensor


def _take_rows(seg: PackedWeight, local: torch.Tensor) -> PackedWeight | None:
    if isinstance(seg, Int4Tensor):
        return dataclasses.replace(
            seg, codes=seg.codes[local], scales=seg.scales[local], zeros=seg.zeros[local]
        )
    if isinstance(seg, Fp8Tensor) and seg.block[0] == 1:
        return Fp8Tensor(seg.data[local], seg.scale[local], seg.block)
    if isinstance(seg, QuantizedTensor):
        return seg.take_rows(local)
    return None  # FP8 row blocks: a permutation would split them


def _permute_rows(linear: nn.Module, rows: torch.Tensor) -> bool:
    """Reorder the output rows of `linear` (and its bias) in place; False when it cannot."""
    if isinstance(linear, QuantLinear):
        new, start = [], 0
        for seg in linear.segments:
            local = rows[start : start + seg.rows] - start
            if int(local.min()) < 0 or int(local.max()) >= seg.rows:
                return False
            taken = _take_rows(seg, local.to(seg.data.device))
            if taken is None:
                return False
            new.append(taken)
            start += seg.rows
        linear.segments = new
    elif type(linear) is nn.Linear:
        linear.weight.data = linear.weight.data[rows.to(linear.weight.device)]
    else:
        return False
    if linear.bias is not None:
        linear.bias.data = linear.bias.data[rows.to(linear.bias.device)]
    return True


def fold_down_perms(model: nn.Module) -> int:
    """Fold every foldable down_proj act-order gather into its gate_up rows; returns how many."""
    folded = 0
    for mlp in model.modules():
        gate_up, down = getattr(mlp, "gate_up_proj", None), getattr(mlp, "down_proj", None)
        if not isinstance(down, QuantLinear) or len(down.segments) != 1:
            continue
        seg = down.segments[0]
        if not isinstance(seg, Int4Tensor) or seg.perm is None or gate_up is None:
            continue
        inter = down.in_features
        if getattr(gate_up, "out_features", None) != 2 * inter:
            continue
        perm = seg.perm.long().cpu()
        if _permute_rows(gate_up, torch.cat([perm, perm + inter])):
            down.segments = [dataclasses.replace(seg, perm=None)]
            folded += 1
    return folded

"""The cpu_pool backend's GPU-resident experts: which of a layer's experts also live on the GPU
(copied from the pool's own weights), the routed-token count that triggers one rebalance, and
re-placing each layer's most-routed experts. The pool keeps every expert; a GPU-placed one just
gets id -1 in the pool's calls."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tandem.models.layers.experts import ExpertBias

if TYPE_CHECKING:
    from tandem.ext.cpu import CpuExpertPool
    from tandem.models.layers.cpu_pool_stats import HybridMoeStats


@dataclass
class _Placement:
    """One layer's GPU-resident experts."""

    expert_ids: torch.Tensor  # [G] int64, device
    local: torch.Tensor  # [E] int64, device: index into w13/w2 below, -1 = CPU
    w13: torch.Tensor  # [G, 2I, H] model dtype, device
    w2: torch.Tensor  # [G, H, I]
    bias: ExpertBias | None = None  # the G experts' biases (GPT-OSS), device


class GpuPlacement:
    """Mixin of CpuPoolExpertBackend (cpu_experts.py): its `_placements`, `_counts`,
    `_num_experts`, `_stats`, `_staging`, `pool` and rebalance settings."""

    pool: CpuExpertPool
    _placements: dict[int, _Placement]
    _counts: dict[int, torch.Tensor]
    _num_experts: dict[int, int]
    _biases: dict[int, ExpertBias]
    _stats: HybridMoeStats
    _staging: list
    _routed_tokens: int
    _rebalanced: bool
    rebalance_after_tokens: int

    def _place(
        self,
        layer: int,
        expert_ids: torch.Tensor,  # [G] int64, CPU
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        """Puts `expert_ids` of the layer on `device`, from the pool's weights (what the pool
        computes with): the same whether the layer was converted or mapped from the cache."""
        E = self._num_experts[layer]
        local = torch.full((E,), -1, dtype=torch.int64)
        local[expert_ids] = torch.arange(len(expert_ids))
        p13, p2 = self.pool.dequantize(layer, expert_ids.tolist())  # [G, ...] fp32
        g13 = p13.to(device=device, dtype=dtype)
        g2 = p2.to(device=device, dtype=dtype)
        del p13, p2
        if device.type == "cuda":
            self._stats.h2d_bytes += (
                g13.numel() * g13.element_size() + g2.numel() * g2.element_size()
            )
        bias = self._biases.get(layer)
        if bias is not None:  # the placed experts' rows of the layer's biases
            at = expert_ids.to(bias.b13.device)
            bias = ExpertBias(bias.b13[at], bias.b2[at], bias.activation)
        old = self._placements.get(layer)
        if old is not None and old.w13.shape == g13.shape and old.w2.shape == g2.shape:
            # in place: captured CUDA graphs read these tensors by address
            old.expert_ids.copy_(expert_ids)
            old.local.copy_(local)
            old.w13.copy_(g13)
            old.w2.copy_(g2)
            if old.bias is not None and bias is not None:
                old.bias.b13.copy_(bias.b13)
                old.bias.b2.copy_(bias.b2)
            return
        self._placements[layer] = _Placement(expert_ids.to(device), local.to(device), g13, g2, bias)

    @torch.no_grad()
    def rebalance(self, counts: dict[int, torch.Tensor] | None = None) -> None:
        """Keeps each layer's most-routed experts (by `counts`, default the counts gathered so
        far) on the GPU; the pool keeps every expert, GPU-placed ones just get id -1."""
        counts = counts or self._counts
        if self._staging:  # host functions of queued layers may still use the pool
            torch.cuda.synchronize(self._staging[-1].rows_d.device)
        for layer, place in list(self._placements.items()):
            G = len(place.expert_ids)
            hottest = torch.topk(counts[layer].cpu().float(), G).indices.sort().values
            if torch.equal(hottest, place.expert_ids.cpu()):
                continue
            self._place(layer, hottest, place.w13.dtype, place.w13.device)

    def _note_routed(self, layer_idx: int, tokens: int) -> None:
        """Counts routed tokens (on the first MoE layer) and rebalances once when due."""
        if layer_idx == min(self._counts):
            self._routed_tokens += tokens
            if (
                self._placements
                and not self._rebalanced
                and self.rebalance_after_tokens
                and self._routed_tokens >= self.rebalance_after_tokens
            ):
                self._rebalanced = True
                self.rebalance()

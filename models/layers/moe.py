"""Sparse MoE block: router -> softmax -> top-k -> (renormalize) -> expert backend, plus
Qwen2-MoE's shared expert scaled by sigmoid(shared_expert_gate(x)) (none at
shared_expert_intermediate_size 0: it would add zeros; models/weights.py drops its tensors);
and DeepSeek's block (group-limited routing, ungated shared experts). Under tensor parallelism
each rank holds whole experts (expert parallel) and a slice of the shared experts' rows.

The block owns the routing and the stacked expert weights (w13 `[E, 2 * I, H]` gate rows then
up rows, w2 `[E, H, I]`); the expert computation itself belongs to the `ExpertBackend`.
"""

from __future__ import annotations

import torch
from torch import nn

from tandem.models.config import ModelConfig, UnsupportedModelError
from tandem.models.layers.experts import ExpertBackend
from tandem.models.layers.mlp import GatedMLP, check_activation
from tandem.models.layers.moe_routing import deepseek_route
from tandem.models.layers.parallel import even_split, get_tp


class SparseMoeBlock(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, backend: ExpertBackend) -> None:
        super().__init__()
        check_activation(config.hidden_act)
        # Refused here, before any weight is read, rather than failing in the first forward
        # (torch.topk past E) or computing zeros (top-0, experts of no rows).
        if not 1 <= config.num_experts_per_tok <= config.num_experts:
            raise UnsupportedModelError(
                f"num_experts_per_tok must be between 1 and num_experts ({config.num_experts}), "
                f"got {config.num_experts_per_tok}"
            )
        if config.moe_intermediate_size < 1:
            raise UnsupportedModelError(
                f"the experts' intermediate size must be positive, got "
                f"{config.moe_intermediate_size}"
            )
        self.layer_idx = layer_idx
        self.backend = backend
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_tok
        # Mixtral renormalizes the top-k probabilities unconditionally.
        self.renormalize = config.norm_topk_prob or config.architecture == "MixtralForCausalLM"
        hidden, inter = config.hidden_size, config.moe_intermediate_size
        self.gate = nn.Linear(hidden, self.num_experts, bias=False)  # router
        # expert parallel: this rank's whole experts [expert_start, + num_local_experts)
        self.tp = get_tp()
        self.expert_start, self.num_local_experts = even_split(
            self.num_experts, self.tp, "num_experts"
        )
        self.w13 = nn.Parameter(torch.empty(self.num_local_experts, 2 * inter, hidden))
        self.w2 = nn.Parameter(torch.empty(self.num_local_experts, hidden, inter))
        self.shared_expert: GatedMLP | None = None
        self.shared_expert_gate: nn.Linear | None = None
        if config.shared_expert_intermediate_size > 0:
            self.shared_expert = GatedMLP(
                hidden, config.shared_expert_intermediate_size, reduce=self.tp.size == 1
            )
            self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x `[T, H]` -> topk_ids `[T, k]` int64, topk_weights `[T, k]` float32."""
        return self._route_logits(self.gate(x))

    def _route_logits(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = torch.softmax(logits.float(), dim=-1)  # [T, E] float32
        topk_weights, topk_ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
        return topk_ids, topk_weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, H]
        if self.tp.size > 1:
            return self._forward_expert_parallel(x)
        logits = self.gate(x)  # [T, E]
        direct = getattr(self.backend, "forward_logits", None)
        if direct is not None:  # router and experts in the backend's kernels, where it can
            out = direct(self.layer_idx, x, logits, self.top_k, self.renormalize, self.w13, self.w2)
            if out is not None:
                shared = self._shared_expert(x)
                return out if shared is None else out + shared
        pending = None
        fused = getattr(self.backend, "route_and_start", None)
        if fused is not None:  # router + staging in one kernel where the backend can
            pending = fused(self.layer_idx, x, logits, self.top_k, self.renormalize)
        if pending is None:
            topk_ids, topk_weights = self._route_logits(logits)
            start = getattr(self.backend, "start", None)
            if start is None:
                out = self.backend.forward(
                    self.layer_idx, x, topk_ids, topk_weights, self.w13, self.w2
                )
                shared = self._shared_expert(x)
                return out if shared is None else out + shared
            pending = start(self.layer_idx, x, topk_ids, topk_weights)
        # an asynchronous backend (CPU pool): the shared expert runs meanwhile
        shared = self._shared_expert(x)
        out = self.backend.finish(pending)
        return out if shared is None else out + shared

    def _forward_expert_parallel(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank routes every token; each computes its own experts' share (ids of other
        ranks' experts become `num_local_experts`, which the backend skips) and the shared
        expert's slice, and one all-reduce sums them."""
        topk_ids, topk_weights = self.route(x)
        local = topk_ids - self.expert_start
        own = (local >= 0) & (local < self.num_local_experts)
        local = torch.where(own, local, self.num_local_experts)
        out = self.backend.forward(self.layer_idx, x, local, topk_weights, self.w13, self.w2)
        shared = self._shared_expert(x)
        if shared is not None:
            out = out + shared
        return self.tp.all_reduce(out)

    def _shared_expert(self, x: torch.Tensor) -> torch.Tensor | None:
        if self.shared_expert is None or self.shared_expert_gate is None:
            return None
        return torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


class DeepseekMoeBlock(SparseMoeBlock):
    """DeepSeek-V2/V3 MoE: the router of models/layers/moe_routing.py (float32 logits, as
    transformers keeps the gate in float32), the routed experts through the expert backend and
    an ungated shared expert of moe_intermediate_size * n_shared_experts. The block's own fused
    router paths (softmax only) are not used; `e_score_correction_bias` (V3) stays float32
    whatever the model dtype."""

    def __init__(self, config: ModelConfig, layer_idx: int, backend: ExpertBackend) -> None:
        super().__init__(config, layer_idx, backend)
        self.scoring_func = config.scoring_func
        self.topk_method = config.topk_method
        self.n_group, self.topk_group = config.n_group, config.topk_group
        self.routed_scaling_factor = config.routed_scaling_factor
        self.renormalize = config.norm_topk_prob
        self.e_score_correction_bias: nn.Parameter | None = None
        if config.scoring_func == "sigmoid":
            self.e_score_correction_bias = nn.Parameter(
                torch.zeros(self.num_experts, dtype=torch.float32), requires_grad=False
            )
        self.shared_experts: GatedMLP | None = None
        if config.n_shared_experts > 0:
            self.shared_experts = GatedMLP(
                config.hidden_size,
                config.moe_intermediate_size * config.n_shared_experts,
                config.hidden_act,
                config.mlp_bias,
                reduce=self.tp.size == 1,  # tensor parallel: summed with the routed experts
            )

    def _apply(self, fn, recurse=True):  # type: ignore[override]
        super()._apply(fn, recurse)
        bias = self.e_score_correction_bias
        if bias is not None and bias.dtype != torch.float32:
            self.e_score_correction_bias = nn.Parameter(bias.float(), requires_grad=False)
        return self

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = torch.nn.functional.linear(x.float(), self.gate.weight.float())  # [T, E]
        return self._route_logits(logits)

    def _route_logits(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return deepseek_route(
            logits,
            self.top_k,
            scoring_func=self.scoring_func,
            topk_method=self.topk_method,
            n_group=self.n_group,
            topk_group=self.topk_group,
            correction_bias=self.e_score_correction_bias,
            renormalize=self.renormalize,
            scaling_factor=self.routed_scaling_factor,
        )

    def _shared_expert(self, x: torch.Tensor) -> torch.Tensor | None:
        return None if self.shared_experts is None else self.shared_experts(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, H]
        if self.tp.size > 1:
            return self._forward_expert_parallel(x)
        topk_ids, topk_weights = self.route(x)
        start = getattr(self.backend, "start", None)
        if start is None:
            out = self.backend.forward(self.layer_idx, x, topk_ids, topk_weights, self.w13, self.w2)
            return out if self.shared_experts is None else out + self.shared_experts(x)
        pending = start(self.layer_idx, x, topk_ids, topk_weights)
        shared = self.shared_experts(x) if self.shared_experts is not None else None
        out = self.backend.finish(
            pending
        )  # an asynchronous backend: the shared expert ran meanwhile
        return out if shared is None else out + shared

"""Group-limited top-k expert routing (DeepSeek-V2/V3; reusable by other families that route
the same way, e.g. GLM-4.5's sigmoid + correction bias).

Pure functions of the router logits: no weights, no expert computation. Every tensor is float32.
"""

from __future__ import annotations

import torch


def grouped_topk(
    choice: torch.Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    group_score: str = "max",
    masked_value: float = float("-inf"),
) -> torch.Tensor:
    """The top-k experts by `choice` `[T, E]`, among the `topk_group` best of `n_group` equal,
    contiguous expert groups -> ids `[T, top_k]` int64 (in no particular order).

    A group's score is its best expert's ("max", DeepSeek-V2) or the sum of its two best
    ("top2_sum", DeepSeek-V3). Experts of the other groups are set to `masked_value` before the
    final top-k (V2 uses 0.0 on its softmax scores, V3 -inf). n_group 1 is a plain top-k."""
    num_tokens, num_experts = choice.shape
    if n_group > 1 and topk_group < n_group:
        grouped = choice.view(num_tokens, n_group, num_experts // n_group)
        if group_score == "max":
            scores = grouped.max(dim=-1).values  # [T, n_group]
        elif group_score == "top2_sum":
            scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        else:
            raise ValueError(f"unknown group score {group_score!r}")
        best = torch.topk(scores, topk_group, dim=-1, sorted=False).indices  # [T, topk_group]
        keep = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, best, True)
        keep = keep.unsqueeze(-1).expand_as(grouped).reshape(num_tokens, num_experts)
        choice = choice.masked_fill(~keep, masked_value)
    return torch.topk(choice, top_k, dim=-1, sorted=False).indices


def deepseek_route(
    logits: torch.Tensor,
    top_k: int,
    *,
    scoring_func: str,
    topk_method: str,
    n_group: int,
    topk_group: int,
    correction_bias: torch.Tensor | None,
    renormalize: bool,
    scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits `[T, E]` -> topk_ids `[T, k]` int64, topk_weights `[T, k]` float32, as
    transformers' DeepseekV2/V3 routers compute them.

    "softmax" (V2): weights are the softmax probabilities of the chosen experts; topk_method
    "greedy" or "group_limited_greedy" (groups by their best expert). "sigmoid" (V3,
    "noaux_tc"): experts are chosen by sigmoid + `correction_bias` (groups by their top-2 sum),
    weighted by the sigmoid alone. Then optionally renormalized, then times `scaling_factor`."""
    logits = logits.float()
    if scoring_func == "softmax":
        scores = torch.softmax(logits, dim=-1)
        if topk_method == "group_limited_greedy":
            ids = grouped_topk(scores, top_k, n_group, topk_group, "max", 0.0)
        else:
            ids = torch.topk(scores, top_k, dim=-1, sorted=False).indices
    elif scoring_func == "sigmoid":
        scores = torch.sigmoid(logits)
        choice = scores if correction_bias is None else scores + correction_bias.float()
        ids = grouped_topk(choice, top_k, n_group, topk_group, "top2_sum", float("-inf"))
    else:
        raise ValueError(f"unknown scoring function {scoring_func!r}")
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return ids, weights * scaling_factor

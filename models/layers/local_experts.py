"""The GPU-resident experts' share of a MoE layer whose other experts are on the CPU pool: the
gpu backend's kernels where they apply, else a dense path without a host sync (decode graphs)
or a grouped one with one sync."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from tandem.models.layers.experts import ExpertBias

# Where the gpu backend's kernels do not apply (fp32, no CuPy), up to this many tokens the
# GPU-resident experts run densely (every local expert on every token, weighted by the routing,
# zero where not routed): no host sync, so decode steps with experts split between GPU and CPU
# can be captured in CUDA graphs. G experts x T tokens of
# work: for G = 16 and T = 256 about 40 GFLOP, ~0.1 ms on an H100.
DENSE_GPU_EXPERT_TOKENS = 256


def _local_experts(hidden, local_ids, weights, w13, w2, bias=None) -> torch.Tensor:
    """The GPU-resident experts' share of the MoE output, [T, H] float32, without a host sync
    where the gpu backend's paths take it (fp16/bf16 on CUDA): its routed kernels up to
    GEMV_MAX_TOKENS tokens (slots routed elsewhere skipped: only the hit experts are read), its
    grouped GEMMs above (those slots computed by expert 0 with weight 0). Otherwise dense for
    small T (every local expert on every token; no host sync either), grouped by expert with one
    sync above `DENSE_GPU_EXPERT_TOKENS`. `bias` (ExpertBias of these G experts, GPT-OSS): the
    routed kernels are skipped (they have no biases), the other paths add them."""
    from tandem.models.layers import gpu_experts

    x = hidden.to(w13.dtype)
    kernels = os.environ.get("TANDEM_GPU_EXPERTS_DENSE") != "1"  # 1: the earlier paths (A/B)
    take = bias is None and kernels and gpu_experts.routed_kernels_take(x, w13, w2)
    if take and x.shape[0] <= gpu_experts.GEMV_MAX_TOKENS:
        out = torch.ops.tandem.moe_routed_experts(x, local_ids, weights.float(), w13, w2, True)
        return out.float()
    if kernels and x.is_cuda and gpu_experts.grouped_supported(x, w13, w2):
        here = local_ids >= 0
        return gpu_experts.grouped_experts(
            x, local_ids.clamp(min=0), weights.float() * here, w13, w2, bias
        ).float()
    if hidden.shape[0] <= DENSE_GPU_EXPERT_TOKENS:
        return _dense_experts(hidden, local_ids, weights, w13, w2, bias)
    return _grouped_experts(hidden, local_ids, weights, w13, w2, bias)


def _dense_experts(
    hidden: torch.Tensor,  # [T, H], device
    local_ids: torch.Tensor,  # [T, k] int64, -1 = not here
    weights: torch.Tensor,  # [T, k] float32
    w13: torch.Tensor,  # [G, 2I, H]
    w2: torch.Tensor,  # [G, H, I]
    bias: ExpertBias | None = None,
) -> torch.Tensor:
    """sum over slots routed to one of the G experts; [T, H] float32, without a host sync."""
    G, T = w13.shape[0], hidden.shape[0]
    # route[t, g] = the routing weight of expert g for token t (0 where not routed)
    route = torch.zeros(T, G + 1, dtype=torch.float32, device=hidden.device)
    route.scatter_add_(1, local_ids + 1, weights.float())
    x = hidden.to(w13.dtype).unsqueeze(0).expand(G, T, hidden.shape[1])  # [G, T, H]
    gate_up = torch.bmm(x, w13.transpose(1, 2))  # [G, T, 2I]
    if bias is None:
        gate, up = gate_up.chunk(2, dim=-1)  # [G, T, I] each
        y = torch.bmm(F.silu(gate) * up, w2.transpose(1, 2))  # [G, T, H]
    else:
        gate, up = (gate_up + bias.b13[:, None, :].to(gate_up.dtype)).chunk(2, dim=-1)
        y = torch.bmm(bias.activation(gate, up), w2.transpose(1, 2))
        y = y + bias.b2[:, None, :].to(y.dtype)
    return torch.einsum("gth,tg->th", y.float(), route[:, 1:])


def _grouped_experts(
    hidden: torch.Tensor,  # [T, H], device
    local_ids: torch.Tensor,  # [T, k] int64, -1 = not here
    weights: torch.Tensor,  # [T, k] float32
    w13: torch.Tensor,  # [G, 2I, H]
    w2: torch.Tensor,  # [G, H, I]
    bias: ExpertBias | None = None,
) -> torch.Tensor:
    """sum over slots routed to one of the G experts; [T, H] float32. One host sync (counts)."""
    G, top_k = w13.shape[0], local_ids.shape[1]
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    flat = local_ids.reshape(-1) + 1  # 0 = elsewhere
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=G + 1).tolist()
    flat_w = weights.reshape(-1)
    start = counts[0]
    for g in range(G):
        n = counts[g + 1]
        if n == 0:
            continue
        slots = order[start : start + n]
        start += n
        tokens = slots // top_k
        x = hidden.index_select(0, tokens)
        if bias is None:
            gate, up = F.linear(x, w13[g]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, w2[g])
        else:
            gate, up = F.linear(x, w13[g], bias.b13[g].to(x.dtype)).chunk(2, dim=-1)
            y = F.linear(bias.activation(gate, up), w2[g], bias.b2[g].to(x.dtype))
        y = y.float() * flat_w.index_select(0, slots)[:, None]
        out.index_add_(0, tokens, y)
    return out

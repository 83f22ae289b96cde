"""Every expert on the GPU: the "gpu" expert backend, the default for MoE models on CUDA.

- Decode-sized steps (up to `gemv_max_tokens` tokens): the routed skinny kernels read each
  touched expert's weights about once a step, with no host sync, so decode steps capture into
  CUDA graphs. From the router's logits (`forward_logits`, which the MoE block calls first):
  `torch.ops.tandem.moe_decode_experts`, three kernels (route + sort, gate_up + SiLU-mul per
  expert, down summed per token); from routed ids (`forward`): `moe_routed_experts`.
  `TANDEM_MOE_DECODE_KERNELS=0` leaves the routing to torch (for A/B runs). The decode kernels
  sum each token's experts in registers, so an expert hit by several tokens has its down rows
  read once per token: they take a step only while its slots fill at most half the experts
  (`DECODE_MAX_SLOT_RATIO`, env `TANDEM_MOE_DECODE_SLOT_RATIO`; Mixtral's 8 experts top-2 from
  3 tokens, Qwen2-57B's 64 top-8 from 5), and fuller steps go through the routed kernels, which read an expert's rows once per 8
  of its slots (tools/bench_gpu_moe.py: 1.39 against 1.02 ms, Mixtral's layer at 8 tokens).
- Larger steps (prefill, big decode batches): two grouped GEMMs over the tokens sorted by
  expert (`torch._grouped_mm`), also without a host sync.
- Elsewhere (operands neither path takes, no CuPy, a torch without grouped GEMMs): the torch
  reference's per-expert loop (`TorchExpertBackend`), which syncs once a layer, so a decode
  step with it stays eager.

Experts with biases and the clamped SwiGLU (GPT-OSS, `bias=ExpertBias`) take the grouped GEMMs
with the biases added per slot at every step size (the skinny kernels have no bias), else the
torch reference.

`TANDEM_MOE_GEMV_TOKENS` overrides the step size at which grouped GEMMs take over
(tools/bench_gpu_moe.py measures both paths per token count).

Packed experts (w13 / w2 `PackedExpertWeight`s, models/quant/experts.py: GGUF types, MXFP4):
decode steps from the router's logits through `qmoe_decode_experts` (route + sort, gate_up,
down: three kernels); from routed ids, up to `packed_gemv_max_tokens` tokens,
`qmoe_routed_experts` (biases and the clamped SwiGLU in the kernels). Both read the routed
experts' packed bytes in place (ext/cuda/moe_quant.py). Above, the routed experts are
dequantized into a scratch and run through the grouped GEMMs. Elsewhere the torch reference
on the dequantized weights.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F

from tandem.ext.cuda import is_available as cuda_kernels_available
from tandem.ext.cuda import (
    moe_quant,  # registers torch.ops.tandem.qmoe_routed_experts
    skinny,  # registers torch.ops.tandem.moe_routed_experts
)
from tandem.models.layers.experts import ExpertBias, TorchExpertBackend
from tandem.models.quant.experts import PackedExpertWeight, is_packed

logger = logging.getLogger(__name__)

GEMV_MAX_TOKENS = 8  # tools/bench_gpu_moe.py on an H100: grouped GEMMs win from 16 tokens
DECODE_MAX_SLOT_RATIO = 0.5  # the decode kernels while tokens * top_k <= this * experts
PACKED_GEMV_MAX_TOKENS = 64  # packed experts: read in place up to here, else dequantize + grouped


def grouped_supported(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """Whether `grouped_experts` applies: torch has grouped GEMMs for this device and dtype,
    the weights are contiguous and the rows 16-byte multiples."""
    if not hasattr(torch, "_grouped_mm") or hidden.dim() != 2:
        return False
    if hidden.is_cuda and hidden.dtype != torch.bfloat16:  # CUDA grouped GEMMs: bf16 only
        return False
    if not (hidden.dtype == w13.dtype == w2.dtype and hidden.device == w13.device == w2.device):
        return False
    inter = w2.shape[2]
    return w13.is_contiguous() and w2.is_contiguous() and hidden.shape[1] % 8 == inter % 8 == 0


def grouped_experts(
    hidden: torch.Tensor,  # [T, H]
    topk_ids: torch.Tensor,  # [T, k] int64
    topk_weights: torch.Tensor,  # [T, k] float32
    w13: torch.Tensor,  # [E, 2I, H]
    w2: torch.Tensor,  # [E, H, I]
    bias: ExpertBias | None = None,
) -> torch.Tensor:
    """The routed experts' sum, [T, H] in hidden's dtype, by two grouped GEMMs over the
    (token, expert) slots sorted by expert; per-expert row counts stay on the device."""
    t, top_k = topk_ids.shape
    sorted_ids, order, offsets = skinny.sort_slots(topk_ids, w13.shape[0])
    ends = offsets[1:].to(torch.int32)  # [E] end row of each group
    x = hidden.index_select(0, order // top_k)  # [S, H] rows in sorted order
    h13 = torch._grouped_mm(x, w13.transpose(1, 2), offs=ends)  # [S, 2I]
    if bias is None:
        gate, up = h13.chunk(2, dim=-1)
        y = torch._grouped_mm(F.silu(gate) * up, w2.transpose(1, 2), offs=ends)  # [S, H]
    else:
        gate, up = (h13 + bias.b13.index_select(0, sorted_ids)).chunk(2, dim=-1)
        y = torch._grouped_mm(bias.activation(gate, up), w2.transpose(1, 2), offs=ends)
        y = y + bias.b2.index_select(0, sorted_ids)
    y = y.float() * topk_weights.reshape(-1).float().index_select(0, order)[:, None]
    per_slot = torch.empty_like(y).index_copy_(0, order, y)  # back to slot order
    return per_slot.view(t, top_k, -1).sum(dim=1).to(hidden.dtype)  # deterministic: no atomics


def routed_kernels_take(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """Whether `torch.ops.tandem.moe_routed_experts` runs here: CUDA and CuPy, and operands
    its kernels take."""
    return hidden.is_cuda and skinny.moe_supported(hidden, w13, w2) and cuda_kernels_available()


class GpuExpertBackend:
    """Stacked expert weights on the GPU (the MoE block's w13/w2); see the module docstring."""

    name = "gpu"
    supports_cuda_graphs = True  # no path syncs on the host inside a decode step's forward
    supports_expert_bias = True

    def __init__(
        self, gemv_max_tokens: int | None = None, packed_gemv_max_tokens: int | None = None
    ) -> None:
        if gemv_max_tokens is None:
            gemv_max_tokens = int(os.environ.get("TANDEM_MOE_GEMV_TOKENS", GEMV_MAX_TOKENS))
        if gemv_max_tokens < 0:
            raise ValueError(f"gemv_max_tokens must be >= 0, got {gemv_max_tokens}")
        self.gemv_max_tokens = gemv_max_tokens
        self.packed_gemv_max_tokens = (
            PACKED_GEMV_MAX_TOKENS if packed_gemv_max_tokens is None else packed_gemv_max_tokens
        )
        self._reference = TorchExpertBackend()
        self._kernels = cuda_kernels_available()  # CUDA and CuPy: the decode kernels can run
        self._grouped_failed = False
        self.decode_kernels = os.environ.get("TANDEM_MOE_DECODE_KERNELS", "1") != "0"
        ratio = os.environ.get("TANDEM_MOE_DECODE_SLOT_RATIO", "").strip()  # for A/B runs
        self.decode_max_slot_ratio = float(ratio) if ratio else DECODE_MAX_SLOT_RATIO
        self.calls = {"decode": 0, "gemv": 0, "grouped": 0, "torch": 0}
        self.calls.update({"qdecode": 0, "qgemv": 0, "qgrouped": 0})  # packed experts

    def forward_logits(
        self,
        layer_idx: int,
        hidden: torch.Tensor,  # [T, H]
        logits: torch.Tensor,  # [T, E] the router's output
        top_k: int,
        renormalize: bool,
        w13: torch.Tensor,
        w2: torch.Tensor,
    ) -> torch.Tensor | None:
        """A decode-sized step from the router's logits in three kernels; None where that does
        not apply (the block then routes in torch and calls `forward`)."""
        tokens = hidden.shape[0]
        if is_packed(w13):
            return self._decode_packed(hidden, logits, top_k, renormalize, w13)
        if not (self._kernels and self.decode_kernels and tokens <= self.gemv_max_tokens):
            return None
        if tokens * top_k > self.decode_max_slot_ratio * w13.shape[0]:
            return None  # experts shared by several tokens: the routed kernels read them once
        if not skinny.moe_decode_supported(hidden, logits, w13, w2, top_k):
            return None
        self.calls["decode"] += 1
        return torch.ops.tandem.moe_decode_experts(hidden, logits, w13, w2, top_k, renormalize)

    def forward(
        self,
        layer_idx: int,
        hidden: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        bias: ExpertBias | None = None,
    ) -> torch.Tensor:
        if is_packed(w13):
            return self._forward_packed(layer_idx, hidden, topk_ids, topk_weights, w13, bias)
        if bias is not None:
            return self._forward_biased(layer_idx, hidden, topk_ids, topk_weights, w13, w2, bias)
        tokens = hidden.shape[0]
        gemv = self._kernels and skinny.moe_supported(hidden, w13, w2)
        grouped = not self._grouped_failed and grouped_supported(hidden, w13, w2)
        if gemv and (tokens <= self.gemv_max_tokens or not grouped):
            self.calls["gemv"] += 1
            return torch.ops.tandem.moe_routed_experts(
                hidden, topk_ids, topk_weights.float(), w13, w2
            )
        if grouped:
            try:
                out = grouped_experts(hidden, topk_ids, topk_weights, w13, w2)
                self.calls["grouped"] += 1
                return out
            except (RuntimeError, NotImplementedError) as e:  # say so once, then the loop
                self._grouped_failed = True
                logger.warning("gpu experts: grouped GEMMs unavailable, per-expert loop: %s", e)
        self.calls["torch"] += 1
        return self._reference.forward(layer_idx, hidden, topk_ids, topk_weights, w13, w2)

    def _forward_biased(self, layer_idx, hidden, topk_ids, topk_weights, w13, w2, bias):
        if not self._grouped_failed and grouped_supported(hidden, w13, w2):
            try:
                out = grouped_experts(hidden, topk_ids, topk_weights, w13, w2, bias)
                self.calls["grouped"] += 1
                return out
            except (RuntimeError, NotImplementedError) as e:
                self._grouped_failed = True
                logger.warning("gpu experts: grouped GEMMs unavailable, per-expert loop: %s", e)
        self.calls["torch"] += 1
        return self._reference.forward(layer_idx, hidden, topk_ids, topk_weights, w13, w2, bias)

    def _decode_packed(
        self,
        hidden: torch.Tensor,  # [T, H]
        logits: torch.Tensor,  # [T, E]
        top_k: int,
        renormalize: bool,
        w13: PackedExpertWeight,
    ) -> torch.Tensor | None:
        ex = w13.owner
        if not (self._kernels and self.decode_kernels):
            return None
        ops = (ex.data13, ex.scales13, ex.data2, ex.scales2, ex.type_id)
        if not moe_quant.supported(hidden, *ops):
            return None
        if not moe_quant.decode_supported(hidden, logits, ex.num_experts, top_k):
            return None
        self.calls["qdecode"] += 1
        return torch.ops.tandem.qmoe_decode_experts(hidden, logits, *ops, top_k, renormalize)

    def _forward_packed(
        self,
        layer_idx: int,
        hidden: torch.Tensor,  # [T, H]
        topk_ids: torch.Tensor,  # [T, k] int64
        topk_weights: torch.Tensor,  # [T, k] float32
        w13: PackedExpertWeight,
        bias: ExpertBias | None,
    ) -> torch.Tensor:
        ex = w13.owner
        tid = ex.type_id
        ops = (ex.data13, ex.scales13, ex.data2, ex.scales2, tid)
        fast = self._kernels and moe_quant.supported(hidden, *ops)
        if fast and hidden.shape[0] <= self.packed_gemv_max_tokens:
            self.calls["qgemv"] += 1
            b13 = b2 = None
            alpha = limit = 0.0
            if bias is not None:
                b13 = bias.b13.to(hidden.dtype).contiguous()
                b2 = bias.b2.to(hidden.dtype).contiguous()
                alpha, limit = bias.activation.alpha, bias.activation.limit
            return torch.ops.tandem.qmoe_routed_experts(
                hidden, topk_ids, topk_weights.float(), *ops, b13, b2, alpha, limit
            )
        if fast and not self._grouped_failed and hasattr(torch, "_grouped_mm"):
            num, dtype = ex.num_experts, hidden.dtype
            _, _, offsets = skinny.sort_slots(topk_ids, num)
            d13 = moe_quant.dequantize_experts(
                ex.data13, ex.scales13, tid, ex.hidden, dtype, offsets
            )
            d2 = moe_quant.dequantize_experts(ex.data2, ex.scales2, tid, ex.inter, dtype, offsets)
            if grouped_supported(hidden, d13, d2):
                try:
                    out = grouped_experts(hidden, topk_ids, topk_weights, d13, d2, bias)
                    self.calls["qgrouped"] += 1
                    return out
                except (RuntimeError, NotImplementedError) as e:
                    self._grouped_failed = True
                    logger.warning("gpu experts: grouped GEMMs unavailable, per-expert loop: %s", e)
        self.calls["torch"] += 1
        d13, d2 = ex.dequantize(hidden.dtype)
        return self._reference.forward(layer_idx, hidden, topk_ids, topk_weights, d13, d2, bias)

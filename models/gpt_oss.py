"""GPT-OSS (`GptOssForCausalLM`): the shared decoder with attention sinks, alternating
sliding-window and full layers, YaRN rope and biases on q/k/v/o (all from `ModelConfig`), and its
own MoE block: a router with a bias, softmax over the top-k logits, experts with biases and the
clamped SwiGLU. Also owns the checkpoint's names: transformers' fused, transposed expert
tensors with gate and up interleaved, or their MXFP4 `_blocks` / `_scales` (models/mxfp4.py).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn

from tandem.models.config import ModelConfig, UnsupportedModelError
from tandem.models.decoder import DecoderForCausalLM, DecoderLayer
from tandem.models.layers.experts import ClampedSwiGLU, ExpertBackend, ExpertBias
from tandem.models.layers.moe import SparseMoeBlock
from tandem.models.mxfp4 import to_ggml_blocks
from tandem.models.quant.tensor import QuantizedTensor
from tandem.models.weights import load_hf_weights

_EXPERTS = re.compile(
    r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)(_bias|_blocks|_scales)?$"
)


class GptOssMoeBlock(SparseMoeBlock):
    """Router `gate` with a bias; top-k of its logits, softmax over those k (transformers'
    GptOssTopKRouter); experts with biases b13 `[E, 2I]`, b2 `[E, H]` and the clamped SwiGLU.
    Needs an expert backend that takes biases (`supports_expert_bias`)."""

    def __init__(self, config: ModelConfig, layer_idx: int, backend: ExpertBackend) -> None:
        if not getattr(backend, "supports_expert_bias", False):
            raise UnsupportedModelError(
                f"the {getattr(backend, 'name', backend)!r} expert backend cannot run GPT-OSS's "
                "experts: their biases and clamped SwiGLU are not in its kernels"
            )
        super().__init__(config, layer_idx, backend)
        hidden, inter = config.hidden_size, config.moe_intermediate_size
        self.gate = nn.Linear(hidden, self.num_experts, bias=True)
        self.w13_bias = nn.Parameter(torch.empty(self.num_local_experts, 2 * inter))
        self.w2_bias = nn.Parameter(torch.empty(self.num_local_experts, hidden))
        assert config.swiglu_limit is not None
        self.activation = ClampedSwiGLU(config.swiglu_alpha, config.swiglu_limit)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, H]
        logits = self.gate(x)  # [T, E]
        top_logits, topk_ids = torch.topk(logits, self.top_k, dim=-1)  # [T, k]
        topk_weights = torch.softmax(top_logits.float(), dim=-1)
        bias = ExpertBias(self.w13_bias, self.w2_bias, self.activation)
        if self.tp.size > 1:  # expert parallel: other ranks' experts are skipped, then summed
            local = topk_ids - self.expert_start
            own = (local >= 0) & (local < self.num_local_experts)
            topk_ids = torch.where(own, local, self.num_local_experts)
        out = self.backend.forward(
            self.layer_idx, x, topk_ids, topk_weights, self.w13, self.w2, bias=bias
        )
        return self.tp.all_reduce(out)


class GptOssDecoderLayer(DecoderLayer):
    moe_cls = GptOssMoeBlock


class GptOssForCausalLM(DecoderForCausalLM):
    layer_cls = GptOssDecoderLayer

    @torch.no_grad()
    def load_weights(
        self,
        weights: Iterable[tuple[str, torch.Tensor]],
        expected: Callable[[str], bool] | None = None,
    ) -> None:
        load_hf_weights(self, gpt_oss_tensors(weights), expected)


def gpt_oss_tensors(
    weights: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """GPT-OSS checkpoint names -> the per-expert scheme of models/weights.py: the router
    `mlp.router` -> `mlp.gate`; `experts.gate_up_proj` `[E, H, 2I]` (gate and up columns
    interleaved) and `experts.down_proj` `[E, I, H]` (transformers' layout) or their MXFP4
    `_blocks` / `_scales` (`[E, 2I, H / 32, 16]`, rows interleaved; `[E, H, I / 32, 16]`),
    dequantized one expert at a time; the biases `_bias` alike."""
    pending: dict[str, dict[str, torch.Tensor]] = {}  # MXFP4 halves waiting for their partner
    for name, tensor in weights:
        name = name.replace(".mlp.router.", ".mlp.gate.")
        m = _EXPERTS.match(name)
        if m is None:
            yield name, tensor
            continue
        prefix, proj, kind = m[1], m[2], m[3] or ""
        if kind in ("_blocks", "_scales"):
            halves = pending.setdefault(f"{prefix}.{proj}", {})
            halves[kind] = tensor
            if len(halves) == 2:
                del pending[f"{prefix}.{proj}"]
                yield from _mxfp4_experts(prefix, proj, halves["_blocks"], halves["_scales"])
            continue
        _check_3d(name, tensor, 2 if kind == "_bias" else 3)
        for e in range(tensor.shape[0]):
            t = tensor[e]
            if kind == "_bias":
                if proj == "down_proj":
                    yield f"{prefix}.{e}.down_proj.bias", t
                else:
                    yield f"{prefix}.{e}.gate_proj.bias", t[0::2]
                    yield f"{prefix}.{e}.up_proj.bias", t[1::2]
            elif proj == "down_proj":  # [I, H]
                yield f"{prefix}.{e}.down_proj.weight", t.t()
            else:  # [H, 2I]
                yield f"{prefix}.{e}.gate_proj.weight", t[:, 0::2].t()
                yield f"{prefix}.{e}.up_proj.weight", t[:, 1::2].t()
    if pending:
        names = ", ".join(f"{p}{next(iter(h))}" for p, h in pending.items())
        raise UnsupportedModelError(f"MXFP4 tensors without their blocks or scales: {names}")


def _mxfp4_experts(
    prefix: str, proj: str, blocks: torch.Tensor, scales: torch.Tensor
) -> Iterator[tuple[str, torch.Tensor]]:
    _check_3d(f"{prefix}.{proj}_blocks", blocks, 4)
    if blocks.shape[0] != scales.shape[0]:
        raise UnsupportedModelError(
            f"{prefix}.{proj}: blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} "
            "differ in their number of experts"
        )
    for e in range(blocks.shape[0]):
        try:  # still packed: a packed-experts layer keeps them, any other target dequantizes
            rows = to_ggml_blocks(blocks[e], scales[e])  # [rows, G * 17]
        except ValueError as exc:
            raise UnsupportedModelError(f"{prefix}.{proj}: {exc}") from exc
        cols = blocks.shape[2] * 32
        if proj == "down_proj":  # [H, I]
            yield f"{prefix}.{e}.down_proj.weight", QuantizedTensor("MXFP4", rows, cols)
        else:  # [2I, H], gate and up rows interleaved
            gate, up = rows[0::2].contiguous(), rows[1::2].contiguous()
            yield f"{prefix}.{e}.gate_proj.weight", QuantizedTensor("MXFP4", gate, cols)
            yield f"{prefix}.{e}.up_proj.weight", QuantizedTensor("MXFP4", up, cols)


def mxfp4_expert_names(tensor_names: Iterable[str], config: ModelConfig) -> dict[str, str]:
    """The per-expert weight names -> "MXFP4" of the layers whose experts a checkpoint (its
    tensor names) stores as MXFP4 `_blocks` / `_scales`."""
    kept: dict[str, str] = {}
    for name in tensor_names:
        m = _EXPERTS.match(name)
        if m is None or m[3] != "_blocks":
            continue
        projs = ("down_proj",) if m[2] == "down_proj" else ("gate_proj", "up_proj")
        for e in range(config.num_experts):
            kept.update({f"{m[1]}.{e}.{p}.weight": "MXFP4" for p in projs})
    return kept


def _check_3d(name: str, tensor: torch.Tensor, dims: int) -> None:
    if tensor.dim() != dims:
        raise UnsupportedModelError(
            f"GPT-OSS expert tensor {name} must be {dims}-D, got {tuple(tensor.shape)}"
        )

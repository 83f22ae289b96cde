"""Replace a model's dense projections, embedding and head by packed-weight layers, on the
meta device before materialization, so the dense weights are never allocated.

`quantize_modules(model, kept, device)` takes the HF names of the checkpoint tensors that stay
packed (name -> type: a ggml type, or "int4" / "fp8" for GPTQ, AWQ and FP8 safetensors) and
swaps every module whose source tensors are all among them (a "gpu"-backend MoE block's routed
experts too: models/quant/experts.py).
"""

from __future__ import annotations

import torch
from torch import nn

from tandem.models.quant.experts import swap_experts
from tandem.models.quant.linear import QuantEmbedding, QuantLinear, QuantLogits
from tandem.models.weights import canonical_name


def _swap_linear(
    parent: nn.Module,
    attr: str,
    names: list[str],
    rows: list[int],
    kept: dict[str, str],
    device: torch.device | str,
) -> list[str]:
    linear = getattr(parent, attr, None)
    if type(linear) is not nn.Linear or not all(f"{n}.weight" in kept for n in names):
        return []
    sources = [f"{n}.weight" for n in names]
    types = [kept[n] for n in sources]
    setattr(
        parent,
        attr,
        QuantLinear(linear.in_features, rows, sources, linear.bias is not None, device, types),
    )
    return sources


def quantize_modules(
    model: nn.Module, kept: dict[str, str], device: torch.device | str, dtype: torch.dtype
) -> set[str]:
    """Swap in place; returns the HF tensor names now expected packed."""
    cfg = model.config
    swapped: list[str] = []
    raw = {canonical_name(n): n for n in kept}  # Mixtral's expert names differ in checkpoints
    canon_kept = {c: kept[n] for c, n in raw.items()}
    q, kv = cfg.q_size, cfg.kv_size
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        attn = layer.self_attn
        swapped += _swap_linear(
            attn,
            "qkv_proj",
            [p + "self_attn.q_proj", p + "self_attn.k_proj", p + "self_attn.v_proj"],
            [q, kv, kv],
            kept,
            device,
        )
        swapped += _swap_linear(
            attn, "o_proj", [p + "self_attn.o_proj"], [cfg.hidden_size], kept, device
        )
        mlps = [(layer.mlp, p + "mlp.")]
        shared = getattr(layer.mlp, "shared_expert", None)
        if shared is not None:
            mlps = [(shared, p + "mlp.shared_expert.")]
        for mlp, prefix in mlps:
            if not hasattr(mlp, "gate_up_proj"):
                continue
            inter = mlp.intermediate_size
            swapped += _swap_linear(
                mlp,
                "gate_up_proj",
                [prefix + "gate_proj", prefix + "up_proj"],
                [inter, inter],
                kept,
                device,
            )
            swapped += _swap_linear(
                mlp, "down_proj", [prefix + "down_proj"], [cfg.hidden_size], kept, device
            )
        swapped += [raw[n] for n in swap_experts(layer.mlp, p + "mlp.", canon_kept)]
    embed_name = "model.embed_tokens.weight"
    embed = None
    if embed_name in kept:
        embed = QuantEmbedding(cfg.vocab_size, cfg.hidden_size, embed_name, dtype, device)
        model.embed_tokens = embed
        swapped.append(embed_name)
    head_name = embed_name if model.lm_head is None else "lm_head.weight"
    if head_name in kept and (model.lm_head is not None or embed is not None):
        if model.lm_head is None:  # tied: the head reads the embedding's packed table
            head = QuantLinear(cfg.hidden_size, [cfg.vocab_size], [], False, device, [], embed)
        else:
            head = QuantLinear(
                cfg.hidden_size, [cfg.vocab_size], [head_name], False, device, [kept[head_name]]
            )
        if model.lm_head is not None:
            model.lm_head = None  # the packed head replaces it (compute_logits below)
        model.quant_head = head
        model.compute_logits = QuantLogits(head)
        swapped.append(head_name)
    return set(swapped)

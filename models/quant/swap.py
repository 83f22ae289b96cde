"""Replace a model's dense projections, embedding and head by packed-weight layers, on the
meta device before materialization, so the dense weights are never allocated.

`quantize_modules(model, kept, device)` takes the HF names of the checkpoint tensors that stay
packed (name -> type: a ggml type, or "int4" / "fp8" for GPTQ, AWQ and FP8 safetensors) and
swaps every module whose source tensors are all among them (a "gpu"-backend MoE block's routed
experts too: models/quant/experts.py). Under tensor parallelism (`shards`: this rank's slice
of each tensor) a module is swapped only where every slice keeps whole quant blocks/groups;
the others are left dense (dequantized at load, then sliced); routed experts stay dense. The
embedding and head keep this rank's vocabulary rows packed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from tandem.models.quant.experts import swap_experts
from tandem.models.quant.hf_config import HfQuantConfig
from tandem.models.quant.linear import QuantEmbedding, QuantLinear, QuantLogits, VocabSplit
from tandem.models.quant.shard import split_error
from tandem.models.weights import canonical_name

if TYPE_CHECKING:
    from tandem.models.layers.parallel import Shard


def _swap_linear(
    parent: nn.Module,
    attr: str,
    names: list[str],
    rows: list[int],
    kept: dict[str, str],
    device: torch.device | str,
    split: _Split | None = None,
) -> list[str]:
    linear = getattr(parent, attr, None)
    if type(linear) is not nn.Linear or not all(f"{n}.weight" in kept for n in names):
        return []
    sources = [f"{n}.weight" for n in names]
    types = [kept[n] for n in sources]
    if split is not None and not split.packable(sources, types):
        return []
    setattr(
        parent,
        attr,
        QuantLinear(linear.in_features, rows, sources, linear.bias is not None, device, types),
    )
    return sources


class _Split:
    """This rank's shards and the checkpoint's quant config; records what stays dense."""

    def __init__(self, shards: dict[str, Shard], hf_quant: HfQuantConfig | None) -> None:
        self.shards = shards
        self.hf_quant = hf_quant
        self.dense: dict[str, str] = {}  # HF name -> why it is not kept packed

    def packable(self, sources: list[str], types: list[str]) -> bool:
        why = None
        for name, qtype in zip(sources, types, strict=True):
            s = self.shards.get(name)
            if s is not None:
                why = why or split_error(qtype, s.dim, s.start, s.length, s.full, self.hf_quant)
        if why is not None:
            self.dense.update(dict.fromkeys(sources, why))
        return why is None


def quantize_modules(
    model: nn.Module,
    kept: dict[str, str],
    device: torch.device | str,
    dtype: torch.dtype,
    shards: dict[str, Shard] | None = None,
    hf_quant: HfQuantConfig | None = None,
    dense: dict[str, str] | None = None,
) -> set[str]:
    """Swap in place; returns the HF tensor names now expected packed. `shards` (tensor
    parallel): this rank's slices; `dense` collects the tensors left dense for a split that
    would cut their quant blocks, with the reason."""
    cfg = model.config
    swapped: list[str] = []
    split = _Split(shards, hf_quant) if shards else None
    raw = {canonical_name(n): n for n in kept}  # Mixtral's expert names differ in checkpoints
    canon_kept = {c: kept[n] for c, n in raw.items()}
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        attn = layer.self_attn
        q, kv = getattr(attn, "q_size", cfg.q_size), getattr(attn, "kv_size", cfg.kv_size)
        swapped += _swap_linear(
            attn,
            "qkv_proj",
            [p + "self_attn.q_proj", p + "self_attn.k_proj", p + "self_attn.v_proj"],
            [q, kv, kv],
            kept,
            device,
            split,
        )
        swapped += _swap_linear(
            attn, "o_proj", [p + "self_attn.o_proj"], [cfg.hidden_size], kept, device, split
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
                split,
            )
            swapped += _swap_linear(
                mlp, "down_proj", [prefix + "down_proj"], [cfg.hidden_size], kept, device, split
            )
        if split is None:
            swapped += [raw[n] for n in swap_experts(layer.mlp, p + "mlp.", canon_kept)]
    if dense is not None and split is not None:
        dense.update(split.dense)
    embed_name = "model.embed_tokens.weight"
    rows, vocab = cfg.vocab_size, None
    if split is not None:  # this rank's vocab rows (an output-row split: no block is cut)
        emb = model.embed_tokens
        rows = emb.num_rows
        vocab = VocabSplit(cfg.vocab_size, emb.start, emb.weight.shape[0], model.tp)
    embed = None
    if embed_name in kept:
        embed = QuantEmbedding(rows, cfg.hidden_size, embed_name, dtype, device, vocab)
        model.embed_tokens = embed
        swapped.append(embed_name)
    head_name = embed_name if model.lm_head is None else "lm_head.weight"
    if head_name in kept and (model.lm_head is not None or embed is not None):
        if model.lm_head is None:  # tied: the head reads the embedding's packed table
            head = QuantLinear(cfg.hidden_size, [rows], [], False, device, [], embed)
        else:
            head = QuantLinear(
                cfg.hidden_size, [rows], [head_name], False, device, [kept[head_name]]
            )
        if model.lm_head is not None:
            model.lm_head = None  # the packed head replaces it (compute_logits below)
        model.quant_head = head
        model.compute_logits = QuantLogits(head, vocab)
        swapped.append(head_name)
    return set(swapped)

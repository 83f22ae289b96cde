"""The one decoder-only transformer every supported family shares (Llama, Mistral, Qwen2,
Qwen3, Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE). Differences come from `ModelConfig` flags:
biases, q/k norm (per head or whole row), clip_qkv, rope scaling, tied embeddings, and
`config.is_moe_layer(i)` choosing MLP or MoE per layer.

The model sees one flattened batch (ARCHITECTURE.md, "The model forward contract"); it knows
nothing about requests. Checkpoint-name mapping lives in models/weights.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from tandem.models.attention_backend import AttentionBackend
from tandem.models.batch import ForwardBatch
from tandem.models.config import ModelConfig
from tandem.models.layers.attention import Attention
from tandem.models.layers.experts import ExpertBackend, TorchExpertBackend
from tandem.models.layers.mlp import GatedMLP
from tandem.models.layers.moe import SparseMoeBlock
from tandem.models.layers.norm import RMSNorm
from tandem.models.layers.parallel import VocabParallelEmbedding, get_tp
from tandem.models.layers.rotary import RotaryEmbedding
from tandem.models.weights import load_hf_weights


def _embedding(num_embeddings: int, dim: int) -> nn.Embedding:
    """nn.Embedding without its random init on the meta device: meta `normal_` runs torch's
    Python reference, whose first use imports torch._dynamo and sympy (about 65 MB resident
    for the process's life). Loaders write every weight anyway."""
    weight = torch.empty(num_embeddings, dim)
    if weight.device.type != "meta":
        nn.init.normal_(weight)
    return nn.Embedding(num_embeddings, dim, _weight=weight)


class DecoderLayer(nn.Module):
    # a family with another attention (DeepSeek's MLA) or MoE block (DeepSeek, GLM) sets its own
    attn_cls: type[nn.Module] = Attention
    moe_cls: type[nn.Module] = SparseMoeBlock

    def __init__(
        self,
        config: ModelConfig,
        layer_idx: int,
        attn_backend: AttentionBackend,
        expert_backend: ExpertBackend | None,
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = self.attn_cls(config, layer_idx, attn_backend)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp: nn.Module
        if config.is_moe_layer(layer_idx):
            assert expert_backend is not None
            self.mlp = self.moe_cls(config, layer_idx, expert_backend)
        else:
            self.mlp = GatedMLP(
                config.hidden_size, config.intermediate_size, config.hidden_act, config.mlp_bias
            )

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        # x: [T, hidden]
        x, delta = self.forward_residual(x, None, cos, sin, batch)
        return x + delta

    def forward_residual(
        self,
        x: torch.Tensor,
        delta: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: ForwardBatch,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer on the residual stream x + delta (delta: the previous layer's MLP output,
        not yet added, or None) -> (stream, this MLP's output): each add is folded into the
        norm after it (one kernel on CUDA), with the values of `forward`'s adds."""
        x, h = self.input_layernorm.add_norm(x, delta)  # [T, hidden] each
        x, h = self.post_attention_layernorm.add_norm(x, self.self_attn(h, cos, sin, batch))
        return x, self.mlp(h)


class DecoderForCausalLM(nn.Module):
    """Base of every model class in models/registry.py; a family with another layer (DeepSeek's
    MLA) sets `layer_cls`."""

    layer_cls: type[nn.Module] = DecoderLayer

    def __init__(
        self,
        config: ModelConfig,
        attn_backend: AttentionBackend,
        expert_backend: ExpertBackend | None = None,
    ) -> None:
        super().__init__()
        if config.is_moe and expert_backend is None:
            expert_backend = TorchExpertBackend()
        self.config = config
        self.attn_backend = attn_backend
        self.expert_backend = expert_backend
        self.tp = tp = get_tp()
        self.embed_tokens: nn.Module
        if tp.size > 1:  # vocab-parallel embedding and lm_head: this rank's vocab rows
            self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        else:
            self.embed_tokens = _embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            self.layer_cls(config, i, attn_backend, expert_backend)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head: nn.Linear | None = None
        if not config.tie_word_embeddings:
            rows = self.embed_tokens.weight.shape[0]
            self.lm_head = nn.Linear(config.hidden_size, rows, bias=False)
        self.rotary = RotaryEmbedding(
            config.rotary_dim,
            config.rope_theta,
            config.rope_scaling,
            config.max_position_embeddings,
        )

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        """input_ids, positions `[T]` int64 -> final-normed hidden `[len(logits_indices), hidden]`.

        Calls `attn_backend.prepare(batch)` unless the runner already filled `attn_metadata`.
        """
        if batch.attn_metadata is None:
            self.attn_backend.prepare(batch)
        x = self.embed_tokens(input_ids)  # [T, hidden]
        cos, sin = self.rotary.cos_sin(positions, x.dtype)  # [T, 1, rotary_dim] each
        delta = None
        for layer in self.layers:
            x, delta = layer.forward_residual(x, delta, cos, sin, batch)
        # RMSNorm is row-wise, so selecting rows first only saves work.
        rows = batch.logits_indices
        if delta is None:
            return self.norm(x.index_select(0, rows))
        return self.norm.add_norm(x.index_select(0, rows), delta.index_select(0, rows))[1]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden `[N, hidden]` -> logits `[N, vocab]` float32 (under tensor parallelism
        gathered on rank 0; None on the other ranks)."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = torch.nn.functional.linear(hidden, weight).float()
        if not self.tp.live:
            return logits
        return self.tp.gather_columns(logits, self.config.vocab_size)

    @torch.no_grad()
    def load_weights(
        self,
        weights: Iterable[tuple[str, torch.Tensor]],
        expected: Callable[[str], bool] | None = None,
    ) -> None:
        """Fill parameters from HF-named tensors; raises UnsupportedModelError naming any
        unexpected, mis-shaped or missing tensor. `expected(name)` (HF's per-expert names,
        `mlp.experts.{e}.gate_proj`) narrows what must arrive, e.g. to leave out the experts
        of layers whose expert backend takes them from elsewhere (models/loader)."""
        load_hf_weights(self, weights, expected)

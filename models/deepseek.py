"""DeepSeek-V2 / V3 (and Kimi-K2, a V3 config): multi-head latent attention over a latent paged
KV cache (models/layers/mla.py), the first `first_k_dense_replace` layers dense, the rest
DeepSeek MoE (models/layers/moe.py `DeepseekMoeBlock`). Everything else (embedding, final
norm, logits, rope over the rope dims) is `DecoderForCausalLM`'s.
"""

from __future__ import annotations

import torch
from torch import nn

from tandem.models.attention_backend import AttentionBackend
from tandem.models.batch import ForwardBatch
from tandem.models.config import ModelConfig
from tandem.models.decoder import DecoderForCausalLM
from tandem.models.layers.experts import ExpertBackend
from tandem.models.layers.mla import MLAttention
from tandem.models.layers.mlp import GatedMLP
from tandem.models.layers.moe import DeepseekMoeBlock
from tandem.models.layers.norm import RMSNorm


class DeepseekDecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer_idx: int,
        attn_backend: AttentionBackend,
        expert_backend: ExpertBackend | None,
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = MLAttention(config, layer_idx, attn_backend)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp: nn.Module
        if config.is_moe_layer(layer_idx):
            assert expert_backend is not None
            self.mlp = DeepseekMoeBlock(config, layer_idx, expert_backend)
        else:
            self.mlp = GatedMLP(
                config.hidden_size, config.intermediate_size, config.hidden_act, config.mlp_bias
            )

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        # x: [T, hidden]
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, batch)
        return x + self.mlp(self.post_attention_layernorm(x))


class DeepseekV2ForCausalLM(DecoderForCausalLM):
    layer_cls = DeepseekDecoderLayer


class DeepseekV3ForCausalLM(DecoderForCausalLM):
    layer_cls = DeepseekDecoderLayer

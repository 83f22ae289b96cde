"""DeepSeek-V2 / V3 (and Kimi-K2, a V3 config): multi-head latent attention over a latent paged
KV cache (models/layers/mla.py), the first `first_k_dense_replace` layers dense, the rest
DeepSeek MoE (models/layers/moe.py `DeepseekMoeBlock`). Everything else (embedding, final
norm, logits, rope over the rope dims) is `DecoderForCausalLM`'s.
"""

from __future__ import annotations

from tandem.models.decoder import DecoderForCausalLM, DecoderLayer
from tandem.models.layers.mla import MLAttention
from tandem.models.layers.moe import DeepseekMoeBlock


class DeepseekDecoderLayer(DecoderLayer):
    attn_cls = MLAttention
    moe_cls = DeepseekMoeBlock


class DeepseekV2ForCausalLM(DecoderForCausalLM):
    layer_cls = DeepseekDecoderLayer


class DeepseekV3ForCausalLM(DecoderForCausalLM):
    layer_cls = DeepseekDecoderLayer

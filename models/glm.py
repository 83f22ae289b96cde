"""GLM-4.5 / 4.5-Air / 4.6 (`Glm4MoeForCausalLM`): the shared decoder layer (grouped-query
attention with q/k/v biases, optional per-head q/k norms, rotary on the first half of each head:
`config.partial_rotary_factor`) with DeepSeek-V3's MoE block (sigmoid + correction-bias routing in
groups, shared experts; models/layers/moe.py `DeepseekMoeBlock`); the first
`first_k_dense_replace` layers dense. The checkpoint's multi-token-prediction layer is not read.
"""

from __future__ import annotations

from tandem.models.decoder import DecoderForCausalLM, DecoderLayer
from tandem.models.layers.moe import DeepseekMoeBlock


class Glm4MoeDecoderLayer(DecoderLayer):
    moe_cls = DeepseekMoeBlock


class Glm4MoeForCausalLM(DecoderForCausalLM):
    layer_cls = Glm4MoeDecoderLayer

"""Mixture-of-experts families: Qwen3-MoE, Qwen2-MoE (shared expert), Mixtral, OLMoE (q/k norms
over the whole projected q and k, optional clip_qkv, top-k weights not renormalized by default).

All share `DecoderForCausalLM`; `config.is_moe_layer(i)` picks MoE or dense MLP per layer and
the expert computation goes through the `ExpertBackend` given at construction.
"""

from __future__ import annotations

from tandem.models.decoder import DecoderForCausalLM


class Qwen3MoeForCausalLM(DecoderForCausalLM):
    pass


class Qwen2MoeForCausalLM(DecoderForCausalLM):
    pass


class MixtralForCausalLM(DecoderForCausalLM):
    pass


class OlmoeForCausalLM(DecoderForCausalLM):
    pass

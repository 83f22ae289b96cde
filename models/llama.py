"""Dense model families: Llama (incl. SmolLM2, Llama 3.x rope scaling), Mistral (Llama's
computation; its sliding window only caps the context, models/config.py), Qwen2, Qwen3.

All share `DecoderForCausalLM`; their differences (biases, q/k norm) come from ModelConfig.
"""

from __future__ import annotations

from tandem.models.decoder import DecoderForCausalLM


class LlamaForCausalLM(DecoderForCausalLM):
    pass


class MistralForCausalLM(DecoderForCausalLM):
    pass


class Qwen2ForCausalLM(DecoderForCausalLM):
    pass


class Qwen3ForCausalLM(DecoderForCausalLM):
    pass

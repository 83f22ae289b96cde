"""Architecture name (HF `architectures[0]`) -> model class."""

from __future__ import annotations

from tandem.models.config import UnsupportedModelError
from tandem.models.decoder import DecoderForCausalLM
from tandem.models.deepseek import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from tandem.models.glm import Glm4MoeForCausalLM
from tandem.models.gpt_oss import GptOssForCausalLM
from tandem.models.llama import (
    LlamaForCausalLM,
    MistralForCausalLM,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
)
from tandem.models.moe_models import (
    MixtralForCausalLM,
    OlmoeForCausalLM,
    Qwen2MoeForCausalLM,
    Qwen3MoeForCausalLM,
)

MODEL_REGISTRY: dict[str, type[DecoderForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "OlmoeForCausalLM": OlmoeForCausalLM,
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
    "Glm4MoeForCausalLM": Glm4MoeForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
}


def get_model_class(architecture: str) -> type[DecoderForCausalLM]:
    cls = MODEL_REGISTRY.get(architecture)
    if cls is None:
        raise UnsupportedModelError(
            f"unsupported architecture {architecture!r}; supported: {', '.join(MODEL_REGISTRY)}"
        )
    return cls

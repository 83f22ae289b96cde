"""Architecture name (HF `architectures[0]`) -> model class, each family's module imported only
when its architecture is asked for."""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

from tandem.models.config import UnsupportedModelError

if TYPE_CHECKING:
    from tandem.models.decoder import DecoderForCausalLM

# architecture -> the tandem.models module defining its class (of the same name)
MODEL_MODULES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "llama",
    "Qwen3ForCausalLM": "llama",
    "Qwen3MoeForCausalLM": "moe_models",
    "Qwen2MoeForCausalLM": "moe_models",
    "MixtralForCausalLM": "moe_models",
    "OlmoeForCausalLM": "moe_models",
    "DeepseekV2ForCausalLM": "deepseek",
    "DeepseekV3ForCausalLM": "deepseek",
    "Glm4MoeForCausalLM": "glm",
    "GptOssForCausalLM": "gpt_oss",
}


def get_model_class(architecture: str) -> type[DecoderForCausalLM]:
    module = MODEL_MODULES.get(architecture)
    if module is None:
        raise UnsupportedModelError(
            f"unsupported architecture {architecture!r}; supported: {', '.join(MODEL_MODULES)}"
        )
    return getattr(import_module(f"tandem.models.{module}"), architecture)

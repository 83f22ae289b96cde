"""Tiny random models of each family with a tool-call format, for server tests: a 2-layer
model of the family's architecture, a small byte-level BPE with the family's special tokens,
and a chat template (written here) that renders tools, tool calls and tool results the way the
family's own template does. Random weights: only grammar-forced output is predictable."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tokenizers import AddedToken, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as RustTokenizer

from tandem.models.config import ModelConfig
from tandem.models.loader import build_model
from tandem.models.loader.dummy import init_dummy_weights
from tandem.models.tokenizer import Tokenizer
from tandem.runtime.config import CacheConfig, EngineConfig, ModelSpec, SchedulerConfig
from tandem.runtime.engine import Engine

CORPUS = [
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}',
    "You may call functions. The weather in Paris is 21 degrees. [1, 2, 3] true false null",
    "Hello world! The quick brown fox jumps over the lazy dog. 0123456789",
]

_QWEN = """{%- if tools %}<|im_start|>system
You may call functions:
<tools>
{% for t in tools %}{{ t | tojson }}
{% endfor %}</tools>
Call one as <tool_call>{"name": ..., "arguments": {...}}</tool_call><|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == "assistant" and m.tool_calls %}<|im_start|>assistant
{{ m.content }}{% for c in m.tool_calls %}<tool_call>
{{ {"name": c.function.name, "arguments": c.function.arguments} | tojson }}
</tool_call>{% endfor %}<|im_end|>
{% elif m.role == "tool" %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% elif m.role == "assistant" %}<|im_start|>assistant
{{ m.content.split('</think>')[-1] }}<|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% endif %}{% endif %}"""

_LLAMA3 = """<|begin_of_text|>{% if tools %}<|start_header_id|>system<|end_header_id|>

Call a function by answering with JSON {"name": ..., "parameters": {...}}.
{% for t in tools %}{{ t | tojson }}
{% endfor %}<|eot_id|>{% endif %}
{%- for m in messages %}
{%- if m.role == "assistant" and m.tool_calls %}<|start_header_id|>assistant<|end_header_id|>

{% for c in m.tool_calls %}{{ {"name": c.function.name, "parameters": c.function.arguments} | tojson }}{% endfor %}<|eot_id|>
{%- elif m.role == "tool" %}<|start_header_id|>ipython<|end_header_id|>

{{ m.content }}<|eot_id|>
{%- else %}<|start_header_id|>{{ m.role }}<|end_header_id|>

{{ m.content }}<|eot_id|>
{%- endif %}{% endfor %}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""

_MISTRAL = """<s>{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}
{%- for m in messages %}
{%- if m.role == "assistant" and m.tool_calls %}[TOOL_CALLS]{{ m.tool_calls | map(attribute="function") | list | tojson }}</s>
{%- elif m.role == "assistant" %}{{ m.content }}</s>
{%- elif m.role == "tool" %}{% if m.tool_call_id | length != 9 %}{{ raise_exception("tool call ids are 9 characters") }}{% endif %}[TOOL_RESULTS]{{ m.content }}[/TOOL_RESULTS]
{%- else %}[INST]{{ m.content }}[/INST]{% endif %}{% endfor %}"""

_DEEPSEEK = """<｜begin▁of▁sentence｜>{% if tools %}You may call: {{ tools | tojson }}{% endif %}
{%- for m in messages %}
{%- if m.role == "system" %}{{ m.content }}
{%- elif m.role == "user" %}<｜User｜>{{ m.content }}
{%- elif m.role == "assistant" and m.tool_calls %}<｜Assistant｜><｜tool▁calls▁begin｜>
{%- for c in m.tool_calls %}<｜tool▁call▁begin｜>function<｜tool▁sep｜>{{ c.function.name + '\n```json\n' + c.function.arguments + '\n```' }}<｜tool▁call▁end｜>{% endfor %}<｜tool▁calls▁end｜><｜end▁of▁sentence｜>
{%- elif m.role == "tool" %}<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>{{ m.content }}<｜tool▁output▁end｜><｜tool▁outputs▁end｜>
{%- else %}<｜Assistant｜>{{ m.content.split('</think>')[-1] }}<｜end▁of▁sentence｜>{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<｜Assistant｜><think>
{% endif %}"""


@dataclass(frozen=True)
class Family:
    name: str
    architecture: str
    template: str
    eos: str
    special: tuple[str, ...]  # dropped from decoded text unless special tokens are kept
    added: tuple[str, ...] = ()  # whole tokens that stay in the text
    parser: str | None = None


FAMILIES = {
    "qwen3": Family("qwen3", "Qwen3ForCausalLM", _QWEN, "<|im_end|>",
                    ("<|im_start|>", "<|im_end|>"),
                    ("<tool_call>", "</tool_call>", "<think>", "</think>"), "hermes"),
    "llama3": Family("llama3", "LlamaForCausalLM", _LLAMA3, "<|eot_id|>",
                     ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                      "<|eot_id|>", "<|python_tag|>"), (), "llama3_json"),
    "mistral": Family("mistral", "MistralForCausalLM", _MISTRAL, "</s>",
                      ("<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]",
                       "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"), (), "mistral"),
    "deepseek_v3": Family("deepseek_v3", "LlamaForCausalLM", _DEEPSEEK, "<｜end▁of▁sentence｜>",
                          ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>",
                           "<｜Assistant｜>", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>",
                           "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>",
                           "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>",
                           "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>"),
                          ("<think>", "</think>"), "deepseek_v3"),
}  # fmt: skip


def family_tokenizer(family: Family) -> Tokenizer:
    tok = RustTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=list(family.special),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS * 5, trainer)
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in family.added])
    return Tokenizer(tok, chat_template=family.template, eos_token=family.eos)


def family_engine(family: Family, seed: int = 0) -> Engine:
    tokenizer = family_tokenizer(family)
    cfg = ModelConfig(
        architecture=family.architecture,
        vocab_size=tokenizer.vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=2048,
        eos_token_ids=tokenizer.eos_token_ids,
    )
    model = build_model(cfg, dtype=torch.float32, device="cpu")
    init_dummy_weights(model, seed=seed, std=0.5)
    config = EngineConfig(
        model=ModelSpec(model=f"tiny-{family.name}", device="cpu", dtype="float32"),
        cache=CacheConfig(block_size=16, num_blocks=256),
        scheduler=SchedulerConfig(max_num_seqs=16, max_model_len=2048, max_num_batched_tokens=2048),
    )
    return Engine(config, model_module=model, model_config=cfg, tokenizer=tokenizer)

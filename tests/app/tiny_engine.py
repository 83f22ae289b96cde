"""A real `runtime.engine.Engine` around a tiny random Llama and a tiny byte-level BPE tokenizer,
for server tests that need the real scheduler, KV block pool and detokenizer (not the fake).
"""

from __future__ import annotations

from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from tandem.models.config import ModelConfig
from tandem.models.loader import build_model
from tandem.models.loader.dummy import init_dummy_weights
from tandem.runtime.config import CacheConfig, EngineConfig, ModelSpec, SchedulerConfig
from tandem.runtime.engine import Engine

CORPUS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "A slow reader never stalls the engine; its deltas coalesce until it reads.",
    "Stop strings like </s> and ### can span tokens. Unicode: héllo wörld, café, 日本語 🎉.",
    "def f(x):\n    return x * 2  # code with    spaces\n",
]
EOS = "<eos>"


class TinyTokenizer:
    """Byte-level BPE (about 300 tokens) with a plain chat template; any text encodes."""

    def __init__(self, vocab_size: int = 300) -> None:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=[EOS],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        )
        tok.train_from_iterator(CORPUS * 5, trainer)
        self.tok = tok
        self.vocab_size = tok.get_vocab_size()
        self.eos_token_ids = (tok.token_to_id(EOS),)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        # as models.tokenizer.Tokenizer: encode_batch releases the GIL
        return self.tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: Any, skip_special_tokens: bool = True) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> str:
        text = "".join(f"<{m['role']}>\n{m['content']}\n" for m in messages)
        return text + ("<assistant>\n" if add_generation_prompt else "")


def make_tiny_engine(
    tokenizer: TinyTokenizer,
    *,
    num_blocks: int = 512,
    block_size: int = 4,
    max_num_seqs: int = 64,
    max_model_len: int = 256,
    max_num_batched_tokens: int = 1024,
    seed: int = 0,
) -> Engine:
    """A 2-layer Llama (hidden 64) with random weights; float32 on the CPU."""
    cfg = ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=tokenizer.vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        eos_token_ids=tokenizer.eos_token_ids,
    )
    model = build_model(cfg, dtype=torch.float32, device="cpu")
    init_dummy_weights(model, seed=seed, std=0.5)
    config = EngineConfig(
        model=ModelSpec(model="tiny-llama", device="cpu", dtype="float32"),
        cache=CacheConfig(block_size=block_size, num_blocks=num_blocks),
        scheduler=SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            max_num_batched_tokens=max_num_batched_tokens,
        ),
    )
    return Engine(config, model_module=model, model_config=cfg, tokenizer=tokenizer)

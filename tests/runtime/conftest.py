from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

_CORPUS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "Stop strings like </s> and ### can span tokens.",
    "Unicode: héllo wörld, naïve café, 日本語のテキスト, emoji 🎉🚀👍🏽.",
    "def f(x):\n    return x * 2  # code with    spaces\n",
]


class ByteBPE:
    """A tiny byte-level BPE tokenizer with the decode() the detokenizer needs."""

    def __init__(self) -> None:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=300,
            special_tokens=["<eos>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        )
        tok.train_from_iterator(_CORPUS * 5, trainer)
        self.tok = tok

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return (self.tok.token_to_id("<eos>"),)

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size()


@pytest.fixture(scope="session")
def byte_bpe() -> ByteBPE:
    return ByteBPE()

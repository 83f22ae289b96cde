"""The real default model (SmolLM2-135M-Instruct, Q4_1 GGUF): Tandem's greedy output equals
HF transformers' `generate` on the same dequantized weights."""

from __future__ import annotations

import pytest
import torch

from tandem.models.hf_export import to_hf_config_dict
from tandem.models.hub import resolve_model
from tandem.models.loader.gguf import load_gguf_weights
from tandem.runtime import LLM, SamplingParams

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "List three colors:",
]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(None, dtype="float32", device="cpu", max_model_len=1024)


@pytest.fixture(scope="module")
def hf_model(llm):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.AutoConfig.for_model(**to_hf_config_dict(llm.engine.model_config))
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    sd = dict(load_gguf_weights(resolve_model(None), torch.float32))
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    model.tie_weights()
    # Exactly 64 tokens on both sides: no EOS stop (min_new_tokens would instead *suppress* EOS
    # and change the greedy choice, where Tandem's ignore_eos only keeps going).
    model.generation_config.eos_token_id = None
    return model.eval()


def test_greedy_64_tokens_equal_hf_generate(llm, hf_model):
    tok = llm.tokenizer
    chat = tok.apply_chat_template([{"role": "user", "content": "Name a fruit."}])
    prompts = [tok.encode(p) for p in PROMPTS] + [tok.encode(chat)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))
    for ids, out in zip(prompts, outs, strict=True):
        x = torch.tensor([ids])
        with torch.inference_mode():
            ref = hf_model.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=64,
                do_sample=False,
                pad_token_id=0,
            )
        assert len(out.token_ids) == 64
        assert out.token_ids == ref[0, len(ids) :].tolist(), tok.decode(ids)


def test_chat_answers_sensibly(llm):
    out = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(max_tokens=24, temperature=0.0),
    )[0]
    assert "Paris" in out.text
    assert out.finish_reason in ("stop", "length")


def test_real_model_batched_equals_one_by_one_with_preemption_and_prefix_hits():
    prompts_text = [
        "Tell me about " + topic
        for topic in [
            "cats",
            "the moon",
            "Python lists",
            "rain",
            "trains",
            "bread",
            "music",
            "the ocean",
            "chess",
            "volcanoes",
            "bees",
            "winter",
            "maps",
            "glass",
            "rivers",
            "clocks",
        ]
    ]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    # 24 blocks of 16 tokens: 16 chats of ~45 prompt + 16 new tokens (4 blocks each) cannot all fit
    small = LLM(
        None,
        dtype="float32",
        device="cpu",
        max_model_len=256,
        num_kv_blocks=24,
        max_num_batched_tokens=256,
    )
    tok = small.tokenizer
    prompts = [
        tok.encode(tok.apply_chat_template([{"role": "user", "content": t}])) for t in prompts_text
    ]
    alone = [small.generate([p], params)[0].token_ids for p in prompts]
    small.engine.scheduler.block_pool.reset_prefix_cache()
    before = small.engine.stats()
    batched = [o.token_ids for o in small.generate(prompts, params)]
    after = small.engine.stats()
    assert batched == alone
    assert after.num_preemptions > before.num_preemptions
    assert after.prefix_cache_hits > before.prefix_cache_hits
    pool = small.engine.scheduler.block_pool
    pool.check_invariants()
    assert pool.usage == 0.0

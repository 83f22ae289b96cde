"""Grammar-constrained decoding and logit_bias on a tiny random Llama: whatever the random
weights say, a constrained output is valid (checked with `jsonschema`), a max_tokens cut is
`length`, and both samplers (reference and device sampler, run on the CPU) mask alike."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from tandem.models.tokenizer import SYNTHETIC_CHAT_TEMPLATE, Tokenizer
from tandem.runtime.cuda_sampler import CudaSampler
from tandem.runtime.grammar import GrammarCompiler, GrammarError, apply_bitmask, fill_bitmask
from tandem.runtime.sampler import Sampler, SampleRow
from tandem.runtime.sampling_params import GrammarSpec, SamplingParams, SamplingParamsError
from tests.runtime.test_engine import make_llm

SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {  # nested objects, optional property
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 1, "maximum": 999},
                    "admin": {"type": "boolean"},
                },
                "required": ["id"],
                "additionalProperties": False,
            },
            "note": {"type": "string", "maxLength": 4},
        },
        "required": ["user"],
        "additionalProperties": False,
    },
    {  # arrays with min/max items, enums
        "type": "object",
        "properties": {
            "tags": {
                "type": "array",
                "items": {"enum": ["red", "green", "blue"]},
                "minItems": 2,
                "maxItems": 4,
            }
        },
        "required": ["tags"],
        "additionalProperties": False,
    },
    {  # numbers with ranges, exclusive bounds
        "type": "object",
        "properties": {
            "x": {"type": "number", "minimum": -1.5, "maximum": 2.5},
            "n": {"type": "integer", "exclusiveMinimum": 10, "exclusiveMaximum": 20},
        },
        "required": ["x", "n"],
        "additionalProperties": False,
    },
    {  # anyOf
        "type": "object",
        "properties": {
            "v": {
                "anyOf": [
                    {"type": "integer", "minimum": 0, "maximum": 9},
                    {"type": "string", "maxLength": 3},
                    {"type": "null"},
                ]
            }
        },
        "required": ["v"],
        "additionalProperties": False,
    },
    {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 3},
    {"enum": ["yes", "no", 3, None]},
    {  # $defs and $ref, const
        "$defs": {"pt": {"type": "object", "properties": {"k": {"const": "p"}},
                         "required": ["k"], "additionalProperties": False}},
        "type": "object",
        "properties": {"a": {"$ref": "#/$defs/pt"}, "b": {"type": "array", "items":
                       {"$ref": "#/$defs/pt"}, "maxItems": 2}},
        "required": ["a", "b"],
        "additionalProperties": False,
    },
]  # fmt: skip


@pytest.fixture(scope="module")
def tok(byte_bpe) -> Tokenizer:
    return Tokenizer(byte_bpe.tok, chat_template=SYNTHETIC_CHAT_TEMPLATE, eos_token="<eos>")


@pytest.fixture(scope="module")
def llm(tok):
    return make_llm(tok, seed=3)


def _schema_spec(schema: dict) -> GrammarSpec:
    return GrammarSpec("json_schema", json.dumps(schema))


@pytest.mark.parametrize("schema", SCHEMAS, ids=range(len(SCHEMAS)))
def test_random_model_output_is_valid_under_schema(llm, schema) -> None:
    params = SamplingParams(
        max_tokens=200, temperature=1.0, n=4, seed=7, grammar=_schema_spec(schema)
    )
    (out,) = llm.generate([llm.engine.tokenizer.encode("Give JSON: ")], params)
    for choice in out.outputs:
        assert choice.finish_reason == "stop", choice.text
        jsonschema.validate(json.loads(choice.text), schema)


def test_greedy_constrained_output_is_valid_too(llm) -> None:
    schema = SCHEMAS[0]
    params = SamplingParams(max_tokens=200, temperature=0.0, grammar=_schema_spec(schema))
    (out,) = llm.generate(["Hello world"], params)
    assert out.finish_reason == "stop"
    jsonschema.validate(json.loads(out.text), schema)


def test_max_tokens_mid_json_is_length_not_a_fake_close(llm) -> None:
    schema = SCHEMAS[2]
    params = SamplingParams(max_tokens=3, temperature=0.0, grammar=_schema_spec(schema))
    (out,) = llm.generate(["Hello"], params)
    assert out.finish_reason == "length"
    assert len(out.token_ids) == 3
    with pytest.raises(json.JSONDecodeError):
        json.loads(out.text)
    assert out.text.startswith('{"')


@pytest.mark.parametrize(
    "spec, check",
    [
        (GrammarSpec("regex", r"[a-c]{2,5}-[0-9]{3}"), r"^[a-c]{2,5}-[0-9]{3}$"),
        (GrammarSpec("choice", json.dumps(["alpha", "beta", "gamma delta"])),
         r"^(alpha|beta|gamma delta)$"),
        (GrammarSpec("grammar", 'root ::= "(" [xy]+ ")" | "z"'), r"^(\([xy]+\)|z)$"),
    ],
)  # fmt: skip
def test_regex_choice_and_ebnf(llm, spec, check) -> None:
    import re

    params = SamplingParams(max_tokens=60, temperature=1.0, n=3, seed=1, grammar=spec)
    (out,) = llm.generate(["Hello"], params)
    for choice in out.outputs:
        assert choice.finish_reason == "stop", choice.text
        assert re.match(check, choice.text), choice.text


def test_json_object_mode_starts_an_object(llm) -> None:
    params = SamplingParams(
        max_tokens=30, temperature=1.0, seed=0, grammar=GrammarSpec("json_object")
    )
    (out,) = llm.generate(["Hello"], params)
    assert out.text.startswith("{")
    if out.finish_reason == "stop":
        assert isinstance(json.loads(out.text), dict)


def test_constrained_and_free_requests_share_a_batch(llm) -> None:
    free = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    (alone,) = llm.generate(["The quick brown fox"], free)
    engine = llm.engine
    engine.add_request(
        "c1",
        engine.tokenizer.encode("Hello"),
        SamplingParams(max_tokens=100, temperature=1.0, seed=3, grammar=_schema_spec(SCHEMAS[1])),
    )
    engine.add_request("f1", engine.tokenizer.encode("The quick brown fox"), free)  # fmt: skip
    texts: dict[str, str] = {"c1": "", "f1": ""}
    while engine.has_unfinished_requests():
        for d in engine.step():
            texts[d.request_id] += d.new_text
    assert texts["f1"] == alone.text  # the unconstrained row is untouched
    jsonschema.validate(json.loads(texts["c1"]), SCHEMAS[1])


def test_overlap_engine_on_cpu_keeps_constraints(tok) -> None:
    llm = make_llm(tok, seed=5)
    llm.engine.overlap = True
    llm.engine.scheduler.async_mode = True
    schema = SCHEMAS[3]
    params = SamplingParams(
        max_tokens=120, temperature=1.0, n=6, seed=2, grammar=_schema_spec(schema)
    )
    free = SamplingParams(max_tokens=12, temperature=1.0, n=4, seed=2)
    outs = llm.generate(["Hello", "world"], params)
    outs += llm.generate(["Hello"], free)
    for choice in outs[0].outputs + outs[1].outputs:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.text), schema)


def test_unsupported_schema_features_are_named(llm) -> None:
    bad = {"type": "object", "if": {"properties": {"a": {"const": 1}}}, "then": {}}
    with pytest.raises(SamplingParamsError) as err:
        llm.engine.add_request("bad", [1, 2], SamplingParams(grammar=_schema_spec(bad)))
    assert err.value.param == "response_format"
    assert "if" in str(err.value)
    with pytest.raises(GrammarError, match="format"):
        llm.engine.grammar_compiler.compile(
            _schema_spec({"type": "string", "format": "no-such-format"})
        )
    with pytest.raises(GrammarError):
        llm.engine.grammar_compiler.compile(GrammarSpec("grammar", "root ::= ("))


def test_compiled_grammars_are_cached_per_spec(llm) -> None:
    c = llm.engine.grammar_compiler
    spec = _schema_spec(SCHEMAS[0])
    first = c.compile(spec)
    assert c.compile(_schema_spec(SCHEMAS[0])) is first
    assert c.compile(_schema_spec(SCHEMAS[1])) is not first


# -- samplers -----------------------------------------------------------------------------------


def _rows(params: list[SamplingParams], grammars: list) -> list[SampleRow]:
    return [SampleRow(p, [1, 2], [], None, (0,), g) for p, g in zip(params, grammars, strict=True)]


def test_both_samplers_mask_only_constrained_rows(llm) -> None:
    c: GrammarCompiler = llm.engine.grammar_compiler
    vocab = c.vocab_size
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, vocab, generator=g) * 5
    spec = GrammarSpec("regex", "[0-9]+")
    greedy = SamplingParams(temperature=0.0)
    grammars = [c.compile(spec).new_matcher(), None, c.compile(spec).new_matcher(), None]
    allowed = {t for t in range(vocab) if llm.engine.tokenizer.decode([t]).isdigit()}
    for sampler in (Sampler("cpu"), CudaSampler("cpu", 8)):
        out = sampler(logits.clone(), _rows([greedy] * 4, grammars)).token_ids
        assert out[0] in allowed and out[2] in allowed
        assert out[1] == int(logits[1].argmax()) and out[3] == int(logits[3].argmax())
        sampled = SamplingParams(temperature=1.5, top_p=0.9, seed=1)
        out = sampler(logits.clone(), _rows([sampled] * 4, grammars)).token_ids
        assert out[0] in allowed and out[2] in allowed


def test_bitmask_matches_matcher_one_by_one(llm) -> None:
    c = llm.engine.grammar_compiler
    m = c.compile(GrammarSpec("regex", "ab[cd]")).new_matcher()
    m.accept(llm.engine.tokenizer.encode("a")[0])
    bm = torch.zeros(1, m.mask_words, dtype=torch.int32)
    fill_bitmask([m], bm)
    logits = torch.zeros(3, c.vocab_size)
    apply_bitmask(logits, torch.tensor([1]), bm)
    ok = [t for t in range(c.vocab_size) if logits[1, t] == 0]
    assert [llm.engine.tokenizer.decode([t]) for t in ok] == ["b"] or all(
        llm.engine.tokenizer.decode([t]) in ("b", "bc", "bd") for t in ok
    )
    assert torch.all(logits[0] == 0) and torch.all(logits[2] == 0)


def test_logit_bias_on_both_samplers() -> None:
    vocab = 50
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(1))
    top = int(logits[0].argmax())
    pushed = (top + 7) % vocab
    p_push = SamplingParams(temperature=0.0, logit_bias={pushed: 100.0})
    p_ban = SamplingParams(temperature=0.0, logit_bias={top: -100})
    for sampler in (Sampler("cpu"), CudaSampler("cpu", 4)):
        out = sampler(logits.clone(), _rows([p_push, p_ban], [None, None])).token_ids
        assert out[0] == pushed
        second = logits[1].clone()
        second[top] -= 100
        assert out[1] == int(second.argmax())


def test_logit_bias_is_validated(llm) -> None:
    with pytest.raises(SamplingParamsError, match="-100, 100"):
        SamplingParams(logit_bias={3: 101})
    with pytest.raises(SamplingParamsError, match="at most"):
        SamplingParams(logit_bias={i: 1.0 for i in range(301)})
    with pytest.raises(SamplingParamsError, match="vocabulary"):
        llm.engine.add_request("lb", [1, 2], SamplingParams(logit_bias={10**6: 1.0}))


def test_a_tokenizer_without_eos_ends_grammars_by_completion_only() -> None:
    tok = Tokenizer.synthetic(300)
    c = GrammarCompiler(tok.backend.to_str(), 300, ())
    m = c.compile(GrammarSpec("regex", "a+")).new_matcher()
    m.accept(ord("a"))  # complete, yet it may go on: only "a" may follow, never the stand-in EOS
    bm = torch.zeros(1, m.mask_words, dtype=torch.int32)
    fill_bitmask([m], bm)
    logits = torch.zeros(1, 300)
    apply_bitmask(logits, None, bm)
    assert [t for t in range(300) if logits[0, t] == 0] == [ord("a")]
    m2 = c.compile(GrammarSpec("regex", "ab")).new_matcher()
    m2.accept(ord("a"))
    m2.accept(ord("b"))
    assert m2.is_done


def test_the_loop_compiles_off_the_event_loop(llm) -> None:
    import asyncio
    import threading

    from tandem.runtime.loop import EngineLoop

    seen: list[threading.Thread] = []
    compiler = llm.engine.grammar_compiler
    real = compiler.compile

    class Spy:
        def compile(self, spec):  # noqa: ANN001, ANN202
            seen.append(threading.current_thread())
            return real(spec)

    class EngineStub:
        grammar_compiler = Spy()

    async def main() -> None:
        loop = EngineLoop(EngineStub())  # type: ignore[arg-type]
        await loop.compile_grammar(GrammarSpec("regex", "[a-z]{3}"))
        with pytest.raises(GrammarError):
            await loop.compile_grammar(GrammarSpec("regex", "("))

    asyncio.run(main())
    assert seen and all(t is not threading.main_thread() for t in seen)


def test_preempted_constrained_requests_resume_where_their_grammar_was(tok) -> None:
    """Seeded outputs with preemption (a KV pool too small for the batch) equal the same
    requests with room to spare: the matcher keeps its state while the request waits."""
    schema = SCHEMAS[1]
    params = SamplingParams(max_tokens=60, temperature=1.0, seed=11, grammar=_schema_spec(schema))
    prompts = [tok.encode("Hello world! The quick brown fox " * (1 + i % 3)) for i in range(12)]
    roomy = make_llm(tok, num_blocks=400, seed=3)
    small = make_llm(tok, num_blocks=40, budget=64, max_model_len=128, seed=3)
    ref = [o.token_ids for o in roomy.generate(prompts, params)]
    outs = small.generate(prompts, params)
    assert small.engine.stats().num_preemptions > 0
    assert [o.token_ids for o in outs] == ref
    for o in outs:
        assert o.finish_reason == "stop"
        jsonschema.validate(json.loads(o.text), schema)

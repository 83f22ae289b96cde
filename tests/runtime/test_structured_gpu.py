"""Grammar masks on CUDA: the device sampler masks like the reference, and the overlapped
engine with decode graphs keeps every constrained output valid while its unconstrained
neighbours decode exactly as they do alone.

GPU tests: marked `gpu`, skipped without CUDA and CuPy.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

import tandem.ext.cuda as cuda_ext
from tandem.models.tokenizer import Tokenizer
from tandem.runtime.sampling_params import GrammarSpec, SamplingParams
from tests.runtime.test_cuda_runner import VOCAB, small_config
from tests.runtime.test_overlap_gpu import make_engine, run
from tests.runtime.test_structured import SCHEMAS

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not cuda_ext.is_available(), reason="needs CUDA and CuPy"),
]


@pytest.fixture(scope="module")
def model():
    from tandem.models.loader import build_model
    from tandem.models.loader.dummy import init_dummy_weights

    m = build_model(small_config(), dtype=torch.bfloat16, device="cuda", attn_backend="cupy")
    init_dummy_weights(m, seed=0, std=0.5)
    return m


def engine_with_tokenizer(model, overlap: bool):
    engine = make_engine(model, overlap=overlap)
    engine.tokenizer = Tokenizer.synthetic(VOCAB)
    return engine


def test_device_sampler_masks_like_the_reference(model) -> None:
    from tandem.runtime.cuda_sampler import CudaSampler
    from tandem.runtime.sampler import Sampler, SampleRow

    engine = engine_with_tokenizer(model, overlap=False)
    compiled = engine.grammar_compiler.compile(GrammarSpec("regex", "[0-9]{2,4}"))
    logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(0)) * 4
    params = SamplingParams(temperature=0.0, logit_bias={300: 3.0})
    rows = [
        SampleRow(params, [1], [], None, (), compiled.new_matcher() if i % 2 else None)
        for i in range(6)
    ]
    ref = Sampler("cpu")(logits.clone(), rows).token_ids
    dev = CudaSampler("cuda", 8)(logits.cuda(), rows).token_ids
    assert dev == ref
    assert all(chr(ref[i]).isdigit() for i in (1, 3, 5))


def test_overlapped_engine_with_graphs_keeps_constraints(model) -> None:
    free = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)] * 8
    prompts = [[5 + i, 17, 42, 99 + i] for i in range(16)]
    alone = run(engine_with_tokenizer(model, overlap=True), prompts[:8], free)
    engine = engine_with_tokenizer(model, overlap=True)
    constrained = [
        SamplingParams(max_tokens=200, temperature=1.0, seed=i,
                       grammar=GrammarSpec("json_schema", json.dumps(SCHEMAS[i % len(SCHEMAS)])))
        for i in range(8)
    ]  # fmt: skip
    mixed = run(engine, prompts, free + constrained)
    assert mixed[:8] == alone
    for i in range(8, 16):
        ids, finish = mixed[i]
        assert finish == "stop"
        text = engine.tokenizer.decode(ids)
        jsonschema.validate(json.loads(text), SCHEMAS[(i - 8) % len(SCHEMAS)])
    assert engine.runner.counters.graph_steps > 0

"""Engine-level failure isolation, with and without overlap scheduling: a forward that raises
for one request's rows or a NaN row fails that request alone; a failure of every part of the
batch, step after step, leaves step() (the loop then declares the engine dead)."""

from __future__ import annotations

import pytest
import torch

from tandem.runtime.engine import MAX_FAILED_STEPS, Engine, EngineStepError
from tandem.runtime.sampling_params import SamplingParams
from tests.app.tiny_engine import TinyTokenizer, make_tiny_engine

MARKER = 7


@pytest.fixture(scope="module")
def tokenizer() -> TinyTokenizer:
    return TinyTokenizer()


def make(tokenizer: TinyTokenizer, overlap: bool) -> Engine:
    engine = make_tiny_engine(tokenizer)
    engine.overlap = overlap
    engine.scheduler.async_mode = overlap
    return engine


def raise_on_marker(engine: Engine) -> None:
    model = engine.runner.model

    class Wrapped:
        def __call__(self, input_ids, positions, batch):
            if bool((input_ids == MARKER).any()):
                raise RuntimeError("fault")
            return model(input_ids, positions, batch)

        def compute_logits(self, hidden):
            return model.compute_logits(hidden)

    engine.runner.model = Wrapped()


def run(engine: Engine) -> dict[str, tuple[str, int, str | None]]:
    """Step to the end -> request id: (finish reason, output tokens, error)."""
    out = {}
    for _ in range(500):
        if not engine.has_unfinished_requests():
            break
        for d in engine.step():
            if d.finished:
                out[d.request_id] = (d.finish_reason, d.num_output_tokens, d.error)
    return out


@pytest.mark.parametrize("overlap", [False, True])
def test_forward_fault_and_nan_rows_fail_one_request(tokenizer, overlap) -> None:
    engine = make(tokenizer, overlap)
    good = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    expected = make(tokenizer, overlap)
    expected.add_request("g", [10, 11, 12], good)
    want = run(expected)["g"]
    raise_on_marker(engine)
    sampler = engine.runner.sampler
    real = sampler.__call__

    def nan_for_seed(logits, rows):
        logits = logits.clone()
        for i, r in enumerate(rows):
            if r.params.seed == 666:
                logits[i] = float("nan")
        return real(logits, rows)

    engine.runner.sampler = nan_for_seed
    engine.add_request("g", [10, 11, 12], good)
    engine.add_request("fwd", [MARKER, 11], SamplingParams(max_tokens=5))
    engine.add_request("nan", [10, 12], SamplingParams(max_tokens=5, seed=666))
    engine.add_request("g2", [13, 14], good)
    out = run(engine)
    assert out["g"] == want and out["g2"][:2] == ("length", 12)
    assert out["fwd"][0] == "error" and "forward" in out["fwd"][2]
    assert out["nan"][0] == "error" and "non-finite" in out["nan"][2]
    engine.scheduler.block_pool.check_invariants()
    assert engine.scheduler.block_pool.usage == 0.0


def test_a_forward_that_always_fails_is_an_engine_failure(tokenizer) -> None:
    engine = make(tokenizer, False)
    model = engine.runner.model

    class Broken:
        def __call__(self, *args):
            raise RuntimeError("device lost")

        def compute_logits(self, hidden):
            return model.compute_logits(hidden)

    engine.runner.model = Broken()
    for i in range(MAX_FAILED_STEPS - 1):  # each alone: blamed on its request
        engine.add_request(f"r{i}", [10, 11], SamplingParams(max_tokens=3))
        assert run(engine)[f"r{i}"][0] == "error"
    engine.add_request("last", [10, 11], SamplingParams(max_tokens=3))
    with pytest.raises(EngineStepError, match="every sequence"):
        engine.step()


def test_sampler_marks_bad_rows_and_samples_the_rest() -> None:
    from tandem.runtime.sampler import FAILED_ROW, Sampler, SampleRow

    logits = torch.randn(3, 50)
    logits[1, 4] = float("nan")
    logits[2] = float("-inf")
    rows = [
        SampleRow(SamplingParams(temperature=0.0), [1], [], None),
        SampleRow(SamplingParams(temperature=0.7), [1], [], None),
        SampleRow(SamplingParams(temperature=0.0, logprobs=True, top_logprobs=2), [1], [], None),
    ]
    out = Sampler("cpu")(logits, rows)
    assert out.token_ids[0] == int(logits[0].argmax())
    assert out.token_ids[1:] == [FAILED_ROW, FAILED_ROW]


def test_the_sampler_needs_the_grammar_module_only_for_constrained_rows(monkeypatch) -> None:
    # On the GPU machine (no llguidance) the grammar import raised inside every call, so the
    # reference sampler failed every row of every batch.
    import sys

    from tandem.runtime.sampler import Sampler, SampleRow

    monkeypatch.setitem(sys.modules, "tandem.runtime.grammar", None)  # import raises
    logits = torch.randn(2, 50)
    rows = [SampleRow(SamplingParams(temperature=0.0), [1], [], None) for _ in range(2)]
    assert Sampler("cpu")(logits, rows).token_ids == logits.argmax(-1).tolist()

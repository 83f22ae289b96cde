from __future__ import annotations

import pytest

from tandem.runtime.sampling_params import SamplingParams, SamplingParamsError, expand_n


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 1.5}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 2.0}, "min_p"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": 1e-300}, "repetition_penalty"),  # 0 in float32
        ({"seed": "x"}, "seed"),
        ({"stop": [""]}, "stop"),
        ({"stop": ["a"] * 17}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop_token_ids": False}, "stop_token_ids"),
        ({"stop_token_ids": 7}, "stop_token_ids"),
        ({"stop": 5}, "stop"),
        ({"stop": {"a": 1}}, "stop"),
        ({"n": 0}, "n"),
        ({"n": 17}, "n"),
        ({"top_logprobs": 21}, "top_logprobs"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
        ({"skip_special_tokens": 3}, "skip_special_tokens"),  # killed the engine thread
        ({"skip_special_tokens": "no"}, "skip_special_tokens"),
    ],
)
def test_invalid_values_name_the_parameter(kwargs, param):
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param
    assert param in str(e.value)


def test_normalisation():
    p = SamplingParams(stop="###", top_k=-1, stop_token_ids=[3, 4])
    assert p.stop == ("###",) and p.top_k == 0 and p.stop_token_ids == (3, 4)
    assert SamplingParams(temperature=0.0).greedy and SamplingParams(top_k=1).greedy
    assert not SamplingParams(temperature=0.7).greedy
    assert SamplingParams(logprobs=True, top_logprobs=3).num_logprobs == 3
    assert SamplingParams(logprobs=False, top_logprobs=3).num_logprobs == 0


def test_expand_n_gives_distinct_reproducible_seeds():
    kids = expand_n(SamplingParams(n=3, seed=10))
    assert [k.n for k in kids] == [1, 1, 1] and [k.seed for k in kids] == [10, 11, 12]
    assert [k.seed for k in expand_n(SamplingParams(n=2))] == [None, None]

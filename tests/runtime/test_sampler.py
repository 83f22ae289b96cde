from __future__ import annotations

import torch

from tandem.runtime.sampler import Sampler, SampleRow
from tandem.runtime.sampling_params import SamplingParams

V = 64


def row(
    params: SamplingParams,
    out: list[int] | None = None,
    prompt: list[int] | None = None,
    seed_gen: bool = True,
    eos: tuple[int, ...] = (),
) -> SampleRow:
    gen = None
    if params.seed is not None and seed_gen:
        gen = torch.Generator().manual_seed(params.seed)
    return SampleRow(params, prompt or [1, 2, 3], out or [], gen, eos)


def logits(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, V, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_and_top_k_1_equal_argmax():
    s = Sampler("cpu")
    lg = logits(8)
    greedy = s(lg, [row(SamplingParams(temperature=0.0)) for _ in range(8)]).token_ids
    topk1 = s(lg, [row(SamplingParams(temperature=1.3, top_k=1)) for _ in range(8)]).token_ids
    assert greedy == topk1 == lg.argmax(-1).tolist()


def test_seed_reproduces_and_does_not_depend_on_batch_mates():
    s = Sampler("cpu")
    lg = logits(1)
    p = SamplingParams(temperature=1.0, seed=1234)
    alone = [s(lg, [row(p)]).token_ids[0] for _ in range(1)]
    r = row(p)
    seq_a = [s(lg, [r]).token_ids[0] for _ in range(20)]
    r2 = row(p)
    mates = [row(SamplingParams(temperature=1.0)) for _ in range(3)]
    big = torch.cat([logits(3, seed=9), lg])
    seq_b = [s(big, mates + [r2]).token_ids[3] for _ in range(20)]
    assert seq_a == seq_b
    assert seq_a[0] == alone[0]
    assert len(set(seq_a)) > 1, "a temperature-1 sampler should not be constant"


def test_sampling_follows_the_distribution():
    s = Sampler("cpu")
    lg = torch.log(torch.tensor([[0.5, 0.3, 0.2] + [1e-9] * (V - 3)]))
    r = row(SamplingParams(temperature=1.0, seed=7))
    counts = torch.zeros(V)
    for _ in range(3000):
        counts[s(lg, [r]).token_ids[0]] += 1
    freq = counts[:3] / counts.sum()
    assert torch.allclose(freq, torch.tensor([0.5, 0.3, 0.2]), atol=0.04), freq
    assert counts[3:].sum() == 0


def test_top_p_and_min_p_truncate():
    s = Sampler("cpu")
    probs = torch.tensor([[0.6, 0.25, 0.1, 0.05] + [0.0] * (V - 4)]) + 1e-12
    lg = probs.log()
    seen_top_p, seen_min_p = set(), set()
    r1 = row(SamplingParams(temperature=1.0, top_p=0.8, seed=1))
    r2 = row(SamplingParams(temperature=1.0, min_p=0.3, seed=2))
    for _ in range(400):
        seen_top_p.add(s(lg, [r1]).token_ids[0])
        seen_min_p.add(s(lg, [r2]).token_ids[0])
    assert seen_top_p == {0, 1}  # 0.6 < 0.8, 0.6 + 0.25 >= 0.8
    assert seen_min_p == {0, 1}  # threshold 0.18


def test_top_k_limits_choices():
    s = Sampler("cpu")
    lg = logits(1, seed=3)
    allowed = set(lg.topk(3).indices[0].tolist())
    r = row(SamplingParams(temperature=2.0, top_k=3, seed=5))
    seen = {s(lg, [r]).token_ids[0] for _ in range(300)}
    assert seen == allowed


def test_repetition_penalty_discourages_seen_tokens():
    s = Sampler("cpu")
    lg = torch.zeros(1, V)
    lg[0, 5] = 2.0
    lg[0, 6] = 1.9
    plain = s(lg, [row(SamplingParams(temperature=0.0), prompt=[5])]).token_ids[0]
    penal = s(
        lg, [row(SamplingParams(temperature=0.0, repetition_penalty=1.5), prompt=[5])]
    ).token_ids[0]
    assert (plain, penal) == (5, 6)


def test_presence_and_frequency_penalties_use_output_tokens_only():
    s = Sampler("cpu")
    lg = torch.zeros(1, V)
    lg[0, 5] = 1.0
    lg[0, 6] = 0.5
    in_prompt = s(lg, [row(SamplingParams(temperature=0.0, presence_penalty=1.0), prompt=[5])])
    in_output = s(lg, [row(SamplingParams(temperature=0.0, presence_penalty=1.0), out=[5])])
    freq = s(lg, [row(SamplingParams(temperature=0.0, frequency_penalty=0.2), out=[5, 5, 5])])
    freq_once = s(lg, [row(SamplingParams(temperature=0.0, frequency_penalty=0.2), out=[5])])
    assert in_prompt.token_ids == [5]
    assert in_output.token_ids == [6]
    assert freq.token_ids == [6] and freq_once.token_ids == [5]


def test_min_tokens_bans_eos_and_stop_ids():
    s = Sampler("cpu")
    lg = torch.zeros(1, V)
    lg[0, 2] = 10.0  # eos
    lg[0, 9] = 9.0  # stop id
    p = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=(9,))
    assert s(lg, [row(p, out=[1], eos=(2,))]).token_ids == [
        lg[0, :].clone().index_fill_(0, torch.tensor([2, 9]), -1e9).argmax().item()
    ]
    assert s(lg, [row(p, out=[1, 1], eos=(2,))]).token_ids == [2]


def test_logprobs_are_raw_log_softmax_with_sorted_top():
    s = Sampler("cpu")
    lg = logits(2, seed=11)
    out = s(
        lg,
        [
            row(SamplingParams(temperature=0.0, logprobs=True, top_logprobs=5)),
            row(SamplingParams(temperature=0.0)),
        ],
    )
    ref = torch.log_softmax(lg, -1)
    lp = out.logprobs[0]
    assert lp.token_id == out.token_ids[0]
    assert abs(lp.logprob - ref[0, lp.token_id].item()) < 1e-5
    assert [t for t, _ in lp.top] == ref[0].topk(5).indices.tolist()
    assert out.logprobs[1].top == ()


def test_nan_posinf_and_all_neginf_rows_fail_alone_greedy_and_sampled():
    from tandem.runtime.sampler import FAILED_ROW

    s = Sampler("cpu")
    lg = logits(5, seed=3)
    lg[0, 7] = float("nan")
    lg[1, 9] = float("inf")
    lg[2] = float("-inf")
    lg[3, :10] = float("-inf")  # some tokens banned: still a row that samples
    for params in (SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, seed=1)):
        out = s(lg, [row(params) for _ in range(5)]).token_ids
        assert out[:3] == [FAILED_ROW] * 3
        assert out[3] >= 10 and out[4] != FAILED_ROW
        if params.greedy:
            assert out[3:] == lg[3:].argmax(-1).tolist()


def test_processors_never_change_the_callers_logits():
    s = Sampler("cpu")
    lg = logits(3, seed=4)
    before = lg.clone()
    rows = [
        row(SamplingParams(temperature=0.0, repetition_penalty=1.5), out=[5, 6]),
        row(SamplingParams(temperature=0.0, min_tokens=4), out=[1], eos=(2,)),
        row(SamplingParams(temperature=0.0, logit_bias={3: 100.0})),
    ]
    out = s(lg, rows).token_ids
    assert torch.equal(lg, before)
    assert out[1] != 2 and out[2] == 3

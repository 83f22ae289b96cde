"""The device sampler equals the reference `Sampler` for every sampling parameter: penalties
(from its device token counts, including a token still in flight), min_tokens bans, greedy,
temperature, top-k/p, min-p, seeds and logprobs; and it fails a NaN, +inf or fully banned
row alone (`FAILED_ROW`), as the reference does. Plain torch, so the same code runs on the
CPU here and, marked `gpu`, on CUDA; and on CUDA it never syncs the host.
"""

from __future__ import annotations

import random

import pytest
import torch

from tandem.runtime.cuda_sampler import CudaSampler, GpuRow
from tandem.runtime.sampler import FAILED_ROW, Sampler, SampleRow
from tandem.runtime.sampling_params import SamplingParams
from tandem.runtime.types import SamplerOutput

V = 96
EOS = 2

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
        ],
    ),
]

PARAMS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.0, repetition_penalty=1.7),
    SamplingParams(temperature=0.0, presence_penalty=1.5, frequency_penalty=0.7),
    SamplingParams(temperature=0.8, top_k=10, seed=11, repetition_penalty=0.8),
    SamplingParams(temperature=1.1, top_p=0.8, min_p=0.05, frequency_penalty=-0.5, seed=12),
    SamplingParams(temperature=0.0, min_tokens=6, stop_token_ids=(7, 8)),
    SamplingParams(temperature=0.9, min_tokens=4, ignore_eos=True, stop_token_ids=(5,), seed=3),
    SamplingParams(temperature=0.0, logprobs=True, top_logprobs=5, presence_penalty=0.5),
    SamplingParams(temperature=1.0, logprobs=True, top_logprobs=0, seed=99),
    SamplingParams(temperature=0.7, top_k=5, top_p=0.9, logprobs=True, top_logprobs=20),
]


def _logits(n: int, step: int, device: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    lg = torch.randn(n, V, generator=g) * 2
    lg[:, EOS] += 2.5  # EOS and the stop ids are likely, so bans change outcomes
    lg[:, 7] += 2.0
    return lg.to(device)


def _gen(seed: int | None, device: str) -> torch.Generator | None:
    return None if seed is None else torch.Generator(device=device).manual_seed(seed)


def _assert_same(ref, got) -> None:
    assert got.token_ids == ref.token_ids
    if ref.logprobs is None:
        assert got.logprobs is None
        return
    assert len(got.logprobs) == len(ref.logprobs)
    for a, b in zip(ref.logprobs, got.logprobs, strict=True):
        assert a.token_id == b.token_id
        assert b.logprob == pytest.approx(a.logprob, abs=1e-5)
        assert [t for t, _ in b.top] == [t for t, _ in a.top]
        assert [x for _, x in b.top] == pytest.approx([x for _, x in a.top], abs=1e-5)


def _decode(device: str, *, overlap: bool, max_num_seqs: int, order=None, steps: int = 14):
    """Decode every PARAMS request for `steps` steps through both samplers (each with its own
    generators and the same global seed per step); `order(step)` picks the rows of a step.
    With overlap the device sampler sees each request's token list one token behind and gets
    the token in flight as the step's last input id, as the CUDA runner gives it."""
    rnd = random.Random(0)
    prompts = [[rnd.randrange(V) for _ in range(rnd.randint(1, 12))] for _ in PARAMS]
    outs: list[list[int]] = [[] for _ in PARAMS]
    ref_gens = [_gen(p.seed, device) for p in PARAMS]
    dev_gens = [_gen(p.seed, device) for p in PARAMS]
    ref, dev = Sampler(device), CudaSampler(device, max_num_seqs)
    for step in range(steps):
        idx = order(step) if order else list(range(len(PARAMS)))
        lg = _logits(len(idx), step, device)
        ref_rows = [
            SampleRow(PARAMS[i], prompts[i], list(outs[i]), ref_gens[i], (EOS,)) for i in idx
        ]
        dev_rows, last = [], []
        for i in idx:
            toks = prompts[i] + outs[i]
            applied = len(toks) - (1 if overlap and outs[i] else 0)
            dev_rows.append(GpuRow(PARAMS[i], toks[:applied], len(prompts[i]), len(outs[i]),
                                   dev_gens[i], (EOS,), request_id=f"r{i}"))  # fmt: skip
            last.append(toks[-1])
        torch.manual_seed(step)
        want = ref(lg, ref_rows)
        torch.manual_seed(step)
        sample = dev.sample_async(lg, dev_rows, torch.tensor(last, device=device))
        got = sample.output(sample.host_source.cpu())
        _assert_same(want, got)
        for i, t in zip(idx, got.token_ids, strict=True):
            outs[i].append(t)
    return outs, dev


@pytest.mark.parametrize("device", DEVICES)
def test_one_shot_rows_equal_the_reference(device: str) -> None:
    rnd = random.Random(1)
    for trial in range(6):
        rows_ref, rows_dev = [], []
        for p in PARAMS:
            prompt = [rnd.randrange(V) for _ in range(rnd.randint(1, 20))]
            out = [rnd.randrange(V) for _ in range(rnd.randint(0, 8))]
            rows_ref.append(SampleRow(p, prompt, out, _gen(p.seed, device), (EOS,)))
            rows_dev.append(SampleRow(p, prompt, out, _gen(p.seed, device), (EOS,)))
        lg = _logits(len(PARAMS), trial, device)
        torch.manual_seed(trial)
        want = Sampler(device)(lg, rows_ref)
        torch.manual_seed(trial)
        got = CudaSampler(device, len(PARAMS))(lg, rows_dev)
        _assert_same(want, got)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("overlap", [False, True])
def test_decoding_with_device_counts_equals_the_reference(device: str, overlap: bool) -> None:
    outs, dev = _decode(device, overlap=overlap, max_num_seqs=len(PARAMS))
    assert all(len(o) == 14 for o in outs)
    # min_tokens held the stop ids and EOS back (they are the likeliest tokens), then not
    assert not set(outs[5][:6]) & {EOS, 7, 8}
    assert not set(outs[6][:4]) & {5}
    # a penalised row's device counts equal its output histogram
    slot = dev.counts._slots["r2"].index
    want = torch.bincount(torch.tensor(outs[2][:-1]), minlength=V).to(torch.int32)
    assert torch.equal(dev.counts.counts[slot].cpu(), want)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("overlap", [False, True])
def test_evicted_counts_are_rebuilt_from_the_host(device: str, overlap: bool) -> None:
    # 4 slots for the 5 penalised requests, scheduled in rotating subsets: rows get evicted
    # and rebuilt (with the token in flight taken from the step's input ids).
    n = len(PARAMS)

    def order(step: int) -> list[int]:
        return [(step + k) % n for k in range(4)]

    _, dev = _decode(device, overlap=overlap, max_num_seqs=4, order=order, steps=20)
    assert len(dev.counts._slots) + len(dev.counts._free) == 4


@pytest.mark.parametrize("device", DEVICES)
def test_counts_rebuild_when_a_token_was_dropped(device: str) -> None:
    # A request preempted while its step ran loses that token; its row counted it already.
    p = SamplingParams(temperature=0.0, frequency_penalty=2.0)
    prompt, dev = [1, 2, 3], CudaSampler(device, 2)
    lg = _logits(1, 0, device)
    out = [4, 4, 9]
    dev.sample_async(lg, [GpuRow(p, prompt + out, 3, 3, request_id="a")])
    dropped = out[:2]  # the host dropped the third token
    s = dev.sample_async(lg, [GpuRow(p, prompt + dropped, 3, 2, request_id="a")])
    want = Sampler(device)(lg, [SampleRow(p, prompt, dropped, None)])
    assert s.token_ids.tolist() == want.token_ids
    slot = dev.counts._slots["a"].index
    assert int(dev.counts.counts[slot, 4]) == 2 and int(dev.counts.counts[slot, 9]) == 0


@pytest.mark.parametrize("device", DEVICES)
def test_release_frees_the_slot(device: str) -> None:
    dev = CudaSampler(device, 2)
    p = SamplingParams(temperature=0.0, repetition_penalty=1.3)
    dev.sample_async(_logits(1, 0, device), [GpuRow(p, [1, 2], 2, 0, request_id="x")])
    assert "x" in dev.counts._slots and len(dev.counts._free) == 1
    dev.release("x")
    assert "x" not in dev.counts._slots and len(dev.counts._free) == 2


def test_greedy_logprobs_without_staging() -> None:
    dev = CudaSampler("cpu", 4)
    lg = _logits(2, 3, "cpu")
    rows = [
        GpuRow(SamplingParams(temperature=0.0, logprobs=True, top_logprobs=3), [1], 1, 0),
        GpuRow(SamplingParams(temperature=0.0), [1], 1, 0),
    ]
    s = dev.sample_async(lg, rows)
    out = s.output(s.host_source)
    ref = torch.log_softmax(lg, -1)
    assert out.token_ids == lg.argmax(-1).tolist()
    assert out.logprobs[0].top[0][0] == out.token_ids[0]
    assert [t for t, _ in out.logprobs[0].top] == ref[0].topk(3).indices.tolist()
    assert out.logprobs[1].top == ()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_every_parameter_samples_without_a_host_sync() -> None:
    dev = CudaSampler("cuda", len(PARAMS))
    rows = [
        GpuRow(p, [1, 2, 3, 4, 5], 3, 3, _gen(p.seed, "cuda"), (EOS,), request_id=str(i))
        for i, p in enumerate(PARAMS)
    ]
    lg = _logits(len(PARAMS), 0, "cuda")
    last = torch.full((len(PARAMS),), 6, dtype=torch.int64, device="cuda")
    torch.cuda.synchronize()
    for _ in range(3):  # the first call allocates the counts; later ones reuse the staging ring
        torch.cuda.set_sync_debug_mode("error")
        try:
            s = dev.sample_async(lg, rows, last)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert s.packed is not None
        torch.cuda.synchronize()
        for r in rows:
            r.num_output_tokens = 3  # the same step again: nothing new to count


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["plain_greedy", "every_parameter", "greedy_logprobs"])
def test_non_finite_rows_fail_alone_as_in_the_reference(device: str, kind: str) -> None:
    if kind == "plain_greedy":
        params = [SamplingParams(temperature=0.0)] * 5
    elif kind == "greedy_logprobs":
        params = [SamplingParams(temperature=0.0, logprobs=True, top_logprobs=2)] * 5
    else:
        params = PARAMS
    n = len(params)
    lg = _logits(n, 7, device)
    lg[1, 3] = float("nan")
    lg[3, 9] = float("inf")
    lg[4] = float("-inf")  # nothing left to sample
    rows = [SampleRow(p, [1, 2], [3], _gen(p.seed, device), (EOS,)) for p in params]
    torch.manual_seed(5)
    want = Sampler(device)(lg, rows)
    rows = [SampleRow(p, [1, 2], [3], _gen(p.seed, device), (EOS,)) for p in params]
    torch.manual_seed(5)
    got = CudaSampler(device, n)(lg, rows)
    bad = [1, 3, 4]
    assert [want.token_ids[i] for i in bad] == [FAILED_ROW] * 3
    assert got.token_ids == want.token_ids
    ok = [i for i in range(n) if i not in bad]
    if want.logprobs is not None:
        _assert_same(
            SamplerOutput([want.token_ids[i] for i in ok], [want.logprobs[i] for i in ok]),
            SamplerOutput([got.token_ids[i] for i in ok], [got.logprobs[i] for i in ok]),
        )

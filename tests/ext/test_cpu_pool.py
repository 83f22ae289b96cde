"""CPU expert pool (ext/cpu): parity with the float32 torch reference per weight format and per
ISA path this machine supports, routing edge cases, concurrency, lifecycle, validation."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from tandem.ext.cpu import (
    CpuExpertPool,
    CpuExtensionError,
    cuda_host_funcs_error,
    cuda_memops_error,
    moe_reference,
    quantize,
    supported_isas,
)
from tandem.ext.cpu import build as cpu_build

ROOT = Path(__file__).resolve().parents[2]

ISAS = supported_isas()
FORMATS = ("bf16", "int8", "int4")
# Relative L2 error of the pool's output against the reference on the same dequantized weights.
# scalar/avx2 keep fp32 activations; avx512/amx round activations and the intermediate to bf16.
REL_TOL = {"scalar": 2e-5, "avx2": 2e-5, "avx512": 1.5e-2, "amx": 1.5e-2}
# int8/int4 layers on ISAs with the integer path (VNNI, AMX int8) also quantize activations to
# int8 (per token and block of 32, on both): at most
# absmax / 254 an element, measured 1.2-1.8e-2 relative on these random layers; the bound of
# tests/ext/test_cpu_int8_path.py (INT_FP32_TOL).
INT_PATH_TOL = 3e-2


def tol(isa: str, fmt: str) -> float:
    if fmt in ("int8", "int4") and isa in ("avx512", "amx"):
        return INT_PATH_TOL
    return REL_TOL[isa]


def make_layer(E: int, inter: int, H: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(E, 2 * inter, H, generator=g) / H**0.5
    w2 = torch.randn(E, H, inter, generator=g) / inter**0.5
    return w13, w2


def make_inputs(T: int, H: int, E: int, k: int, seed: int, skewed: bool = False):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=g)
    if skewed:  # most tokens on the same few experts: many tokens per expert (AMX path)
        ids = torch.stack([(torch.arange(k) + (t % 2)) % E for t in range(T)])
    else:
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    weights = torch.rand(T, k, generator=g)
    return hidden, ids, weights


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out - ref).norm() / ref.norm().clamp_min(1e-12)).item()


def check(pool: CpuExpertPool, layer: int, w13, w2, fmt, group, hidden, ids, weights, isa):
    out = pool.forward(layer, hidden, ids, weights)
    ref = moe_reference(hidden, quantize(w13, fmt, group), quantize(w2, fmt, group), ids, weights)
    assert out.shape == ref.shape and torch.isfinite(out).all()
    err = rel_err(out, ref)
    assert err < tol(isa, fmt), f"{isa} {fmt}: relative error {err:.2e}"
    return out


@pytest.fixture(scope="module")
def pools():
    made: dict[str, CpuExpertPool] = {}

    def get(isa: str) -> CpuExpertPool:
        if isa not in made:
            made[isa] = CpuExpertPool(num_threads=2, isa=isa)
        return made[isa]

    yield get
    for p in made.values():
        p.close()


def test_scalar_always_available():
    assert ISAS[0] == "scalar"


@pytest.mark.parametrize("fmt,group", [("bf16", 64), ("int8", 64), ("int4", 32), ("int4", 64)])
def test_converter_matches_torch_quantizer(pools, fmt, group):
    w13, w2 = make_layer(E=3, inter=80, H=136, seed=1)  # neither dimension a multiple of 64
    pool = pools("scalar")
    pool.add_layer(7, w13, w2, fmt, group)
    d13, d2 = pool.dequantize(7)
    r13, r2 = quantize(w13, fmt, group), quantize(w2, fmt, group)
    # Same formulas; allow a rare tie rounded differently (one quantization step).
    for d, r in ((d13, r13), (d2, r2)):
        mismatch = (d != r).float().mean().item()
        assert mismatch < 1e-3
        assert (d - r).abs().max().item() <= (r.abs().max().item() / 7 + 1e-6)


@pytest.mark.parametrize("source_dtype", [torch.bfloat16, torch.float16])
def test_converter_accepts_half_sources(pools, source_dtype):
    w13, w2 = make_layer(E=2, inter=32, H=64, seed=2)
    w13, w2 = w13.to(source_dtype), w2.to(source_dtype)
    pool = pools("scalar")
    pool.add_layer(8, w13, w2, "bf16")
    d13, d2 = pool.dequantize(8)
    torch.testing.assert_close(d13, w13.float().to(torch.bfloat16).float(), rtol=0, atol=0)
    torch.testing.assert_close(d2, w2.float().to(torch.bfloat16).float(), rtol=0, atol=0)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_parity_random_shapes(pools, isa, fmt):
    pool = pools(isa)
    rng = random.Random(f"{isa}-{fmt}")
    for case in range(4):
        E = rng.randint(4, 16)
        inter = rng.randint(32, 256)
        H = rng.randint(64, 512)
        k = rng.randint(1, min(8, E))
        T = rng.choice([1, 2, 3, 5, rng.randint(6, 64)])
        group = rng.choice([32, 64])
        w13, w2 = make_layer(E, inter, H, seed=case)
        pool.add_layer(case, w13, w2, fmt, group)
        hidden, ids, weights = make_inputs(T, H, E, k, seed=case, skewed=case == 3)
        check(pool, case, w13, w2, fmt, group, hidden, ids, weights, isa)


@pytest.mark.parametrize("isa", [i for i in ISAS if i != "scalar"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_parity_many_tokens(pools, isa, fmt):
    _many_tokens(pools, isa, fmt)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", FORMATS)
def test_parity_many_tokens_scalar(pools, fmt):
    _many_tokens(pools, "scalar", fmt)


def _many_tokens(pools, isa, fmt):
    # 512 tokens over 8 experts (top-4): ~256 tokens per expert, several AMX token blocks.
    E, inter, H, k, T = 8, 160, 320, 4, 512
    w13, w2 = make_layer(E, inter, H, seed=11)
    pool = pools(isa)
    pool.add_layer(20, w13, w2, fmt, 64)
    hidden, ids, weights = make_inputs(T, H, E, k, seed=12)
    check(pool, 20, w13, w2, fmt, 64, hidden, ids, weights, isa)


@pytest.mark.parametrize("isa", ISAS)
def test_routing_edge_cases(pools, isa):
    pool = pools(isa)
    E, inter, H = 6, 64, 128
    w13, w2 = make_layer(E, inter, H, seed=3)
    pool.add_layer(30, w13, w2, "bf16")
    hidden, ids, weights = make_inputs(9, H, E, 3, seed=4)
    ids[0, 1] = -1  # skipped slot (expert placed elsewhere, e.g. on the GPU)
    ids[2, :] = -1  # token with no CPU expert: zero output
    out = check(pool, 30, w13, w2, "bf16", 64, hidden, ids.to(torch.int32), weights, isa)
    assert out[2].abs().max().item() == 0.0
    # In place: out is hidden itself.
    expected = pool.forward(30, hidden, ids, weights)
    h2 = hidden.clone()
    pool.forward(30, h2, ids, weights, out=h2)
    torch.testing.assert_close(h2, expected, rtol=0, atol=0)
    # No tokens.
    empty = pool.forward(30, hidden[:0], ids[:0], weights[:0])
    assert empty.shape == (0, H)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_output_does_not_depend_on_the_thread_count(isa, fmt):
    # A node's workers take its work items (token preps, gate/up, activation preps, down) from
    # one stream, each waiting only for its own expert's inputs (ext/cpu/moe.cpp: run_step).
    # Which worker runs an item must not change a bit of the result: more workers than experts
    # (1 token), than cores (7 on the 2-core CI machine), one worker, two pretend NUMA nodes.
    E, inter, H = 12, 96, 192
    w13, w2 = make_layer(E, inter, H, seed=41)
    calls = [make_inputs(T, H, E, k, seed=T) for T, k in ((1, 2), (3, 4), (20, 6), (70, 3))]
    skipped = make_inputs(4, H, E, 2, seed=5)
    skipped[1].fill_(-1)  # every slot skipped: zero output
    for split in (0, 2):
        outs = []
        for threads in (1, 3, 7):
            if split and threads < split:
                continue
            with CpuExpertPool(num_threads=threads, isa=isa, split_nodes=split) as pool:
                pool.add_layer(0, w13, w2, fmt, 32)
                outs.append([pool.forward(0, *c) for c in calls])
                assert pool.forward(0, *skipped).abs().max().item() == 0.0
        for other in outs[1:]:
            for a, b in zip(outs[0], other, strict=True):
                torch.testing.assert_close(a, b, rtol=0, atol=0)
        for (hidden, ids, weights), out in zip(calls, outs[0], strict=True):
            ref = moe_reference(hidden, quantize(w13, fmt, 32), quantize(w2, fmt, 32), ids, weights)
            assert rel_err(out, ref) < tol(isa, fmt)


# Layers of the stress below: (layer, E, inter, H, fmt). inter 64 is one 64-column chunk, so
# with two pretend nodes one node's shard is empty (Is == 0); inter <= 128 keeps the shards the
# same for every thread count, so outputs compare bit for bit. E 40 grows the per-expert sync
# arrays (ext/cpu/moe.h: ExpertSync) that E 6 then reuses.
STRESS_LAYERS = ((0, 6, 64, 72, "bf16"), (1, 40, 96, 64, "int4"), (2, 16, 128, 130, "int8"))


def _stress_calls(n: int, seed: int) -> list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """n calls over STRESS_LAYERS: 1-50 tokens, top-1..8, some with most tokens on 1-2 experts
    (long runs of one expert's items), some with a quarter or all of their slots skipped."""
    rng = random.Random(seed)
    calls = []
    for i in range(n):
        layer, E, _, H, _ = STRESS_LAYERS[rng.randrange(len(STRESS_LAYERS))]
        T, k = rng.choice((1, 2, 5, 17, 33, 50)), rng.randint(1, min(8, E))
        hidden, ids, weights = make_inputs(T, H, E, k, seed=seed * 1000 + i)
        if rng.random() < 0.3:
            ids %= rng.randint(1, 2)
        ids[
            torch.rand(T, k, generator=torch.Generator().manual_seed(i)) < rng.choice((0, 0.25, 1))
        ] = -1
        calls.append((layer, hidden, ids, weights))
    return calls


@pytest.mark.parametrize("isa", ISAS)
def test_back_to_back_submits_do_not_depend_on_the_thread_count(isa):
    """Submits with no sync between them (each waits for the last, then resets the node's work
    counter and expert flags: ext/cpu/moe.cpp), alternating layers of 6-40 experts, an empty
    node shard, skipped and all-skipped calls; workers that sleep between jobs (spin_us 0) or
    spin, up to 16 on the 2-core CI machine. Every output row is written (NaN before) and equal,
    bit for bit, to the fewest-workers pool's, which matches the reference."""
    weights = {
        layer: make_layer(E, inter, H, seed=layer) for layer, E, inter, H, _ in STRESS_LAYERS
    }
    calls = _stress_calls(30 if isa == "amx" else 60, seed=3)

    def run(threads: int, split: int, spin_us: int) -> list[torch.Tensor]:
        with CpuExpertPool(num_threads=threads, isa=isa, split_nodes=split) as pool:
            pool.spin_us = spin_us
            for layer, _, _, _, fmt in STRESS_LAYERS:
                pool.add_layer(layer, *weights[layer], fmt, 32)
            outs = [torch.full_like(hidden, float("nan")) for _, hidden, _, _ in calls]
            for (layer, hidden, ids, w), out in zip(calls, outs, strict=True):
                pool.submit(layer, hidden, ids, w, out)
            pool.sync()
        return outs

    for split, (first, *others) in (
        (0, [(1, 200), (3, 0), (16, 200)]),
        (2, [(2, 200), (5, 0), (16, 0)]),
    ):
        ref = run(first[0], split, first[1])
        for (layer, hidden, ids, w), out in zip(calls, ref, strict=True):
            fmt = STRESS_LAYERS[layer][4]
            w13, w2 = (quantize(t, fmt, 32) for t in weights[layer])
            assert out[(ids < 0).all(dim=1)].abs().sum().item() == 0.0
            if (ids >= 0).any():
                assert rel_err(out, moe_reference(hidden, w13, w2, ids, w)) < tol(isa, fmt)
        for threads, spin_us in others:
            for i, (a, b) in enumerate(zip(ref, run(threads, split, spin_us), strict=True)):
                assert torch.equal(a, b), (split, threads, spin_us, i)


def test_submit_returns_and_sync_waits(pools):
    isa = ISAS[-1]
    pool = pools(isa)
    E, inter, H = 8, 128, 256
    w13, w2 = make_layer(E, inter, H, seed=5)
    pool.add_layer(40, w13, w2, "int8")
    pool.add_layer(41, w13, w2, "int4", 32)
    h1, i1, g1 = make_inputs(33, H, E, 4, seed=6)
    h2, i2, g2 = make_inputs(7, H, E, 2, seed=7)
    o1, o2 = torch.empty_like(h1), torch.empty_like(h2)
    # A second submit waits for the first; both results are complete after sync.
    pool.submit(40, h1, i1, g1, o1)
    pool.submit(41, h2, i2, g2, o2)
    pool.sync()
    pool.sync()  # nothing in flight: no-op
    q = quantize
    r1 = moe_reference(h1, q(w13, "int8"), q(w2, "int8"), i1, g1)
    r2 = moe_reference(h2, q(w13, "int4", 32), q(w2, "int4", 32), i2, g2)
    assert rel_err(o1, r1) < tol(isa, "int8") and rel_err(o2, r2) < tol(isa, "int4")
    # Sequential reuse gives identical results.
    again = pool.forward(40, h1, i1, g1)
    torch.testing.assert_close(again, o1, rtol=0, atol=0)


def test_concurrent_pools_from_threads():
    isa = ISAS[-1]
    E, inter, H = 8, 96, 192
    w13, w2 = make_layer(E, inter, H, seed=8)
    ref13, ref2 = quantize(w13, "bf16"), quantize(w2, "bf16")
    errors: list[str] = []

    def worker(seed: int) -> None:
        try:
            with CpuExpertPool(num_threads=1, isa=isa) as pool:
                pool.add_layer(0, w13, w2, "bf16")
                pool.add_layer(1, w13, w2, "bf16")
                for step in range(12):
                    T = 1 + (seed * 7 + step * 5) % 24
                    hidden, ids, weights = make_inputs(T, H, E, 2, seed=seed * 100 + step)
                    out = pool.forward(step % 2, hidden, ids, weights)
                    err = rel_err(out, moe_reference(hidden, ref13, ref2, ids, weights))
                    if err > REL_TOL[isa]:
                        errors.append(f"thread {seed} step {step}: {err:.2e}")
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    assert errors == []


def test_many_back_to_back_submits_and_busy_time(pools):
    """200 submits alternating between layers with no sync in between (each submit waits for
    the previous): every output is complete and right; worker busy time accumulates."""
    pool = pools("scalar")
    E, inter, H = 6, 64, 64
    w13, w2 = make_layer(E, inter, H, seed=11)
    pool.add_layer(50, w13, w2, "bf16")
    pool.add_layer(51, w13, w2, "int8")
    busy0 = sum(pool.busy_seconds())
    calls = []
    for i in range(200):
        hidden, ids, weights = make_inputs(1 + i % 5, H, E, 1 + i % 3, seed=1000 + i)
        out = torch.empty_like(hidden)
        pool.submit(50 + i % 2, hidden, ids, weights, out)
        calls.append((i % 2, hidden, ids, weights, out))
    pool.sync()
    for fmt_i, hidden, ids, weights, out in calls[::7]:
        fmt = ("bf16", "int8")[fmt_i]
        ref = moe_reference(hidden, quantize(w13, fmt), quantize(w2, fmt), ids, weights)
        assert rel_err(out, ref) < REL_TOL["scalar"]
    busy = pool.busy_seconds()
    assert len(busy) == 2 and sum(busy) > busy0


def test_close_and_context_manager():
    w13, w2 = make_layer(4, 32, 64, seed=9)
    with CpuExpertPool(num_threads=1) as pool:
        pool.add_layer(0, w13, w2)
        hidden, ids, weights = make_inputs(3, 64, 4, 2, seed=1)
        pool.submit(0, hidden, ids, weights, torch.empty_like(hidden))
    pool.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        pool.forward(0, hidden, ids, weights)


@pytest.mark.parametrize("spin_us", [0, 20_000])
def test_spin_then_sleep_keeps_shutdown_and_reuse(spin_us):
    """Workers spin `spin_us` after a job, then sleep. Both states take new jobs with the right
    result, and close() returns promptly even while every worker spins (20 ms here)."""
    E, inter, H = 4, 64, 64
    w13, w2 = make_layer(E, inter, H, seed=12)
    ref13, ref2 = quantize(w13, "bf16"), quantize(w2, "bf16")
    pool = CpuExpertPool(num_threads=2, isa="scalar", spin_us=spin_us)
    assert pool.spin_us == spin_us
    pool.add_layer(0, w13, w2, "bf16")
    for request in range(3):  # a "request": a burst of layer calls, then idle
        for step in range(5):
            hidden, ids, weights = make_inputs(1 + step, H, E, 2, seed=request * 10 + step)
            out = pool.forward(0, hidden, ids, weights)
            assert rel_err(out, moe_reference(hidden, ref13, ref2, ids, weights)) < 2e-5
        if request == 1:
            time.sleep(0.05)  # past any spin: the workers are asleep for the next request
    pool.submit(0, hidden, ids, weights, torch.empty_like(hidden))
    t0 = time.perf_counter()
    pool.close()  # waits for the job; the workers stop spinning and exit
    assert time.perf_counter() - t0 < 2.0
    with pytest.raises(ValueError, match="spin_us"):
        CpuExpertPool(num_threads=1, isa="scalar", spin_us=-1)


def _stream_job(pool, layer, C, H, k, n):
    tensors = (
        torch.zeros(C, H),
        torch.zeros(C, k, dtype=torch.int64),
        torch.zeros(C, k),
        torch.full((C, H), 7.0),
        torch.tensor([n], dtype=torch.int32),
    )
    return pool.stream_job(layer, *tensors)


def test_stream_job_runs_like_submit(pools):
    """The host functions of a stream-ordered job, run in order on this thread: each call reads
    its row count from the job's num_tokens buffer, computes those rows as submit would, leaves
    the rest of `out` alone, and is counted."""
    pool = pools("scalar")
    E, inter, H, k, C = 6, 64, 128, 3, 16
    w13, w2 = make_layer(E, inter, H, seed=13)
    pool.add_layer(70, w13, w2, "int8")
    job = _stream_job(pool, 70, C, H, k, 0)
    assert job.capacity == C
    before = pool.stream_stats()
    for i, T in enumerate((1, 16, 5, 0)):
        hidden, ids, weights = make_inputs(max(T, 1), H, E, k, seed=20 + i)
        job.hidden[:T], job.topk_ids[:T], job.topk_weights[:T] = hidden[:T], ids[:T], weights[:T]
        job.out.fill_(7.0)
        job.num_tokens[0] = T
        pool.run_stream_job(job)
        ref = pool.forward(70, hidden[:T].clone(), ids[:T].clone(), weights[:T].clone())
        torch.testing.assert_close(job.out[:T], ref, rtol=0, atol=0)
        assert bool((job.out[T:] == 7.0).all())
    s = pool.stream_stats()
    assert s["calls"] - before["calls"] == 4 and s["errors"] == before["errors"]
    assert s["tokens"] - before["tokens"] == 22
    assert s["h2d_bytes"] - before["h2d_bytes"] == 22 * H * 4
    assert s["pool_ns"] > before["pool_ns"]


def test_stream_job_failure_zeroes_output_and_is_counted(pools):
    """A host function cannot raise into a CUDA stream: a bad call zeroes its rows, counts an
    error and keeps the message; the next good call works."""
    pool = pools("scalar")
    E, inter, H, k = 4, 64, 64, 2
    w13, w2 = make_layer(E, inter, H, seed=14)
    pool.add_layer(71, w13, w2, "bf16")
    job = _stream_job(pool, 71, 4, H, k, 3)
    job.hidden.normal_()
    job.topk_ids[:3] = torch.tensor([[0, 1], [2, 9], [3, 0]])  # 9: out of range
    job.topk_weights.fill_(0.5)
    errors = pool.stream_stats()["errors"]
    pool.run_stream_job(job)
    assert pool.stream_stats()["errors"] == errors + 1
    assert "out of range" in pool.last_stream_error()
    assert bool((job.out[:3] == 0).all()) and bool((job.out[3] == 7.0).all())
    job.num_tokens[0] = 5  # more rows than the job holds
    pool.run_stream_job(job)
    assert pool.stream_stats()["errors"] == errors + 2 and "capacity" in pool.last_stream_error()
    job.num_tokens[0] = 3
    job.topk_ids[1, 1] = 1
    pool.run_stream_job(job)
    ref = moe_reference(job.hidden[:3], quantize(w13, "bf16"), quantize(w2, "bf16"),
                        job.topk_ids[:3], job.topk_weights[:3])  # fmt: skip
    assert rel_err(job.out[:3], ref) < 2e-5
    assert pool.stream_stats()["errors"] == errors + 2


def test_stream_job_validation(pools):
    pool = pools("scalar")
    E, inter, H = 4, 64, 64
    w13, w2 = make_layer(E, inter, H, seed=15)
    pool.add_layer(72, w13, w2, "bf16")
    good = dict(
        hidden=torch.zeros(4, H),
        topk_ids=torch.zeros(4, 2, dtype=torch.int64),
        topk_weights=torch.zeros(4, 2),
        out=torch.zeros(4, H),
        num_tokens=torch.zeros(1, dtype=torch.int32),
    )
    bad = [
        ("hidden", torch.zeros(4, H + 1), "hidden and out"),
        ("topk_ids", torch.zeros(4, 2, dtype=torch.int32), "int64"),
        ("topk_weights", torch.zeros(4, 3), "same"),
        ("out", torch.zeros(H, 4).t(), "contiguous"),
        ("num_tokens", torch.zeros(2, dtype=torch.int32), "one element"),
    ]
    for name, value, match in bad:
        with pytest.raises(ValueError, match=match):
            pool.stream_job(72, **(good | {name: value}))
    with pytest.raises(ValueError, match="has not been added"):
        pool.stream_job(73, **good)
    other = CpuExpertPool(num_threads=1, isa="scalar")
    other.add_layer(72, w13, w2, "bf16")
    job = other.stream_job(72, **good)
    with pytest.raises(ValueError, match="another pool"):
        pool.run_stream_job(job)
    other.close()


def _flag_job(pool, layer, C, H, k):
    tensors = (
        torch.zeros(C, H),
        torch.zeros(C, k, dtype=torch.int64),
        torch.zeros(C, k),
        torch.full((C, H), 7.0),
        torch.zeros(1, dtype=torch.int32),
    )
    return pool.stream_job(layer, *tensors, flags=True)


@pytest.mark.parametrize("poll_spin_us", [20000, 0])
def test_flag_jobs_run_like_submit(poll_spin_us):
    """Flag jobs, with this thread playing the GPU's part (write go = rows + 1, wait for done,
    reset it): the poller runs each job on the rows the go word names, leaves the other rows
    alone, raises done after the output is written, and serves several layers' jobs in any
    order; with poll_spin_us=0 it naps between looks and still answers. The pool closes with
    its poller idle."""
    pool = CpuExpertPool(num_threads=2, isa="scalar")
    pool.poll_spin_us = poll_spin_us
    E, inter, H, k, C = 6, 64, 128, 3, 16
    layers = {}
    for layer in (0, 1):
        w13, w2 = make_layer(E, inter, H, seed=40 + layer)
        pool.add_layer(layer, w13, w2, "int8")
        layers[layer] = _flag_job(pool, layer, C, H, k)
    before = pool.stream_stats()
    total = 0
    for i, (layer, T) in enumerate([(0, 1), (1, 16), (0, 5), (1, 0), (1, 9), (0, 16)]):
        job = layers[layer]
        hidden, ids, weights = make_inputs(max(T, 1), H, E, k, seed=60 + i)
        job.hidden[:T], job.topk_ids[:T], job.topk_weights[:T] = hidden[:T], ids[:T], weights[:T]
        job.out.fill_(7.0)
        pool.host_go(job, T)
        assert pool.host_done_wait(job, timeout_s=10.0)
        assert not pool.host_done_wait(job, timeout_s=0.01)  # reset: one done per go
        ref = pool.forward(layer, hidden[:T].clone(), ids[:T].clone(), weights[:T].clone())
        torch.testing.assert_close(job.out[:T], ref, rtol=0, atol=0)
        assert bool((job.out[T:] == 7.0).all())
        total += T
    s = pool.stream_stats()
    assert pool.flag_jobs_run == 6
    assert s["calls"] - before["calls"] == 6 and s["errors"] == before["errors"]
    assert s["tokens"] - before["tokens"] == total
    t0 = time.perf_counter()
    pool.close()
    assert time.perf_counter() - t0 < 2.0


def test_flag_job_failure_still_raises_done(pools):
    """A failing flag job must not leave the stream waiting: its rows are zeroed, the error is
    counted and done comes all the same; a row count beyond the job is refused before it
    reaches the stream; host-function jobs are not flag jobs."""
    pool = pools("scalar")
    E, inter, H, k = 4, 64, 64, 2
    w13, w2 = make_layer(E, inter, H, seed=18)
    pool.add_layer(75, w13, w2, "bf16")
    job = _flag_job(pool, 75, 4, H, k)
    job.hidden.normal_()
    job.topk_ids[:3] = torch.tensor([[0, 1], [2, 9], [3, 0]])  # 9: out of range
    job.topk_weights.fill_(0.5)
    errors = pool.stream_stats()["errors"]
    pool.host_go(job, 3)
    assert pool.host_done_wait(job, timeout_s=10.0)
    assert pool.stream_stats()["errors"] == errors + 1
    assert "out of range" in pool.last_stream_error()
    assert bool((job.out[:3] == 0).all()) and bool((job.out[3] == 7.0).all())
    with pytest.raises(ValueError, match="rows"):
        pool.host_go(job, 5)
    with pytest.raises(ValueError, match="rows"):
        pool.enqueue_go(0, job, -1)
    plain = _stream_job(pool, 75, 4, H, k, 1)
    for call in (lambda: pool.host_go(plain, 1), lambda: pool.enqueue_done_wait(0, plain)):
        with pytest.raises(ValueError, match="not a flag job"):
            call()
    job.topk_ids[1, 1] = 1
    pool.host_go(job, 3)
    assert pool.host_done_wait(job, timeout_s=10.0)
    ref = moe_reference(job.hidden[:3], quantize(w13, "bf16"), quantize(w2, "bf16"),
                        job.topk_ids[:3], job.topk_weights[:3])  # fmt: skip
    assert rel_err(job.out[:3], ref) < 2e-5


def test_extension_loads_without_libcuda_and_enqueue_says_why(pools):
    """The extension never links CUDA. Without the driver, the CUDA path's enqueue calls raise
    a RuntimeError that names libcuda (before touching any stream)."""
    err = cuda_host_funcs_error()
    if err is None:
        pytest.skip("this machine has the CUDA driver; the GPU tests cover enqueue")
    assert "libcuda" in err
    pool = pools("scalar")
    w13, w2 = make_layer(4, 64, 64, seed=16)
    pool.add_layer(74, w13, w2, "bf16")
    job = _stream_job(pool, 74, 2, 64, 2, 1)
    for enqueue in (pool.enqueue_submit, pool.enqueue_wait):
        with pytest.raises(RuntimeError, match="libcuda"):
            enqueue(0, job)
    assert "libcuda" in cuda_memops_error()
    flag = _flag_job(pool, 74, 2, 64, 2)
    with pytest.raises(RuntimeError, match="libcuda"):
        pool.enqueue_go(0, flag, 1)
    with pytest.raises(RuntimeError, match="libcuda"):
        pool.enqueue_done_wait(0, flag)


@pytest.mark.gpu
@pytest.mark.parametrize("sync", ["host_func", "flags"])
def test_stream_jobs_in_a_captured_cuda_graph(sync):
    """D2H copies -> submit (host node, or a write of the go word) -> wait (host node, or the
    GPU waiting on the done word) -> H2D copy, captured once; replays with new inputs and other
    row counts equal the pool's own submit/sync; eager enqueue too."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    assert cuda_host_funcs_error() is None and cuda_memops_error() is None
    E, inter, H, k, C = 8, 64, 128, 2, 8
    w13, w2 = make_layer(E, inter, H, seed=17)
    pool = CpuExpertPool(num_threads=2, isa="scalar")
    pool.add_layer(0, w13, w2, "bf16")
    pin = dict(pin_memory=True)
    job = pool.stream_job(
        0,
        torch.zeros(C, H, **pin),
        torch.zeros(C, k, dtype=torch.int64, **pin),
        torch.zeros(C, k, **pin),
        torch.zeros(C, H, **pin),
        torch.zeros(1, dtype=torch.int32, **pin),
        flags=sync == "flags",
    )
    dev = torch.device("cuda")
    x_d = torch.zeros(C, H, device=dev)  # static graph inputs
    ids_d = torch.zeros(C, k, dtype=torch.int64, device=dev)
    w_d = torch.zeros(C, k, device=dev)
    rows_d = torch.arange(C + 1, dtype=torch.int32, device=dev)
    out_d = torch.zeros(C, H, device=dev)
    stream = torch.cuda.Stream()

    def body(T: int) -> None:
        job.hidden[:T].copy_(x_d[:T] * 1.0, non_blocking=True)  # a kernel, then the copy
        job.topk_ids[:T].copy_(ids_d[:T], non_blocking=True)
        job.topk_weights[:T].copy_(w_d[:T], non_blocking=True)
        s = torch.cuda.current_stream().cuda_stream
        if sync == "flags":
            pool.enqueue_go(s, job, T)
        else:
            job.num_tokens.copy_(rows_d[T : T + 1], non_blocking=True)
            pool.enqueue_submit(s, job)
        out_d[:T].mul_(0.0)  # GPU work between submit and wait
        if sync == "flags":
            pool.enqueue_done_wait(s, job)
        else:
            pool.enqueue_wait(s, job)
        out_d[:T].copy_(job.out[:T], non_blocking=True)

    def fill(T: int, seed: int) -> tuple[torch.Tensor, ...]:
        hidden, ids, weights = make_inputs(T, H, E, k, seed=seed)
        x_d[:T].copy_(hidden)
        ids_d[:T].copy_(ids)
        w_d[:T].copy_(weights)
        return hidden, ids, weights

    def expect(hidden, ids, weights):
        return pool.forward(0, hidden, ids, weights)

    with torch.cuda.stream(stream):
        hidden, ids, weights = fill(5, seed=1)
        body(5)  # eager
        stream.synchronize()
        torch.testing.assert_close(out_d[:5].cpu(), expect(hidden, ids, weights), rtol=0, atol=0)
        graphs = {}
        for T in (C, 3):
            graphs[T] = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graphs[T], stream=stream):
                body(T)
    calls = pool.stream_stats()["calls"]
    for rep, T in enumerate((C, 3, C, 3, 3)):
        hidden, ids, weights = fill(T, seed=100 + rep)
        out_d.fill_(-1.0)
        graphs[T].replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out_d[:T].cpu(), expect(hidden, ids, weights), rtol=0, atol=0)
    s = pool.stream_stats()
    assert s["calls"] == calls + 5 and s["errors"] == 0, (s, pool.last_stream_error())
    del graphs
    pool.close()


def test_info():
    pool = CpuExpertPool(num_threads=2, isa="scalar")
    E, inter, H = 4, 64, 128
    w13, w2 = make_layer(E, inter, H, seed=10)
    pool.add_layer(50, w13, w2, "bf16")
    pool.add_layer(51, w13, w2, "int4", 64)
    info = pool.info()
    assert info["isa"] == "scalar" and info["num_threads"] == 2
    assert info["numa_nodes"] and sum(n["threads"] for n in info["numa_nodes"]) == 2
    assert info["bytes_per_format"]["bf16"] >= E * 3 * inter * H * 2
    int4_bytes = E * 3 * inter * H // 2 + E * 3 * inter * H // 64 * 4
    assert int4_bytes <= info["bytes_per_format"]["int4"] < 2 * int4_bytes
    pool.close()


def test_isa_env_var_and_invalid_isa(monkeypatch):
    monkeypatch.setenv("TANDEM_CPU_ISA", "scalar")
    with CpuExpertPool(num_threads=1) as pool:
        assert pool.info()["isa"] == "scalar"
    with pytest.raises(ValueError):
        CpuExpertPool(num_threads=1, isa="sse9")
    missing = [i for i in ("avx2", "avx512", "amx") if i not in ISAS]
    if missing:
        with pytest.raises(ValueError, match="not available"):
            CpuExpertPool(num_threads=1, isa=missing[0])
    with pytest.raises(ValueError):
        CpuExpertPool(num_threads=0)


@pytest.mark.parametrize("name", ["TANDEM_AMX_TILE_MIN_TOKENS", "TANDEM_AMX_BF16_MIN_TOKENS"])
@pytest.mark.parametrize("value", ["x", "0", "-3", "2.5"])
def test_amx_tile_env_var_is_checked(monkeypatch, name, value):
    """The AMX thresholds are read by the extension only on AMX CPUs (where a bad value would
    silently mean the default): every CPU refuses them by name when a pool starts."""
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=name):
        CpuExpertPool(num_threads=1)
    monkeypatch.setenv(name, "12")
    CpuExpertPool(num_threads=1).close()


def test_invalid_inputs_raise_value_error(pools):
    pool = pools("scalar")
    E, inter, H = 4, 32, 64
    w13, w2 = make_layer(E, inter, H, seed=11)
    pool.add_layer(60, w13, w2)
    hidden, ids, weights = make_inputs(5, H, E, 2, seed=2)
    out = torch.empty_like(hidden)
    bad_calls = [
        lambda: pool.submit(61, hidden, ids, weights, out),  # unknown layer
        lambda: pool.submit(60, hidden.double(), ids, weights, out),
        lambda: pool.submit(60, hidden[:, :32], ids, weights, out),
        lambda: pool.submit(60, hidden.t().contiguous().t(), ids, weights, out),
        lambda: pool.submit(60, hidden, ids.float(), weights, out),
        lambda: pool.submit(60, hidden, ids[:4], weights, out),
        lambda: pool.submit(60, hidden, ids, weights[:, :1], out),
        lambda: pool.submit(60, hidden, ids, weights, out[:4]),
        lambda: pool.submit(60, hidden, ids + E, weights, out),  # expert id out of range
        lambda: pool.submit(60, hidden, ids - 3, weights, out),
        lambda: pool.submit(60, hidden, ids, weights, out[:, :1]),
        lambda: pool.submit(60, hidden, ids, weights, "out"),
        lambda: pool.submit(60, hidden[0], ids, weights, out),
        lambda: pool.add_layer(61, w13, w2, "fp8"),
        lambda: pool.add_layer(61, w13, w2, "int4", 48),
        lambda: pool.add_layer(61, w13, w2[:, :, :16]),
        lambda: pool.add_layer(61, w13[:, :63], w2),
        lambda: pool.add_layer(61, w13.long(), w2),
        lambda: pool.add_layer(-1, w13, w2),
    ]
    if torch.cuda.is_available():
        bad_calls.append(lambda: pool.submit(60, hidden.cuda(), ids, weights, out))
    for i, call in enumerate(bad_calls):
        with pytest.raises(ValueError):
            call()
            pytest.fail(f"bad call {i} did not raise")
    # The pool still works afterwards.
    check(pool, 60, w13, w2, "bf16", 64, hidden, ids, weights, "scalar")


def test_missing_compiler_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("CXX", "/nonexistent/g++")
    with pytest.raises(CpuExtensionError, match="compiler"):
        cpu_build._compiler()


def test_compile_error_carries_compiler_output(tmp_path):
    bad = tmp_path / "bad.cpp"
    bad.write_text("int main() { return undefined_name; }\n")
    with pytest.raises(CpuExtensionError, match="undefined_name"):
        cpu_build._run([cpu_build._compiler(), "-c", str(bad), "-o", str(tmp_path / "bad.o")])


@pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs Linux affinity and two allowed cpus",
)
def test_confine_others_moves_unpinned_threads_to_the_spare_cpus() -> None:
    """In a child process (affinity changes stick to the process): a pool of one worker leaves
    the other cpus spare; confine_others moves the main thread and an already running Python
    thread there, leaves the pinned worker alone, and later threads inherit the mask; close
    puts the masks back."""
    code = textwrap.dedent(
        """
        import os, threading
        from tandem.ext.cpu import CpuExpertPool
        allowed = os.sched_getaffinity(0)
        pool = CpuExpertPool(num_threads=1)
        spare = pool.spare_cpus
        assert len(spare) == len(allowed) - 1 and set(spare) < allowed, (spare, allowed)
        release, seen = threading.Event(), {}
        t = threading.Thread(target=lambda: (release.wait(), seen.update(a=os.sched_getaffinity(0))))
        t.start()
        assert pool.confine_others() == sorted(spare)
        release.set(); t.join()
        assert seen["a"] == set(spare) and os.sched_getaffinity(0) == set(spare)
        masks = []
        for tid in os.listdir("/proc/self/task"):
            try:
                masks.append(os.sched_getaffinity(int(tid)))
            except ProcessLookupError:  # a thread that ended since the listing
                pass
        assert (allowed - set(spare)) in masks  # the worker keeps its cpu
        later = threading.Thread(target=lambda: seen.update(b=os.sched_getaffinity(0)))
        later.start(); later.join()
        assert seen["b"] == set(spare)
        pool.close()  # undone: the next pool sees every cpu again
        assert os.sched_getaffinity(0) == allowed
        assert CpuExpertPool(num_threads=1).spare_cpus == sorted(spare)
        print("ok")
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]


@pytest.mark.parametrize("pack", [False, True])
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_converter_rounds_ties_to_even(fmt: str, pack: bool) -> None:
    """Every value a tie (k + 0.5 quantization steps): the converter rounds half to even, as
    torch.round and the reference quantizer do, in both row orders, bit for bit."""
    peak = {"int8": 127.0, "int4": -8.0}[fmt]  # scale 1: x / scale is x itself
    ties = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5, -6.5, 5.5, 4.5, -3.5, 6.5])
    K = 64

    def rows(n: int) -> torch.Tensor:
        r = ties.repeat(n * K // len(ties) + 1)[: n * K].view(n, K).clone()
        r[:, ::32] = peak  # every int4 group of 32 holds the peak
        return r

    w13, w2 = rows(2 * 64).view(1, 128, K), rows(K).view(1, K, 64)
    with CpuExpertPool(num_threads=1, isa="scalar", pack_rows=pack) as pool:
        pool.add_layer(0, w13, w2, fmt, 32)
        d13, d2 = pool.dequantize(0)
    for d, w in ((d13, w13), (d2, w2)):
        expected = torch.round(w).clamp(-127 if fmt == "int8" else -8, 127 if fmt == "int8" else 7)
        assert torch.equal(d, expected)
        assert torch.equal(d, quantize(w, fmt, 32))
        assert {float(v) for v in d.unique()} >= {0.0, 2.0, -2.0, 4.0, -6.0, 6.0}


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt,group", [("bf16", 32), ("int8", 32), ("int4", 32), ("int4", 64)])
def test_a_tokens_output_does_not_depend_on_the_other_tokens_of_the_call(pools, isa, fmt, group):
    """Greedy output under load must not change with what else runs: each token's result is
    the same alone and in a batch that gives its experts many tokens (the float path included,
    int_min_tokens 0). Before: avx512 int4 widened the rows to bf16 from 5 tokens an expert,
    rounding (q - 8) * scale, so results moved by ~4e-3 relative with the batch."""
    pool = pools(isa)
    E, inter, H, k, T = 8, 96, 64, 2, 64
    w13, w2 = make_layer(E, inter, H, seed=5)
    hidden, ids, weights = make_inputs(T, H, E, k, seed=6)
    # In the batch some experts get 16+ tokens (AMX: whole tiles), alone every one gets 1 (VNNI).
    assert ids.flatten().bincount().max() >= 16
    before = pool.int_min_tokens
    try:
        for int_min in sorted({before, 0}):
            if isa == "amx" and fmt == "int4" and int_min == 0:
                continue  # known: AMX's float path widens (q - 8) * scale to bf16 from 4 tokens
            pool.int_min_tokens = int_min
            pool.add_layer(9, w13, w2, fmt=fmt, group_size=group)
            batched = pool.forward(9, hidden, ids, weights)
            alone = torch.cat(
                [
                    pool.forward(
                        9,
                        hidden[t : t + 1].clone(),
                        ids[t : t + 1].clone(),
                        weights[t : t + 1].clone(),
                    )
                    for t in range(T)
                ]
            )
            if isa == "amx" and (fmt == "int8" or group == 64) and int_min:
                # Tiles from int_tiles_from tokens an expert take 16-bit activations per token
                # (int8) or 8-bit ones per 64-block (int4 in groups of 64), VNNI below them 8-bit
                # ones per 32-block: alone and batched differ by the two quantizations' errors.
                # With the routing kept, other tokens' values change nothing.
                assert rel_err(batched, alone) < 3e-2
                other = hidden.clone()
                other[T // 2 :] = torch.randn(
                    T - T // 2, H, generator=torch.Generator().manual_seed(7)
                )
                again = pool.forward(9, other, ids.clone(), weights.clone())
                assert torch.equal(again[: T // 2], batched[: T // 2]), (isa, fmt, int_min)
            elif isa == "amx":  # tiles from 8 tokens an expert, AVX-512 / VNNI below: the same
                # products, summed in another order
                err = rel_err(batched, alone)
                assert err < 1e-5, (isa, fmt, int_min, err)
            else:
                assert torch.equal(batched, alone), (isa, fmt, int_min)
    finally:
        pool.int_min_tokens = before

"""CPU expert pool (ext/cpu): parity with the float32 torch reference per weight format and per
ISA path this machine supports, routing edge cases, concurrency, lifecycle, validation."""

from __future__ import annotations

import random
import threading

import pytest
import torch

from ext.cpu import CpuExpertPool, CpuExtensionError, moe_reference, quantize, supported_isas
from ext.cpu import build as cpu_build

ISAS = supported_isas()
FORMATS = ("bf16", "int8", "int4")
# Relative L2 error of the pool's output against the reference on the same dequantized weights.
# scalar/avx2 keep fp32 activations; avx512/amx round activations and the intermediate to bf16.
REL_TOL = {"scalar": 2e-5, "avx2": 2e-5, "avx512": 1.5e-2, "amx": 1.5e-2}


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
    assert err < REL_TOL[isa], f"{isa} {fmt}: relative error {err:.2e}"
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
    assert rel_err(o1, r1) < REL_TOL[isa] and rel_err(o2, r2) < REL_TOL[isa]
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

"""The CPU pool's integer path (int8/int4 weights times int8 activations: "vnni" with the avx512
kernels, "amx-int8" with amx): parity with the torch reference, per ISA this machine has, on
random shapes (K and N not multiples of 64), 1..512 tokens and top-k 1..8; the path must
really run where it is selected and stay off where it is not.

Tolerances (relative L2 error of the layer output):
  * against moe_reference(quantize_acts=int_path_activations(...)), which quantizes both
    projections' inputs exactly as the kernels do (ext/cpu/reference.py: per 32-element block on
    VNNI and on the AMX tiles with int4 weights in groups of 32, per 64-element block on the tiles
    with int4 in groups of 64, per row with 16 bits on the tiles with int8 weights):
    INT_EXACT_TOL = 2e-3. Only
    the order of fp32 sums differs, and through it, rarely, an intermediate element rounds to
    the neighbouring int8 level (one step, absmax / 127 of its block); observed <= 3e-4.
  * against the fp32 reference on the same dequantized weights: INT_FP32_TOL = 3e-2. The
    activation quantization error per element is at most absmax / 254 of its 32-element block;
    for Gaussian blocks (absmax ~ 2.1 sigma) its rms is ~0.5% of the block's rms per projection,
    and the intermediate SiLU(gate) * up is heavier-tailed; observed 1.0-1.4e-2 (bf16 activations
    on the float path: 3-4e-3).
"""

from __future__ import annotations

import random

import pytest
import torch

from tandem.ext.cpu import CpuExpertPool, moe_reference, quantize, supported_isas
from tandem.ext.cpu import pool as pool_mod
from tandem.ext.cpu.reference import (
    int_path_activations,
    quantize_activations,
    quantize_activations_row16,
)

INT_PATHS = {"avx512": "vnni", "amx": "amx-int8"}  # kernel set -> its integer path
INT_ISAS = [isa for isa in supported_isas() if isa in INT_PATHS]
INT_EXACT_TOL = 2e-3
INT_FP32_TOL = 3e-2
FORMATS = [("int8", 64), ("int4", 32), ("int4", 64)]
# (tokens, top-k): 1..512 tokens; few experts, so 512 tokens put 100+ tokens on an expert
# (several AMX token blocks, a partial last one).
CALLS = [(1, 1), (2, 8), (3, 2), (5, 3), (17, 5), (64, 8), (130, 4), (512, 6)]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out - ref).norm() / ref.norm().clamp_min(1e-12)).item()


def random_layer(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer of random shape: E in [3, 9], I and H in [40, 700), often not multiples of 64
    (padded by the pool; H past 512 gives a partial second VNNI super-block)."""
    rng = random.Random(seed)
    E, inter, H = rng.randint(3, 9), rng.randrange(40, 700), rng.randrange(40, 700)
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(E, 2 * inter, H, generator=g) / H**0.5
    w2 = torch.randn(E, H, inter, generator=g) / inter**0.5
    return w13, w2


def random_call(T: int, k: int, E: int, H: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=g)
    k = min(k, E)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    if T > 2:
        ids[0, 0] = -1  # a skipped slot
    weights = torch.rand(T, k, generator=g)
    return hidden, ids, weights


def experts_at_least(ids: torch.Tensor, n: int) -> int:
    counts = torch.bincount(ids[ids >= 0].flatten())
    return int((counts >= n).sum())


def test_int_path_is_selected_per_isa():
    for isa in supported_isas():
        with CpuExpertPool(num_threads=2, isa=isa) as pool:
            assert pool.int_isa == INT_PATHS.get(isa, ""), isa
            if pool.int_isa:
                # from 1 token per expert (measured faster on both with packed rows)
                assert pool.int_min_tokens == 1
                assert pool.pack_rows
                assert pool.int_tiles_from == (8 if pool.int_isa == "amx-int8" else 0)
            else:
                assert pool.int_min_tokens == 0
                assert not pool.pack_rows
                with pytest.raises(ValueError):
                    pool.int_min_tokens = 1


@pytest.mark.parametrize("isa", INT_ISAS)
@pytest.mark.parametrize("fmt,group", FORMATS)
@pytest.mark.parametrize("layer_seed", [1, 2, 3])
def test_parity_with_quantized_activation_reference(isa, fmt, group, layer_seed):
    w13, w2 = random_layer(layer_seed)
    E, two_i, H = w13.shape
    dq13, dq2 = quantize(w13, fmt, group), quantize(w2, fmt, group)
    with CpuExpertPool(num_threads=2, isa=isa, int_min_tokens=1) as pool:
        pool.add_layer(0, w13, w2, fmt, group)
        for i, (T, k) in enumerate(CALLS):
            hidden, ids, weights = random_call(T, k, E, H, seed=100 * layer_seed + i)
            pool.reset_phase_stats()
            out = pool.forward(0, hidden, ids, weights)
            stats = pool.phase_stats()
            # Every active expert took the integer path (one node here), none the float one.
            assert stats["int_experts"] == int(ids[ids >= 0].unique().numel()), stats
            assert stats["float_experts"] == 0 and stats["int_items"] > 0, stats
            acts = int_path_activations(fmt, pool.int_tiles_from, group=group)
            ref_q = moe_reference(hidden, dq13, dq2, ids, weights, quantize_acts=acts)
            ref = moe_reference(hidden, dq13, dq2, ids, weights)
            assert torch.isfinite(out).all()
            label = f"{isa} {fmt}/{group} E={E} I={two_i // 2} H={H} T={T} k={k}"
            assert rel_err(out, ref_q) < INT_EXACT_TOL, label
            assert rel_err(out, ref) < INT_FP32_TOL, label


# Tokens an expert such that the AMX tiles see every shape of token block: 16 tokens, and a last
# block of 1-4 (int4: 4 blocks of 32 side by side in a C tile where K / 32 allows), 5-8 (2) or
# 9-15 (1); 1-7 stay on VNNI.
TOKEN_BLOCK_COUNTS = [1, 7, 8, 9, 12, 16, 17, 20, 22, 29, 32, 35]


@pytest.mark.parametrize("isa", INT_ISAS)
@pytest.mark.parametrize("fmt,group", FORMATS)
# K / 32: 20, 3 / 18, 5 / 34, 3 (1088: 17 chunks of 64, past 16 of them).
@pytest.mark.parametrize("H,inter", [(640, 96), (576, 160), (1088, 96)])
def test_every_token_block_shape_matches_the_reference(isa, fmt, group, H, inter):
    """Expert e gets exactly TOKEN_BLOCK_COUNTS[e] tokens (top-1), so every tile layout the AMX
    int8 kernel picks by a token block's size runs, on K / 32 both a multiple of 4 and not; the
    result is the quantized-activation reference's (on VNNI machines: the same check of VNNI)."""
    E = len(TOKEN_BLOCK_COUNTS)
    g = torch.Generator().manual_seed(23)
    w13 = torch.randn(E, 2 * inter, H, generator=g) / H**0.5
    w2 = torch.randn(E, H, inter, generator=g) / inter**0.5
    ids = torch.cat([torch.full((c,), e) for e, c in enumerate(TOKEN_BLOCK_COUNTS)])
    ids = ids[torch.randperm(ids.numel(), generator=g)].view(-1, 1)
    hidden = torch.randn(ids.shape[0], H, generator=g)
    weights = torch.rand(ids.shape[0], 1, generator=g) + 0.5
    dq13, dq2 = quantize(w13, fmt, group), quantize(w2, fmt, group)
    with CpuExpertPool(num_threads=2, isa=isa, int_min_tokens=1) as pool:
        pool.add_layer(0, w13, w2, fmt, group)
        out = pool.forward(0, hidden, ids, weights)
        assert pool.phase_stats()["int_experts"] == E
        acts = int_path_activations(fmt, pool.int_tiles_from, group=group)
    ref_q = moe_reference(hidden, dq13, dq2, ids, weights, quantize_acts=acts)
    for e, c in enumerate(TOKEN_BLOCK_COUNTS):  # per expert, so one bad layout cannot hide
        rows = (ids[:, 0] == e).nonzero().flatten()
        assert rel_err(out[rows], ref_q[rows]) < INT_EXACT_TOL, (isa, fmt, group, H, c)


@pytest.mark.parametrize("isa", INT_ISAS)
def test_int8_tiles_take_16_bit_activations(isa):
    """Where the pool has AMX tiles, an int8 expert with enough tokens for them multiplies 16-bit
    activations (one scale per token): its error against the fp32 reference on the same
    dequantized weights is ~100x below the 8-bit blocks' of VNNI, which experts under the
    threshold keep."""
    w13, w2 = random_layer(19)
    E, _, H = w13.shape
    dq13, dq2 = quantize(w13, "int8"), quantize(w2, "int8")
    g = torch.Generator().manual_seed(19)
    ids = torch.cat([torch.zeros(40, 1, dtype=torch.long), torch.ones(3, 1, dtype=torch.long)])
    hidden, weights = torch.randn(43, H, generator=g), torch.rand(43, 1, generator=g) + 0.5
    with CpuExpertPool(num_threads=2, isa=isa, int_min_tokens=1) as pool:
        pool.add_layer(0, w13, w2, "int8")
        out = pool.forward(0, hidden, ids, weights)
        tiles_from = pool.int_tiles_from
    ref = moe_reference(hidden, dq13, dq2, ids, weights)
    many, few = rel_err(out[:40], ref[:40]), rel_err(out[40:], ref[40:])
    assert 3e-3 < few < INT_FP32_TOL, few  # 3 tokens: 8-bit blocks everywhere
    if tiles_from and tiles_from <= 40:
        assert many < 3e-4, many
    else:
        assert 3e-3 < many < INT_FP32_TOL, many


@pytest.mark.parametrize("isa", INT_ISAS)
@pytest.mark.parametrize("fmt,group", FORMATS)
def test_threshold_picks_the_path_per_expert(isa, fmt, group):
    """Default threshold: experts with >= int_min_tokens tokens take the integer path, the rest
    the float path, in one call; 0 turns it off (the float path's own bf16 tolerance holds)."""
    w13, w2 = random_layer(7)
    E, _, H = w13.shape
    dq13, dq2 = quantize(w13, fmt, group), quantize(w2, fmt, group)
    hidden, ids, weights = random_call(9, 2, E, H, seed=9)
    ids[:4] = torch.tensor([0, 1])  # experts 0 and 1: >= 4 tokens; some others 1 or 2
    ref = moe_reference(hidden, dq13, dq2, ids, weights)
    with CpuExpertPool(num_threads=2, isa=isa) as pool:
        pool.add_layer(0, w13, w2, fmt, group)
        for threshold in (pool.int_min_tokens, 3, 0):
            pool.int_min_tokens = threshold
            pool.reset_phase_stats()
            out = pool.forward(0, hidden, ids, weights)
            stats = pool.phase_stats()
            active = int(ids[ids >= 0].unique().numel())
            n_int = experts_at_least(ids, threshold) if threshold else 0
            assert stats["int_experts"] == n_int, (threshold, stats)
            assert stats["float_experts"] == active - n_int, (threshold, stats)
            assert rel_err(out, ref) < (INT_FP32_TOL if n_int else 1.5e-2), threshold


@pytest.mark.parametrize("isa", INT_ISAS)
def test_bf16_layers_never_take_the_integer_path(isa):
    w13, w2 = random_layer(11)
    E, _, H = w13.shape
    hidden, ids, weights = random_call(64, 4, E, H, seed=11)
    with CpuExpertPool(num_threads=2, isa=isa, int_min_tokens=1) as pool:
        pool.add_layer(0, w13, w2, "bf16")
        pool.forward(0, hidden, ids, weights)
        stats = pool.phase_stats()
        assert stats["int_experts"] == 0 and stats["float_experts"] > 0


@pytest.mark.parametrize("isa", INT_ISAS)
def test_int_path_with_node_shards(isa):
    """Two pretend NUMA nodes: each shard's slice of I starts at a multiple of 64, so the
    activation blocks of the down projection line up with the whole row's."""
    w13, w2 = random_layer(13)
    E, _, H = w13.shape
    dq13, dq2 = quantize(w13, "int4", 32), quantize(w2, "int4", 32)
    hidden, ids, weights = random_call(40, 4, E, H, seed=13)
    with CpuExpertPool(num_threads=2, isa=isa, split_nodes=2, int_min_tokens=1) as pool:
        pool.add_layer(0, w13, w2, "int4", 32)
        out = pool.forward(0, hidden, ids, weights)
        assert pool.phase_stats()["int_experts"] > 0
    ref_q = moe_reference(hidden, dq13, dq2, ids, weights, quantize_acts=True)  # int4: blocks
    assert rel_err(out, ref_q) < INT_EXACT_TOL


def test_phase_stats_account_for_the_call():
    with CpuExpertPool(num_threads=2) as pool:
        w13, w2 = random_layer(17)
        E, _, H = w13.shape
        pool.add_layer(0, w13, w2, "int8")
        hidden, ids, weights = random_call(32, 4, E, H, seed=17)
        pool.reset_phase_stats()
        for _ in range(3):
            pool.forward(0, hidden, ids, weights)
        s = pool.phase_stats()
        assert s["calls"] == 3 and s["tokens"] == 96
        assert s["pairs"] == 3 * int((ids >= 0).sum())
        assert s["job_ns"] > 0 and s["busy_ns"]["gate_up"] > 0 and s["busy_ns"]["down"] > 0
        assert (
            set(s["busy_ns"])
            == set(s["wall_ns"])
            == {"wake", "prep_x", "gate_up", "silu", "prep_act", "down", "reduce", "stall"}
        )
        assert s["busy_ns"]["prep_x"] > 0 and s["busy_ns"]["prep_act"] > 0
        # the preps overlap gate/up (one stream of work items): no wall of their own
        assert s["wall_ns"]["prep_x"] == s["wall_ns"]["prep_act"] == 0
        walls = sum(s["wall_ns"].values())
        assert 0 < walls <= s["job_ns"] * 1.05 + 1e6  # phases of worker 0 fit in the job
        pool.reset_phase_stats()
        assert pool.phase_stats()["calls"] == 0


def test_env_var(monkeypatch):
    monkeypatch.setenv(pool_mod.INT_PATH_ENV, "off")
    with CpuExpertPool(num_threads=1) as pool:
        assert pool.int_min_tokens == 0
    monkeypatch.setenv(pool_mod.INT_PATH_ENV, "bogus")
    with pytest.raises(ValueError):
        CpuExpertPool(num_threads=1)
    if INT_ISAS:
        monkeypatch.setenv(pool_mod.INT_PATH_ENV, "5")
        with CpuExpertPool(num_threads=1, isa=INT_ISAS[-1]) as pool:
            assert pool.int_min_tokens == 5


def test_int_path_activations_follow_the_tiles_per_format():
    """The reference's quantizer per expert token count: VNNI's 32-blocks below the tiles; on
    them 16-bit rows for packed int8, 64-blocks for int4 in groups of 64, 32-blocks otherwise;
    int4 without its group size is refused (its tiles depend on it)."""
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(1)) * torch.linspace(
        0.1, 4, 256
    )
    below, b32, b64 = quantize_activations(x), quantize_activations(x), quantize_activations(x, 64)
    assert not torch.equal(b32, b64)
    cases = [  # (fmt, packed, group, tokens) -> expected
        ("int4", True, 64, 7, below),
        ("int4", True, 64, 8, b64),
        ("int4", True, 32, 8, b32),
        ("int8", True, 0, 8, quantize_activations_row16(x)),
        ("int8", False, 0, 8, b32),
    ]
    for fmt, packed, group, n, want in cases:
        got = int_path_activations(fmt, 8, packed=packed, group=group)(n)(x)
        assert torch.equal(got, want), (fmt, packed, group, n)
    assert torch.equal(int_path_activations("int4", 0, group=64)(100)(x), b32)  # no tiles
    with pytest.raises(ValueError, match="group size"):
        int_path_activations("int4", 8)

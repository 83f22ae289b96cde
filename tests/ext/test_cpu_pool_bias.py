"""Expert biases and GPT-OSS's clamped SwiGLU in the CPU expert pool (`set_expert_act`) against
the float32 torch reference with the same biases and activation, in every format and on every
ISA path this machine has: the float kernels, the integer path (VNNI / AMX int8) from one token
an expert, AMX tiles at many tokens. The activation is chosen per layer: a bias-free SiLU layer
in the same pool keeps its exact output."""

from __future__ import annotations

import pytest
import torch

from tandem.ext.cpu import CpuExpertPool, moe_reference, quantize
from tandem.ext.cpu.reference import int_path_activations
from tandem.models.layers.experts import ClampedSwiGLU
from tests.ext.test_cpu_int8_path import INT_EXACT_TOL
from tests.ext.test_cpu_pool import FORMATS, ISAS, make_inputs, make_layer, rel_err, tol

# limit 1: the clamps bite on a good share of these N(0, 1)-sized gate/up values
ACT = ClampedSwiGLU(alpha=1.702, limit=1.0)


def make_biases(E: int, inter: int, H: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(E, 2 * inter, generator=g) * 0.5, torch.randn(E, H, generator=g) * 0.5


def reference(hidden, ids, weights, w13, w2, b13, b2, fmt, group, quantize_acts=False):
    return moe_reference(
        hidden, quantize(w13, fmt, group), quantize(w2, fmt, group), ids, weights,
        quantize_acts, b13=b13, b2=b2, activation=ACT,
    )  # fmt: skip


# (isa, fmt, int_min_tokens): each ISA's default paths, and where an ISA has the integer path
# (VNNI on avx512, AMX int8 on amx) every expert on it, from one token
PATHS = [(isa, fmt, None) for isa in ISAS for fmt in FORMATS] + [
    (isa, fmt, 1) for isa in ISAS if isa in ("avx512", "amx") for fmt in ("int8", "int4")
]


@pytest.mark.parametrize(
    "isa,fmt,int_min_tokens",
    PATHS,
    ids=[f"{i}-{f}-{'int' if n else 'default'}" for i, f, n in PATHS],
)
def test_biased_clamped_swiglu_matches_the_reference(isa, fmt, int_min_tokens):
    # E, inter (padded by the pool: 100 -> 128), H, top-k, tokens (1: decode; 300 on 3
    # experts: ~200 tokens an expert, AMX tile blocks), int4 group
    cases = [(6, 100, 136, 2, 1, 32), (8, 64, 128, 3, 17, 64), (3, 96, 160, 2, 300, 32)]
    with CpuExpertPool(num_threads=2, isa=isa) as pool:
        if int_min_tokens is not None:
            assert pool.int_isa, isa
            pool.int_min_tokens = int_min_tokens
        for layer, (E, inter, H, k, T, group) in enumerate(cases):
            w13, w2 = make_layer(E, inter, H, seed=layer)
            b13, b2 = make_biases(E, inter, H, seed=layer)
            pool.add_layer(layer, w13, w2, fmt, group)
            pool.set_expert_act(layer, b13, b2, (ACT.alpha, ACT.limit))
            hidden, ids, weights = make_inputs(T, H, E, k, seed=layer)
            ids[0, -1] = -1  # a slot placed elsewhere (GPU): no expert, no bias
            out = pool.forward(layer, hidden, ids, weights)
            ref = reference(hidden, ids, weights, w13, w2, b13, b2, fmt, group)
            err = rel_err(out, ref)
            assert torch.isfinite(out).all() and err < tol(isa, fmt), (layer, err)
            if pool.int_isa and fmt != "bf16" and int_min_tokens == 1:
                # the integer path quantizes both projections' inputs: its own reference
                acts = int_path_activations(
                    fmt, pool.int_tiles_from, pool.layer_packed(layer), group=group
                )
                ref_q = reference(hidden, ids, weights, w13, w2, b13, b2, fmt, group, acts)
                assert rel_err(out, ref_q) < INT_EXACT_TOL, (layer, rel_err(out, ref_q))


@pytest.mark.parametrize("isa", ISAS)
def test_the_activation_is_per_layer_and_reset_by_add_layer(isa):
    E, inter, H, k = 6, 64, 128, 2
    w13, w2 = make_layer(E, inter, H, seed=7)
    b13, b2 = make_biases(E, inter, H, seed=7)
    hidden, ids, weights = make_inputs(9, H, E, k, seed=7)
    with CpuExpertPool(num_threads=2, isa=isa) as pool:
        pool.add_layer(0, w13, w2, "int4", 32)
        plain = pool.forward(0, hidden, ids, weights)
        pool.add_layer(1, w13, w2, "int4", 32)
        pool.set_expert_act(1, b13, b2, (ACT.alpha, ACT.limit))
        biased = pool.forward(1, hidden, ids, weights)
        assert rel_err(biased, plain) > 0.1  # the biases and clamps change the output
        torch.testing.assert_close(pool.forward(0, hidden, ids, weights), plain, rtol=0, atol=0)
        # each part alone: biases with SiLU, the clamped SwiGLU without biases
        for parts in ((b13, b2, None), (None, None, ACT), (b13, None, None), (None, b2, None)):
            pool.set_expert_act(1, parts[0], parts[1], parts[2] and (ACT.alpha, ACT.limit))
            ref = moe_reference(
                hidden, quantize(w13, "int4", 32), quantize(w2, "int4", 32), ids, weights,
                b13=parts[0], b2=parts[1], activation=parts[2],
            )  # fmt: skip
            assert rel_err(pool.forward(1, hidden, ids, weights), ref) < tol(isa, "int4")
        pool.set_expert_act(1)  # back to bias-free SiLU: bit for bit the plain layer
        torch.testing.assert_close(pool.forward(1, hidden, ids, weights), plain, rtol=0, atol=0)
        pool.set_expert_act(1, b13, b2, (ACT.alpha, ACT.limit))
        pool.add_layer(1, w13, w2, "int4", 32)  # a replaced layer starts bias-free
        torch.testing.assert_close(pool.forward(1, hidden, ids, weights), plain, rtol=0, atol=0)


def test_node_shards_add_the_down_bias_once():
    """Two pretend NUMA nodes each hold half of every expert's intermediate columns (and of the
    gate/up biases); the down bias is added once per routed slot, not once per node."""
    E, inter, H, k = 5, 192, 128, 2
    w13, w2 = make_layer(E, inter, H, seed=9)
    b13, b2 = make_biases(E, inter, H, seed=9)
    hidden, ids, weights = make_inputs(7, H, E, k, seed=9)
    with CpuExpertPool(num_threads=2, isa="scalar", split_nodes=2) as pool:
        pool.add_layer(0, w13, w2, "bf16")
        assert len(pool.layer_shards(0)) == 2
        pool.set_expert_act(0, b13, b2, (ACT.alpha, ACT.limit))
        out = pool.forward(0, hidden, ids, weights)
    ref = reference(hidden, ids, weights, w13, w2, b13, b2, "bf16", 64)
    assert rel_err(out, ref) < tol("scalar", "bf16")


def test_bad_biases_are_refused():
    w13, w2 = make_layer(4, 32, 64, seed=1)
    with CpuExpertPool(num_threads=1, isa="scalar") as pool:
        pool.add_layer(0, w13, w2, "bf16")
        with pytest.raises(ValueError, match=r"b13 must be .*\(4, 64\)"):
            pool.set_expert_act(0, torch.zeros(4, 32), None)
        with pytest.raises(ValueError, match=r"b2 must be .*\(4, 64\)"):
            pool.set_expert_act(0, None, torch.zeros(3, 64))
        with pytest.raises(ValueError, match="limit must be positive"):
            pool.set_expert_act(0, clamped_swiglu=(1.702, 0.0))
        with pytest.raises(ValueError, match="layer 3 has not been added"):
            pool.set_expert_act(3)

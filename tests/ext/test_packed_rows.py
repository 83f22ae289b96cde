"""Packed int8/int4 rows (ext/cpu/kernels.h: packed_at): the pool stores them in the order the
integer path's 1-token kernel reads, where the CPU has that path. Packing only permutes a row's
bytes (int8) or nibbles (int4), so a packed pool must give exactly what a natural one gives:
same weights, bit-identical outputs on the integer path (int32 sums are order-free) and on the
float path (which unpacks a work item's rows first), and the same files round-trip either way.
One exception: the AMX tiles take 16-bit activations on packed int8 rows, 8-bit blocks on
natural ones; there each pool matches its own quantized reference.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tandem.ext.cpu import CpuExpertPool, moe_reference, supported_isas
from tandem.ext.cpu.layout import packed_index
from tandem.ext.cpu.reference import int_path_activations

INT_ISAS = [isa for isa in supported_isas() if isa in ("avx512", "amx")]
needs_int_path = pytest.mark.skipif(not INT_ISAS, reason="CPU has no AVX-512 VNNI")
FORMATS = [("int8", 64), ("int4", 32), ("int4", 64)]
# (E, I, H): K of w13 is H padded to 64, of w2 I padded to 64; a last super-block of 512
# elements with 2..14 blocks (Hp 1152: 2 full + 4 blocks; Is 192: 6; Hp 64: 2).
SHAPES = [(4, 160, 1100), (3, 700, 64), (5, 96, 512)]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out - ref).norm() / ref.norm().clamp_min(1e-12)).item()


def _layer(E: int, inter: int, H: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(E, 2 * inter, H, generator=g) / H**0.5,
        torch.randn(E, H, inter, generator=g) / inter**0.5,
    )


def _call(T: int, E: int, H: int, k: int = 3, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[: min(k, E)] for _ in range(T)])
    return torch.randn(T, H, generator=g), ids, torch.rand(ids.shape, generator=g)


def test_packed_index_is_a_permutation_with_the_documented_order() -> None:
    """Element 32 l + 4 j + b of a super-block: int8 byte 4m j + 4 l + b; int4 low nibble of
    byte 4m u + 4 l + b for the first 16 of a block, high for the rest (m = its blocks)."""
    for fmt, k in [("int8", 64), ("int8", 1152), ("int4", 192), ("int4", 1536)]:
        idx = packed_index(fmt, k)
        slots = k if fmt == "int8" else k  # int4: 2 * (k / 2) nibble slots
        assert torch.equal(idx.sort().values, torch.arange(slots))
    idx = packed_index("int8", 1152)  # super-block 2 has m = 4 blocks
    assert idx[1024 + 32 * 3 + 4 * 5 + 2] == 1024 + 16 * 5 + 4 * 3 + 2
    idx = packed_index("int4", 1152)
    assert idx[1024 + 32 * 3 + 4 * 2 + 1] == 2 * (512 + 16 * 2 + 4 * 3 + 1)
    assert idx[1024 + 32 * 3 + 16 + 4 * 2 + 1] == 2 * (512 + 16 * 2 + 4 * 3 + 1) + 1


@needs_int_path
@pytest.mark.parametrize("isa", INT_ISAS)
@pytest.mark.parametrize("fmt,group", FORMATS)
@pytest.mark.parametrize("E,inter,H", SHAPES)
@pytest.mark.parametrize("split", [0, 2])
def test_packed_pool_equals_natural_pool(isa, fmt, group, E, inter, H, split) -> None:
    w13, w2 = _layer(E, inter, H)
    with (
        CpuExpertPool(2, isa=isa, split_nodes=split) as packed,
        CpuExpertPool(2, isa=isa, split_nodes=split, pack_rows=False) as natural,
    ):
        assert packed.pack_rows and not natural.pack_rows
        packed.add_layer(0, w13, w2, fmt, group)
        natural.add_layer(0, w13, w2, fmt, group)
        assert packed.layer_packed(0) and not natural.layer_packed(0)
        assert all(s.packed for s in packed.layer_shards(0))
        for a, b in zip(packed.dequantize(0), natural.dequantize(0), strict=True):
            assert torch.equal(a, b)
        # the rows really are permuted (not stored twice the same way)
        sp, sn = packed.layer_shards(0)[0], natural.layer_shards(0)[0]
        assert not torch.equal(packed.shard_memory(sp), natural.shard_memory(sn))
        # integer path from 1 token (packed rows in place; the AMX tiles unpack int4 rows), then
        # the float path (unpacked first)
        tiles_from = packed.int_tiles_from if fmt == "int8" else 0
        d13, d2 = packed.dequantize(0)
        for threshold in (1, 0):
            packed.int_min_tokens = natural.int_min_tokens = threshold
            for T in (1, 2, 7, 40):
                x, ids, wts = _call(T, E, H, seed=T)
                a, b = packed.forward(0, x, ids, wts), natural.forward(0, x, ids, wts)
                if threshold and tiles_from and ids.flatten().bincount().max() >= tiles_from:
                    # AMX tiles on packed int8 rows take 16-bit activations, on natural ones
                    # 8-bit blocks: each matches its own reference
                    for out, is_packed in ((a, True), (b, False)):
                        acts = int_path_activations(fmt, tiles_from, packed=is_packed, group=group)
                        ref = moe_reference(x, d13, d2, ids, wts, quantize_acts=acts)
                        assert rel_err(out, ref) < 2e-3, (is_packed, T)
                else:
                    assert torch.equal(a, b)


@needs_int_path
def test_bf16_layers_are_never_packed() -> None:
    with CpuExpertPool(1) as pool:
        pool.add_layer(0, *_layer(2, 64, 64), "bf16")
        assert pool.pack_rows and not pool.layer_packed(0)
        assert not pool.layer_shards(0)[0].packed


@needs_int_path
@pytest.mark.parametrize("fmt,group", FORMATS)
def test_files_keep_their_layout(fmt, group, tmp_path: Path) -> None:
    """A packed file loads packed into a pool that would not pack (and into one on the scalar
    kernels, which unpacks it row by row), a natural file natural into one that would: every
    one computes what the converting pool does."""
    E, inter, H = 4, 160, 600
    w13, w2 = _layer(E, inter, H, seed=3)
    x, ids, wts = _call(5, E, H)
    for save_packed in (True, False):
        with CpuExpertPool(2, pack_rows=save_packed) as saver:
            saver.add_layer(0, w13, w2, fmt, group)
            saver.save_layer(0, tmp_path / "l.bin")
        for load_packs, isa, split in [(not save_packed, None, 0), (True, "scalar", 0),
                                       (not save_packed, None, 2)]:  # fmt: skip
            with (
                CpuExpertPool(2, isa=isa, split_nodes=split, pack_rows=load_packs) as pool,
                CpuExpertPool(2, isa=isa, split_nodes=split, pack_rows=save_packed) as ref,
            ):
                pool.load_layer(0, tmp_path / "l.bin")
                assert pool.layer_packed(0) == save_packed
                ref.add_layer(0, w13, w2, fmt, group)
                assert torch.equal(pool.forward(0, x, ids, wts), ref.forward(0, x, ids, wts))


def test_pack_rows_option_is_checked() -> None:
    with pytest.raises(ValueError, match="bool"):
        CpuExpertPool(1, pack_rows=1)  # type: ignore[arg-type]
    with CpuExpertPool(1, isa="scalar") as pool:
        assert not pool.pack_rows  # no integer path: nothing reads packed rows in place
        pool.pack_rows = True  # allowed: the float path unpacks (tests, files from elsewhere)
        pool.add_layer(0, *_layer(2, 64, 128), "int4", 32)
        assert pool.layer_packed(0)
        assert pool.info()["pack_rows"] is True


def test_env_var(monkeypatch) -> None:
    from tandem.ext.cpu import pool as pool_mod

    monkeypatch.setenv(pool_mod.PACK_ROWS_ENV, "off")
    with CpuExpertPool(1) as pool:
        assert not pool.pack_rows
    with CpuExpertPool(1, pack_rows=True) as pool:  # the argument wins
        assert pool.pack_rows
    monkeypatch.setenv(pool_mod.PACK_ROWS_ENV, "on")
    with CpuExpertPool(1, isa="scalar") as pool:
        assert pool.pack_rows
    monkeypatch.setenv(pool_mod.PACK_ROWS_ENV, "sometimes")
    with pytest.raises(ValueError, match="TANDEM_CPU_PACK_ROWS"):
        CpuExpertPool(1)

"""ext/cpu/layout.py: the pool's converted weights read back from its raw shard memory, and
the CUDA widening kernel against that torch reference (GPU)."""

from __future__ import annotations

import pytest
import torch

from tandem.ext.cpu import CpuExpertPool
from tandem.ext.cpu.layout import blocked_to_hf, dequantize, shard_weights, split_shard
from tandem.ext.cpu.layout import packed_index as ext_packed_index

CASES = [("bf16", 64), ("int8", 64), ("int4", 64), ("int4", 32)]
SHAPES = [(4, 96, 80, 0), (3, 200, 128, 2), (2, 64, 64, 0), (5, 33, 70, 3)]


@pytest.mark.parametrize("fmt,group", CASES)
@pytest.mark.parametrize("E,inter,H,split", SHAPES)
@pytest.mark.parametrize("pack", [False, True])
def test_shard_views_equal_the_pools_dequantize(fmt, group, E, inter, H, split, pack) -> None:
    """Every shard's region, read with the layout, gives exactly the pool's own dequantized
    weights (HF order), node shards (split_nodes) included, int rows natural or packed;
    padding is zero."""
    gen = torch.Generator().manual_seed(E * 1000 + inter + H)
    w13 = torch.randn(E, 2 * inter, H, generator=gen)
    w2 = torch.randn(E, H, inter, generator=gen)
    with CpuExpertPool(2, split_nodes=split, pack_rows=pack) as pool:
        pool.add_layer(0, w13, w2, fmt, group)
        assert all(s.packed == (pack and fmt != "bf16") for s in pool.layer_shards(0))
        want13, want2 = pool.dequantize(0)
        got13 = torch.full_like(want13, float("nan"))
        got2 = torch.full_like(want2, float("nan"))
        shards = pool.layer_shards(0)
        assert len(shards) == max(split, 1) or sum(s.Iv for s in shards) == inter
        for s in shards:
            if s.Is == 0:
                continue
            a, b = shard_weights(pool.shard_memory(s), s, torch.float32)
            assert a.shape == (E, 2 * s.Is, s.Hp) and b.shape == (E, s.Hp, s.Is)
            h13, h2 = blocked_to_hf(a, b, s)
            cols = slice(s.i0, s.i0 + s.Iv)
            got13[:, cols] = h13[:, : s.Iv]
            got13[:, inter + s.i0 : inter + s.i0 + s.Iv] = h13[:, s.Iv :]
            got2[:, :, cols] = h2
            # padded rows / columns of the blocked matrices hold zeros
            g = a.view(E, s.Is // 32, 2, 32, s.Hp).transpose(1, 2).reshape(E, 2, s.Is, s.Hp)
            assert torch.all(g[:, :, s.Iv :] == 0) and torch.all(a[..., H:] == 0)
            assert torch.all(b[:, H:] == 0) and torch.all(b[..., s.Iv :] == 0)
        assert torch.equal(got13, want13) and torch.equal(got2, want2)


def test_split_shard_checks_its_input() -> None:
    with CpuExpertPool(1) as pool:
        pool.add_layer(0, torch.randn(2, 128, 64), torch.randn(2, 64, 64), "int4", 64)
        (s,) = pool.layer_shards(0)
        raw = pool.shard_memory(s)
        assert raw.numel() == s.nbytes
        with pytest.raises(ValueError, match="uint8"):
            split_shard(raw[:-1], s)
        with pytest.raises(ValueError, match="uint8"):
            split_shard(raw.view(torch.int8), s)
    with pytest.raises(RuntimeError, match="closed"):
        pool.layer_shards(0)


def _random_rows(fmt: str, E: int, R: int, K: int, group: int, device: str):
    gen = torch.Generator().manual_seed(E + R + K)
    nb = K // 2 if fmt == "int4" else K
    q = torch.randint(0, 256, (E, R, nb + 24), dtype=torch.uint8, generator=gen)[..., :nb]
    spr = 1 if fmt == "int8" else K // group
    s = torch.randn(E, R, spr + 3, generator=gen)[..., :spr]
    return q.to(device), s.to(device)


@pytest.mark.parametrize("fmt,group", [("int8", 0), ("int4", 64), ("int4", 32)])
def test_reference_dequantize_formulas(fmt, group) -> None:
    """int8: q * s; int4: (nibble - 8) * s of its group, byte j of a 64-chunk = j and j + 32."""
    q, s = _random_rows(fmt, 2, 3, 128, group, "cpu")
    got = dequantize(q, s, fmt, group, torch.float32)
    for e in range(2):
        for r in range(3):
            if fmt == "int8":
                want = q[e, r].view(torch.int8).float() * s[e, r, 0]
            else:
                b = q[e, r].view(2, 32)
                nib = torch.cat([b & 15, b >> 4], dim=1).reshape(-1).float() - 8
                want = nib * s[e, r].repeat_interleave(group)
            assert torch.equal(got[e, r], want)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,group", [("int8", 0), ("int4", 64), ("int4", 32)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("E,R,K", [(1, 1, 64), (3, 70, 192), (8, 128, 2048), (2, 9, 1216)])
@pytest.mark.parametrize("packed", [False, True])
def test_cuda_widening_kernel_equals_reference(fmt, group, dtype, E, R, K, packed) -> None:
    """The kernel writes every element (poisoned output) exactly as the reference rounds it,
    from strided views like the raw shard's (rows padded, experts apart), for natural and
    packed rows (K 1216: two full super-blocks and one of 6 blocks)."""
    from tandem.ext.cuda import expert_dequant

    if not torch.cuda.is_available():
        pytest.skip("no CUDA")
    q, s = _random_rows(fmt, E, R, K, group, "cuda")
    assert expert_dequant.supported(q, fmt, dtype)
    out = torch.full((E, R, K), float("nan"), dtype=dtype, device="cuda")
    expert_dequant.dequantize(q, s, fmt, group, dtype, out=out, packed=packed)
    want = dequantize(q, s, fmt, group, dtype, packed)
    assert torch.equal(out, want)
    # without `out`, and the torch fall-back for what the kernel does not take
    assert torch.equal(expert_dequant.dequantize(q, s, fmt, group, dtype, packed=packed), want)
    f32 = expert_dequant.dequantize(q, s, fmt, group, torch.float32, packed=packed)
    assert torch.equal(f32, dequantize(q, s, fmt, group, torch.float32, packed))
    if packed:  # the same weights as natural rows: the packed reference reads them back
        nat = dequantize(q, s, fmt, group, torch.float32)
        idx = torch.argsort(ext_packed_index(fmt, K)).to(q.device)
        if fmt == "int8":
            qp = q[..., idx]
        else:  # natural nibbles -> their packed slots, two a byte (low, high)
            b = q.view(E, R, K // 64, 32)
            nib = torch.cat([b & 15, b >> 4], dim=-1).reshape(E, R, K)[..., idx]
            nib = nib.view(E, R, K // 2, 2)
            qp = nib[..., 0] | (nib[..., 1] << 4)
        wide = expert_dequant.dequantize(qp.contiguous(), s, fmt, group, torch.float16, packed=True)
        assert torch.equal(wide, nat.to(torch.float16))

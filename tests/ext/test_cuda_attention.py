"""CUDA paged-attention and KV-write kernels (ext/cuda) against an independent float32 reference.

GPU tests carry the `gpu` marker (deselected by default) and skip without CUDA/CuPy. The cache
is poisoned with NaN everywhere no token was written (unused blocks, block-table padding, the
tail of each last block) and every output is filled with NaN before the call, so a read past a
sequence or an unwritten output element fails. Set TANDEM_GPU_LOG=path to record errors.
"""

from __future__ import annotations

import itertools
import math
import os
import random

import pytest
import torch

import tandem.ext.cuda as cuda_ext
from tandem.ext.cuda import kernels

_requires_cuda = pytest.mark.skipif(not cuda_ext.is_available(), reason="needs CUDA and CuPy")


def gpu_test(fn):
    """`gpu` marker (deselected on CPU runs) plus a skip where CUDA or CuPy is missing."""
    return pytest.mark.gpu(_requires_cuda(fn))


DTYPES = (torch.bfloat16, torch.float16)
TOL = 1e-2


def _record(family: str, err: float) -> None:
    path = os.environ.get("TANDEM_GPU_LOG")
    if path:
        with open(path, "a") as f:
            f.write(f"{family}\t{err:.3e}\n")


# ---------------------------------------------------------------- float32 reference + inputs


def ref_attention(q, k_cache, v_cache, query_lens, seq_lens, block_tables, scale):
    """Plain float32 causal attention over a paged cache; returns float32 `[T, H, D]`."""
    bs, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // num_kv_heads
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    start = 0
    for i, (ql, sl) in enumerate(zip(query_lens, seq_lens, strict=True)):
        nb = -(-sl // bs)
        blocks = block_tables[i, :nb].long()
        k = k_cache[blocks].reshape(-1, num_kv_heads, k_cache.shape[3])[:sl].float()
        v = v_cache[blocks].reshape(-1, num_kv_heads, v_cache.shape[3])[:sl].float()
        k = k.repeat_interleave(group, dim=1)  # [sl, H, D]
        v = v.repeat_interleave(group, dim=1)
        qi = q[start : start + ql].float()  # [ql, H, D]
        s = torch.einsum("qhd,khd->hqk", qi, k) * scale
        qpos = torch.arange(sl - ql, sl, device=q.device)
        mask = torch.arange(sl, device=q.device)[None, :] <= qpos[:, None]
        s = s.masked_fill(~mask[None], float("-inf"))
        out[start : start + ql] = torch.einsum("hqk,khd->qhd", s.softmax(-1), v)
        start += ql
    return out


def make_batch(
    query_lens, seq_lens, num_heads, num_kv_heads, head_dim, dtype, block_size=16, seed=0
):
    """Random q and a NaN-poisoned paged cache holding K/V of every sequence's first seq_len tokens."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    rng = random.Random(seed)
    dev = "cuda"
    nbs = [-(-sl // block_size) for sl in seq_lens]
    num_blocks = sum(nbs) + 3
    perm = list(range(num_blocks))
    rng.shuffle(perm)
    poison_block = perm.pop()  # block-table padding points at a NaN block
    max_blocks = max(nbs) + 2
    bt = torch.full((len(seq_lens), max_blocks), poison_block, dtype=torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype, device=dev)
    v_cache = torch.full(shape, float("nan"), dtype=dtype, device=dev)
    for i, (nb, sl) in enumerate(zip(nbs, seq_lens, strict=True)):
        blocks = [perm.pop() for _ in range(nb)]
        bt[i, :nb] = torch.tensor(blocks, dtype=torch.int32)
        kk = torch.randn(sl, num_kv_heads, head_dim, generator=g, device=dev).to(dtype)
        vv = torch.randn(sl, num_kv_heads, head_dim, generator=g, device=dev).to(dtype)
        slots = (
            torch.tensor(blocks, device=dev)[:, None] * block_size
            + torch.arange(block_size, device=dev)
        ).flatten()[:sl]
        k_cache.view(-1, num_kv_heads, head_dim)[slots] = kk
        v_cache.view(-1, num_kv_heads, head_dim)[slots] = vv
    q = torch.randn(sum(query_lens), num_heads, head_dim, generator=g, device=dev).to(dtype)
    qsl = torch.tensor([0] + list(itertools.accumulate(query_lens)), dtype=torch.int32, device=dev)
    return (
        q,
        k_cache,
        v_cache,
        qsl,
        torch.tensor(seq_lens, dtype=torch.int32, device=dev),
        bt.to(dev),
    )


def rel_err_per_token(out, ref):
    """max over tokens of ||out_t - ref_t|| / ||ref_t||; NaN anywhere -> inf."""
    out = out.float()
    if not torch.isfinite(out).all():
        return math.inf
    num = (out - ref).flatten(1).norm(dim=1)
    den = ref.flatten(1).norm(dim=1).clamp_min(1e-6)
    return (num / den).max().item()


def run_decode(
    seq_lens, num_heads, num_kv_heads, head_dim, dtype, block_size=16, seed=0, max_seq_len=None
):
    q, kc, vc, qsl, sl, bt = make_batch(
        [1] * len(seq_lens), seq_lens, num_heads, num_kv_heads, head_dim, dtype, block_size, seed
    )
    scale = head_dim**-0.5
    out = torch.full_like(q, float("nan"))
    cuda_ext.paged_decode(q, kc, vc, sl, bt, scale, out=out, max_seq_len=max_seq_len)
    ref = ref_attention(q, kc, vc, [1] * len(seq_lens), seq_lens, bt, scale)
    return rel_err_per_token(out, ref)


def run_extend(pairs, num_heads, num_kv_heads, head_dim, dtype, block_size=16, seed=0):
    """pairs: (prefix_len, query_len) per sequence."""
    query_lens = [ql for _, ql in pairs]
    seq_lens = [p + ql for p, ql in pairs]
    q, kc, vc, qsl, sl, bt = make_batch(
        query_lens, seq_lens, num_heads, num_kv_heads, head_dim, dtype, block_size, seed
    )
    scale = head_dim**-0.5
    out = torch.full_like(q, float("nan"))
    cuda_ext.paged_extend(q, kc, vc, qsl, sl, bt, max(query_lens), scale, out=out)
    ref = ref_attention(q, kc, vc, query_lens, seq_lens, bt, scale)
    return rel_err_per_token(out, ref)


# ---------------------------------------------------------------- CPU-side tests (no GPU)


def test_import_and_ops_registered():
    assert callable(cuda_ext.paged_attention_cuda)
    for name in ("write_kv", "paged_decode", "paged_extend"):
        assert hasattr(torch.ops.tandem, name)


def test_launchers_reject_cpu_tensors():
    kc = torch.zeros(4, 16, 2, 64, dtype=torch.bfloat16)
    q = torch.zeros(2, 4, 64, dtype=torch.bfloat16)
    sl = torch.ones(2, dtype=torch.int32)
    bt = torch.zeros(2, 1, dtype=torch.int32)
    with pytest.raises(ValueError):
        kernels.launch_paged_decode(torch.empty_like(q), q, kc, kc.clone(), sl, bt, 0.1, 16)


@pytest.mark.parametrize("num_seqs", [1, 3, 64, 256])
@pytest.mark.parametrize("max_seq_len", [1, 100, 512, 4096, 32768])
def test_plan_decode_covers_context(num_seqs, max_seq_len):
    part_len, num_parts = kernels.plan_decode(num_seqs, 8, 4, max_seq_len, 132)
    assert part_len * num_parts >= max_seq_len
    assert part_len * (num_parts - 1) < max_seq_len  # no empty partition
    if num_parts > 1:
        assert part_len % 64 == 0


# ---------------------------------------------------------------- GPU: KV write


@gpu_test
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("strided", [False, True])
def test_write_kv_exact(dtype, head_dim, strided):
    torch.manual_seed(1)
    num_blocks, bs, kvh, T = 40, 16, 4, 300
    k_cache = torch.randn(num_blocks, bs, kvh, head_dim, device="cuda").to(dtype)
    v_cache = torch.randn_like(k_cache)
    if strided:  # k, v as views of a fused [T, q + k + v] projection
        fused = torch.randn(T, (8 + 2 * kvh) * head_dim, device="cuda").to(dtype)
        k = fused[:, 8 * head_dim : (8 + kvh) * head_dim].view(T, kvh, head_dim)
        v = fused[:, (8 + kvh) * head_dim :].view(T, kvh, head_dim)
    else:
        k = torch.randn(T, kvh, head_dim, device="cuda").to(dtype)
        v = torch.randn(T, kvh, head_dim, device="cuda").to(dtype)
    slots = torch.randperm(num_blocks * bs, device="cuda")[:T]
    slots[::7] = -1  # padding rows: skipped
    exp_k, exp_v = k_cache.clone(), v_cache.clone()
    keep = slots >= 0
    exp_k.view(-1, kvh, head_dim)[slots[keep]] = k[keep]
    exp_v.view(-1, kvh, head_dim)[slots[keep]] = v[keep]
    cuda_ext.write_kv(k_cache, v_cache, k, v, slots)
    torch.cuda.synchronize()
    assert torch.equal(k_cache.view(torch.int16), exp_k.view(torch.int16))
    assert torch.equal(v_cache.view(torch.int16), exp_v.view(torch.int16))


# ---------------------------------------------------------------- GPU: decode


@gpu_test
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_decode_ragged(dtype, head_dim, group):
    rng = random.Random(group * 1000 + head_dim)
    seq_lens = [1, 16, 17, 255, 1024] + [rng.randint(1, 3000) for _ in range(4)]
    kvh = 2
    err = run_decode(seq_lens, kvh * group, kvh, head_dim, dtype, seed=group + head_dim)
    _record(f"decode ragged {str(dtype)[6:]} D{head_dim} G{group}", err)
    assert err < TOL


@gpu_test
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_many_seqs_no_split(dtype):
    """Enough sequences that the planner uses one partition: the direct-write path."""
    rng = random.Random(5)
    seq_lens = [rng.randint(1, 700) for _ in range(80)]
    assert kernels.plan_decode(80, 8, 4, 720, 132)[1] == 1
    err = run_decode(seq_lens, 32, 8, 128, dtype, seed=3)
    _record(f"decode 80 seqs no-split {str(dtype)[6:]}", err)
    assert err < TOL


@gpu_test
@pytest.mark.parametrize(
    "seq_lens,num_heads,num_kv_heads,head_dim",
    [
        ([32768, 1, 17000, 4097], 32, 8, 128),  # Llama-3-8B heads, G=4
        ([32768, 5], 16, 2, 64),  # G=8
        ([20000, 9000, 300], 8, 8, 128),  # G=1
    ],
)
def test_decode_long_context(seq_lens, num_heads, num_kv_heads, head_dim):
    err = run_decode(seq_lens, num_heads, num_kv_heads, head_dim, torch.bfloat16, seed=7)
    _record(f"decode long {max(seq_lens)} D{head_dim} G{num_heads // num_kv_heads}", err)
    assert err < TOL


@gpu_test
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,block_size",
    [(12, 4, 16), (32, 2, 16), (14, 2, 32), (8, 8, 8), (28, 4, 64)],  # G = 3, 16, 7, 1, 7
)
def test_decode_odd_groups_and_block_sizes(num_heads, num_kv_heads, block_size):
    seq_lens = [1, 33, 700, 2500]
    err = run_decode(seq_lens, num_heads, num_kv_heads, 128, torch.bfloat16, block_size, seed=11)
    _record(f"decode G{num_heads // num_kv_heads} bs{block_size}", err)
    assert err < TOL


@gpu_test
def test_decode_tight_max_seq_len_and_zero_len():
    """An exact max_seq_len hint; a padded entry with seq_len 0 yields zeros, not NaN."""
    err = run_decode([3000, 2999, 1], 32, 8, 128, torch.bfloat16, seed=2, max_seq_len=3000)
    assert err < TOL
    q, kc, vc, qsl, sl, bt = make_batch([1, 1], [50, 1], 32, 8, 128, torch.bfloat16, seed=4)
    sl[1] = 0
    out = torch.full_like(q, float("nan"))
    cuda_ext.paged_decode(q, kc, vc, sl, bt, 0.1, out=out)
    assert torch.equal(out[1].float(), torch.zeros_like(out[1].float()))
    ref = ref_attention(q[:1], kc, vc, [1], [50], bt[:1], 0.1)
    assert rel_err_per_token(out[:1], ref) < TOL


@gpu_test
def test_decode_cuda_graph_replay():
    """Captured once with an upper-bound max_seq_len, replayed with new lengths and tables."""
    num_heads, kvh, d = 32, 8, 128
    q, kc, vc, qsl, sl, bt = make_batch(
        [1] * 4, [4000, 100, 2048, 1], num_heads, kvh, d, torch.bfloat16, seed=21
    )
    q2, kc2, vc2, _, sl2, bt2 = make_batch(
        [1] * 4, [7, 3900, 513, 64], num_heads, kvh, d, torch.bfloat16, seed=22
    )
    # one cache holding both batches' blocks; batch 2's block ids are offset by batch 1's count
    out = torch.full_like(q, float("nan"))
    width = max(bt.shape[1], bt2.shape[1])
    bt_buf = torch.zeros(4, width, dtype=torch.int32, device="cuda")
    bt_buf[:, : bt.shape[1]] = bt
    kc_buf = torch.cat([kc, kc2])
    vc_buf = torch.cat([vc, vc2])
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        cuda_ext.paged_decode(
            q, kc_buf, vc_buf, sl, bt_buf, d**-0.5, out=out, max_seq_len=width * 16
        )
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cuda_ext.paged_decode(
            q, kc_buf, vc_buf, sl, bt_buf, d**-0.5, out=out, max_seq_len=width * 16
        )
    # replay with batch 2 (its blocks offset by batch 1's block count)
    q.copy_(q2)
    sl.copy_(sl2)
    bt_buf.zero_()
    bt_buf[:, : bt2.shape[1]] = bt2 + kc.shape[0]
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    ref = ref_attention(q2, kc2, vc2, [1] * 4, [7, 3900, 513, 64], bt2, d**-0.5)
    err = rel_err_per_token(out, ref)
    _record("decode cuda-graph replay", err)
    assert err < TOL


# ---------------------------------------------------------------- GPU: extend


MIXED = [(0, 37), (100, 1), (513, 64), (5, 200), (1000, 130), (0, 1), (47, 16)]


@gpu_test
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_extend_mixed_batch(dtype, head_dim, group):
    err = run_extend(MIXED, 2 * group, 2, head_dim, dtype, seed=group + head_dim)
    _record(f"extend mixed {str(dtype)[6:]} D{head_dim} G{group}", err)
    assert err < TOL


@gpu_test
@pytest.mark.parametrize(
    "pairs,num_heads,num_kv_heads,head_dim,block_size",
    [
        ([(30000, 100), (0, 300), (2000, 1)], 32, 8, 128, 16),  # long prefix
        ([(0, 1000), (3000, 257)], 12, 4, 64, 32),  # G=3, block 32
        ([(16, 16), (0, 63), (64, 65)], 28, 4, 128, 16),  # G=7, tile edges
    ],
)
def test_extend_long_and_odd(pairs, num_heads, num_kv_heads, head_dim, block_size):
    err = run_extend(pairs, num_heads, num_kv_heads, head_dim, torch.bfloat16, block_size, seed=9)
    _record(
        f"extend prefix {max(p for p, _ in pairs)} G{num_heads // num_kv_heads} bs{block_size}", err
    )
    assert err < TOL


@gpu_test
def test_extend_strided_q():
    """q as a view of a fused qkv projection (row stride != H * D)."""
    pairs = [(10, 40), (300, 7)]
    H, kvh, d = 16, 4, 128
    query_lens = [ql for _, ql in pairs]
    seq_lens = [p + ql for p, ql in pairs]
    q, kc, vc, qsl, sl, bt = make_batch(query_lens, seq_lens, H, kvh, d, torch.bfloat16, seed=13)
    fused = torch.randn(q.shape[0], (H + 2 * kvh) * d, device="cuda").to(torch.bfloat16)
    fused[:, : H * d] = q.flatten(1)
    qv = fused[:, : H * d].view(-1, H, d)
    out = cuda_ext.paged_extend(qv, kc, vc, qsl, sl, bt, max(query_lens), d**-0.5)
    ref = ref_attention(q, kc, vc, query_lens, seq_lens, bt, d**-0.5)
    assert rel_err_per_token(out, ref) < TOL


# ---------------------------------------------------------------- GPU: dispatch, compile, ops


@gpu_test
def test_paged_attention_cuda_dispatch():
    H, kvh, d = 32, 8, 128
    for pairs in ([(100, 1), (5000, 1), (0, 1)], MIXED):
        query_lens = [ql for _, ql in pairs]
        seq_lens = [p + ql for p, ql in pairs]
        q, kc, vc, qsl, sl, bt = make_batch(
            query_lens, seq_lens, H, kvh, d, torch.bfloat16, seed=17
        )
        out = torch.full_like(q, float("nan"))
        res = cuda_ext.paged_attention_cuda(
            q, kc, vc, qsl, sl, bt, max(query_lens), d**-0.5, out=out
        )
        assert res is out
        ref = ref_attention(q, kc, vc, query_lens, seq_lens, bt, d**-0.5)
        assert rel_err_per_token(out, ref) < TOL


@gpu_test
def test_matches_attention_ref():
    """Parity with the project's pure-torch backend (ext/attention_ref.py) on a mixed batch."""
    attention_ref = pytest.importorskip("tandem.ext.attention_ref")
    H, kvh, d = 32, 8, 128
    query_lens = [ql for _, ql in MIXED]
    seq_lens = [p + ql for p, ql in MIXED]
    q, kc, vc, qsl, sl, bt = make_batch(query_lens, seq_lens, H, kvh, d, torch.bfloat16, seed=19)
    kc = torch.nan_to_num(kc)  # the reference gathers whole blocks; keep its padding finite
    vc = torch.nan_to_num(vc)
    ours = cuda_ext.paged_attention_cuda(q, kc, vc, qsl, sl, bt, max(query_lens), d**-0.5)
    theirs = attention_ref.paged_attention(q, kc, vc, query_lens, seq_lens, bt, d**-0.5)
    assert rel_err_per_token(ours, theirs.float()) < TOL


@gpu_test
def test_torch_compile_fullgraph():
    H, kvh, d = 32, 8, 128
    q, kc, vc, qsl, sl, bt = make_batch([1] * 3, [77, 1500, 16], H, kvh, d, torch.bfloat16, seed=23)
    k_new = torch.randn(3, kvh, d, device="cuda").to(torch.bfloat16)
    v_new = torch.randn(3, kvh, d, device="cuda").to(torch.bfloat16)
    slots = torch.stack([bt[0, 76 // 16], bt[1, 1499 // 16], bt[2, 0]]).long() * 16 + torch.tensor(
        [76 % 16, 1499 % 16, 15], device="cuda"
    )

    def step(q, kc, vc, k_new, v_new, slots):
        cuda_ext.write_kv(kc, vc, k_new, v_new, slots)
        return cuda_ext.paged_attention_cuda(q * 1.0, kc, vc, qsl, sl, bt, 1, d**-0.5) + 0.0

    kc_e, vc_e = kc.clone(), vc.clone()
    eager = step(q, kc_e, vc_e, k_new, v_new, slots)
    compiled = torch.compile(step, fullgraph=True)
    kc_c, vc_c = kc.clone(), vc.clone()
    got = compiled(q, kc_c, vc_c, k_new, v_new, slots)
    assert torch.equal(kc_c.view(torch.int16), kc_e.view(torch.int16))
    assert torch.equal(got, eager)


@gpu_test
def test_opcheck():
    q, kc, vc, qsl, sl, bt = make_batch([1, 1], [40, 300], 8, 2, 64, torch.bfloat16, seed=29)
    kc, vc = torch.nan_to_num(kc), torch.nan_to_num(vc)
    out = torch.empty_like(q)
    torch.library.opcheck(torch.ops.tandem.paged_decode.default, (out, q, kc, vc, sl, bt, 0.125, 0))
    out2 = torch.empty_like(q)
    torch.library.opcheck(
        torch.ops.tandem.paged_extend.default, (out2, q, kc, vc, qsl, sl, bt, 1, 0.125)
    )

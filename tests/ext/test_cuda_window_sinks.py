"""Sliding windows and attention sinks in the CUDA paged-attention kernels, against a float32
reference written here and against the project's torch backend (ext/attention_ref.py).

The cache is NaN everywhere no token was written, and the block-table entries wholly behind
every query's window point at a NaN block (as the scheduler releases them), so a kernel that
reads before its window, or a sink added twice, fails. GPU tests carry the `gpu` marker.
"""

from __future__ import annotations

import pytest
import torch

import tandem.ext.cuda as cuda_ext
from tandem.ext.cuda import kernels
from tests.ext.test_cuda_attention import gpu_test, make_batch, rel_err_per_token

TOL = 1e-2


def ref_window_sinks(q, k_cache, v_cache, query_lens, seq_lens, block_tables, scale, window, sinks):
    """Float32 causal attention where a query at p sees keys p - window + 1 .. p (window None:
    all) and `sinks` `[H]` (or None) is one more logit per head in the softmax, dropped after."""
    bs, kvh, d = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    group = q.shape[1] // kvh
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    start = 0
    for i, (ql, sl) in enumerate(zip(query_lens, seq_lens, strict=True)):
        blocks = block_tables[i, : -(-sl // bs)].long()
        k = k_cache[blocks].reshape(-1, kvh, d)[:sl].float().repeat_interleave(group, dim=1)
        v = v_cache[blocks].reshape(-1, kvh, d)[:sl].float().repeat_interleave(group, dim=1)
        qpos = torch.arange(sl - ql, sl, device=q.device)[:, None]
        kpos = torch.arange(sl, device=q.device)[None, :]
        mask = kpos <= qpos
        if window is not None:
            mask &= kpos > qpos - window
        k = torch.where(mask.any(0)[:, None, None], k, 0.0)  # released rows are NaN: never used
        v = torch.where(mask.any(0)[:, None, None], v, 0.0)
        s = torch.einsum("qhd,khd->hqk", q[start : start + ql].float(), k) * scale
        s = s.masked_fill(~mask[None], float("-inf"))
        if sinks is not None:
            s = torch.cat((s, sinks.float()[:, None, None].expand(-1, ql, 1)), dim=-1)
        p = s.softmax(-1)[..., :sl]
        out[start : start + ql] = torch.einsum("hqk,khd->qhd", p, v)
        start += ql
    return out


def release_behind_window(k_cache, v_cache, bt, query_lens, seq_lens, window):
    """Point every block wholly before the first query's window at a fresh NaN block."""
    bs = k_cache.shape[1]
    nan_block = torch.full_like(k_cache[:1], float("nan"))
    k_cache = torch.cat([k_cache, nan_block])
    v_cache = torch.cat([v_cache, nan_block])
    hole = k_cache.shape[0] - 1
    holes = 0
    for i, (ql, sl) in enumerate(zip(query_lens, seq_lens, strict=True)):
        n = max(0, sl - ql - window + 1) // bs
        bt[i, :n] = hole
        holes += n
    return k_cache, v_cache, bt, holes


def run_case(query_lens, seq_lens, heads, kvh, d, window, with_sinks, dtype, bs=16, seed=0,
             max_seq_len=None, release=True):  # fmt: skip
    q, kc, vc, qsl, sl, bt = make_batch(query_lens, seq_lens, heads, kvh, d, dtype, bs, seed)
    holes = 0
    if window is not None and release:
        kc, vc, bt, holes = release_behind_window(kc, vc, bt, query_lens, seq_lens, window)
    gen = torch.Generator(device="cuda").manual_seed(seed + 1)
    sinks = torch.randn(heads, generator=gen, device="cuda") * 2 if with_sinks else None
    scale = d**-0.5
    out = torch.full_like(q, float("nan"))
    cuda_ext.paged_attention_cuda(
        q, kc, vc, qsl, sl, bt, max(query_lens), scale, out=out, max_seq_len=max_seq_len,
        window=window, sinks=sinks,
    )  # fmt: skip
    ref = ref_window_sinks(q, kc, vc, query_lens, seq_lens, bt, scale, window, sinks)
    return rel_err_per_token(out, ref), holes


def test_window_and_sinks_are_checked():
    q = torch.zeros(2, 4, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="window"):
        kernels._check_window_sinks(-1, None, q)
    with pytest.raises(ValueError, match="sinks"):
        kernels._check_window_sinks(8, torch.zeros(3), q)
    assert kernels._check_window_sinks(8, torch.zeros(4, dtype=torch.bfloat16), q).dtype == (
        torch.float32
    )


WINDOWS = (None, 1, 5, 16, 128)


@gpu_test
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim,group", [(64, 8), (128, 4), (64, 1)])
def test_decode_window_sinks(window, with_sinks, dtype, head_dim, group):
    """Decode: contexts shorter and far longer than the window, one and many partitions."""
    seq_lens = [1, 5, 16, 17, 127, 128, 129, 300, 4097, 20000]
    err, holes = run_case(
        [1] * len(seq_lens), seq_lens, 2 * group, 2, head_dim, window, with_sinks, dtype, seed=3
    )
    assert window is None or window > 1000 or holes > 0
    assert err < TOL, err


@gpu_test
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("head_dim,group", [(64, 8), (128, 4), (64, 3)])
def test_extend_window_sinks(window, with_sinks, head_dim, group):
    """Extend: chunks shorter and longer than the window over long prefixes, mixed with
    decode rows; block size 16 and 32."""
    pairs = [(0, 37), (100, 1), (513, 64), (5, 200), (1000, 130), (0, 1), (3000, 300)]
    for bs in (16, 32):
        err, _ = run_case(
            [ql for _, ql in pairs], [p + ql for p, ql in pairs], 2 * group, 2, head_dim, window,
            with_sinks, torch.bfloat16, bs=bs, seed=5,
        )  # fmt: skip
        assert err < TOL, (bs, err)


@gpu_test
def test_sinks_dominate():
    """A sink far above every score takes almost all the mass: the output goes to ~0 (a kernel
    that drops the sink, or adds it to the numerator, fails)."""
    q, kc, vc, qsl, sl, bt = make_batch([1, 1, 40], [50, 3000, 90], 8, 2, 64, torch.bfloat16)
    sinks = torch.full((8,), 30.0, device="cuda")
    for window in (None, 16):
        out = cuda_ext.paged_attention_cuda(
            q, kc, vc, qsl, sl, bt, 40, 0.125, window=window, sinks=sinks
        )
        assert out.float().abs().max().item() < 1e-6
    small = torch.full((8,), -30.0, device="cuda")  # and far below: plain attention
    out = cuda_ext.paged_attention_cuda(q, kc, vc, qsl, sl, bt, 40, 0.125, sinks=small)
    ref = ref_window_sinks(q, kc, vc, [1, 1, 40], [50, 3000, 90], bt, 0.125, None, None)
    assert rel_err_per_token(out, ref) < TOL


@gpu_test
@pytest.mark.parametrize("window", [8, 128])
def test_matches_torch_backend(window):
    """Parity with ext/attention_ref.paged_attention (the torch backend) on a mixed batch."""
    from tandem.ext.attention_ref import paged_attention

    pairs = [(0, 37), (100, 1), (513, 64), (200, 1), (1000, 130)]
    query_lens = [ql for _, ql in pairs]
    seq_lens = [p + ql for p, ql in pairs]
    q, kc, vc, qsl, sl, bt = make_batch(query_lens, seq_lens, 16, 2, 64, torch.bfloat16, seed=7)
    kc, vc = torch.nan_to_num(kc), torch.nan_to_num(vc)  # the reference reads whole blocks
    sinks = torch.randn(16, device="cuda")
    ours = cuda_ext.paged_attention_cuda(
        q, kc, vc, qsl, sl, bt, max(query_lens), 0.125, window=window, sinks=sinks
    )
    theirs = paged_attention(
        q, kc, vc, query_lens, seq_lens, bt, 0.125, window=window, sinks=sinks.to(torch.bfloat16)
    )
    assert rel_err_per_token(ours, theirs.float()) < TOL


@gpu_test
def test_decode_graph_replay_with_window_and_sinks():
    """Captured once (upper-bound max_seq_len, one window), replayed with new lengths, tables
    and holes: the captured plan stays valid."""
    heads, kvh, d, window = 64, 8, 64, 128
    lens1, lens2 = [4000, 100, 2048, 1], [7, 3900, 513, 130]
    q, kc, vc, _, sl, bt = make_batch([1] * 4, lens1, heads, kvh, d, torch.bfloat16, seed=21)
    q2, kc2, vc2, _, sl2, bt2 = make_batch([1] * 4, lens2, heads, kvh, d, torch.bfloat16, seed=22)
    kc2, vc2, bt2, holes = release_behind_window(kc2, vc2, bt2, [1] * 4, lens2, window)
    assert holes > 0
    sinks = torch.randn(heads, device="cuda")
    width = max(bt.shape[1], bt2.shape[1])
    bt_buf = torch.zeros(4, width, dtype=torch.int32, device="cuda")
    bt_buf[:, : bt.shape[1]] = bt
    kc_buf, vc_buf = torch.cat([kc, kc2]), torch.cat([vc, vc2])
    out = torch.empty_like(q)

    def call():
        cuda_ext.paged_decode(
            q, kc_buf, vc_buf, sl, bt_buf, d**-0.5, out=out, max_seq_len=width * 16,
            window=window, sinks=sinks,
        )  # fmt: skip

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        call()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    q.copy_(q2)
    sl.copy_(sl2)
    bt_buf.zero_()
    bt_buf[:, : bt2.shape[1]] = bt2 + kc.shape[0]
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    ref = ref_window_sinks(q2, kc2, vc2, [1] * 4, lens2, bt2, d**-0.5, window, sinks)
    assert rel_err_per_token(out, ref) < TOL


@gpu_test
def test_opcheck_window_sinks():
    q, kc, vc, qsl, sl, bt = make_batch([1, 1], [40, 300], 8, 2, 64, torch.bfloat16, seed=29)
    kc, vc = torch.nan_to_num(kc), torch.nan_to_num(vc)
    sinks = torch.randn(8, device="cuda")
    torch.library.opcheck(
        torch.ops.tandem.paged_decode.default,
        (torch.empty_like(q), q, kc, vc, sl, bt, 0.125, 0, 16, sinks),
    )
    torch.library.opcheck(
        torch.ops.tandem.paged_extend.default,
        (torch.empty_like(q), q, kc, vc, qsl, sl, bt, 1, 0.125, 16, sinks),
    )


def test_windowed_decode_plans_for_the_window():
    """The split-K grid of a windowed layer is planned for its window, not the context."""
    assert kernels.decode_span(32768, 128, 99999) == 128
    assert kernels.decode_span(0, 128, 64) == 64
    assert kernels.decode_span(0, 0, 640) == 640
    assert kernels.decode_span(5000, 0, 640) == 5000
    full = kernels.plan_decode(1, 8, 8, kernels.decode_span(32768, 0, 0), 132)
    windowed = kernels.plan_decode(1, 8, 8, kernels.decode_span(32768, 128, 0), 132)
    assert windowed[0] * windowed[1] < 256 < full[0] * full[1]

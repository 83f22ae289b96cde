"""DeepSeek MLA: the pure-torch reference (ext/mla_ref.py) against independent formulations on
the CPU, the CUDA kernel's validation and split plan on the CPU, and the kernel against the
reference on the GPU (`gpu` marker).

GPU caches are poisoned with NaN wherever no token was written (unused blocks, block-table
padding, the tail of each last block) and outputs are pre-filled with NaN, so a read past a
context or an unwritten output element fails.
"""

from __future__ import annotations

import itertools
import math
import random
import subprocess

import pytest
import torch
import torch.nn.functional as F

import tandem.ext.cuda as cuda_ext
from tandem.ext.cuda import mla as mla_cuda
from tandem.ext.cuda import sm90_build
from tandem.ext.mla_ref import gather_latent, mla_attention_ref

TOL = 1e-2


def gpu_test(fn):
    skip = pytest.mark.skipif(not cuda_ext.is_available(), reason="needs CUDA and CuPy")
    return pytest.mark.gpu(skip(fn))


def make_batch(query_lens, seq_lens, num_heads, latent, rope, dtype, block_size=16, seed=0,
               device="cpu", poison=float("nan")):  # fmt: skip
    """Random queries and a paged latent cache with shuffled blocks holding each sequence's
    first seq_len rows; everything else (free blocks, table padding, block tails) = poison."""
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    nbs = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(nbs) + 3
    perm = list(range(num_blocks))
    rng.shuffle(perm)
    poison_block = perm.pop()
    bt = torch.full((len(seq_lens), max(nbs + [1]) + 2), poison_block, dtype=torch.int32)
    cache = torch.full((num_blocks, block_size, latent + rope), poison, dtype=dtype)
    flat = cache.view(-1, latent + rope)
    for i, (nb, s) in enumerate(zip(nbs, seq_lens, strict=True)):
        blocks = [perm.pop() for _ in range(nb)]
        bt[i, :nb] = torch.tensor(blocks, dtype=torch.int32)
        slots = (torch.tensor(blocks)[:, None] * block_size + torch.arange(block_size)).flatten()
        flat[slots[:s]] = torch.randn(s, latent + rope, generator=g).to(dtype)
    num_tokens = sum(query_lens)
    q_latent = (torch.randn(num_tokens, num_heads, latent, generator=g)).to(dtype)
    q_rope = torch.randn(num_tokens, num_heads, rope, generator=g).to(dtype)
    qsl = torch.tensor([0] + list(itertools.accumulate(query_lens)), dtype=torch.int32)
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    return [t.to(device) for t in (q_latent, q_rope, cache, qsl, sl, bt)]


def rel_err_per_token(out, ref):
    """max over tokens of ||out_t - ref_t|| / ||ref_t||; NaN anywhere -> inf."""
    out, ref = out.float(), ref.float()
    if not torch.isfinite(out).all():
        return math.inf
    num = (out - ref).flatten(1).norm(dim=1)
    den = ref.flatten(1).norm(dim=1).clamp_min(1e-6)
    return (num / den).max().item()


# ---------------------------------------------------------------- CPU: the reference


@pytest.mark.parametrize("block_size", [4, 16])
def test_ref_matches_sdpa_per_sequence(block_size):
    """Against SDPA on contiguous K = [c | k_pe], V = c with a causal mask offset by the prefix."""
    pairs = [(0, 5), (13, 1), (7, 9), (30, 1), (0, 1)]
    query_lens = [n for _, n in pairs]
    seq_lens = [p + n for p, n in pairs]
    H, L, R = 4, 32, 8
    ql, qr, cache, _, _, bt = make_batch(
        query_lens, seq_lens, H, L, R, torch.float32, block_size, seed=1
    )
    out = mla_attention_ref(ql, qr, cache, query_lens, seq_lens, bt, 0.2)
    start = 0
    for i, (n, s) in enumerate(zip(query_lens, seq_lens, strict=True)):
        rows = gather_latent(cache, bt[i], s)
        q = torch.cat([ql[start : start + n], qr[start : start + n]], -1).transpose(0, 1)
        k = rows[None].expand(H, s, L + R)
        v = rows[None, :, :L].expand(H, s, L)
        mask = torch.arange(s)[None, :] <= torch.arange(s - n, s)[:, None]
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.2).transpose(0, 1)
        torch.testing.assert_close(out[start : start + n], want, rtol=1e-5, atol=1e-5)
        start += n


def test_ref_absorbed_equals_expanded_mla():
    """The contract's absorbed form is DeepSeek attention: per head k = [W_UK c | k_pe],
    v = W_UV c, q = [q_nope | q_rope]; absorbed q_latent = W_UK^T q_nope, out = W_UV o."""
    g = torch.Generator().manual_seed(3)
    H, L, R, nope, vdim, s = 3, 24, 8, 16, 12, 19
    w_uk = torch.randn(H, nope, L, generator=g) * 0.2
    w_uv = torch.randn(H, vdim, L, generator=g) * 0.2
    q_nope = torch.randn(1, H, nope, generator=g)
    q_rope = torch.randn(1, H, R, generator=g)
    cache = torch.randn(2, 16, L + R, generator=g)
    bt = torch.tensor([[1, 0]], dtype=torch.int32)
    rows = gather_latent(cache, bt[0], s)
    c, k_pe = rows[:, :L], rows[:, L:]
    scale = (nope + R) ** -0.5
    k = torch.cat([torch.einsum("hdl,sl->hsd", w_uk, c), k_pe[None].expand(H, s, R)], -1)
    v = torch.einsum("hvl,sl->hsv", w_uv, c)
    q = torch.cat([q_nope, q_rope], -1).transpose(0, 1)  # [H, 1, nope + R]
    expanded = F.scaled_dot_product_attention(q, k, v, scale=scale).transpose(0, 1)
    q_latent = torch.einsum("thd,hdl->thl", q_nope, w_uk)
    o = mla_attention_ref(q_latent, q_rope, cache, [1], [s], bt, scale)
    absorbed = torch.einsum("thl,hvl->thv", o, w_uv)
    torch.testing.assert_close(absorbed, expanded, rtol=1e-4, atol=1e-5)


def test_ref_empty_sequence_gives_zeros_and_keeps_dtype():
    ql, qr, cache, _, _, bt = make_batch([1, 1], [5, 3], 2, 16, 8, torch.bfloat16, seed=2)
    out = mla_attention_ref(ql, qr, cache, [1, 1], [5, 0], bt, 0.3)
    assert out.dtype == torch.bfloat16
    assert torch.isfinite(out.float()).all()
    assert torch.equal(out[1].float(), torch.zeros_like(out[1].float()))
    with pytest.raises(ValueError, match="query_lens"):
        mla_attention_ref(ql, qr, cache, [1], [5], bt[:1], 0.3)


# ---------------------------------------------------------------- CPU: plan and validation


@pytest.mark.parametrize("num_tokens", [1, 3, 16, 64, 256])
@pytest.mark.parametrize("head_tiles", [1, 2])
@pytest.mark.parametrize("max_seq_len", [1, 100, 1000, 8192, 32768, 163840])
def test_plan_mla_covers_context(num_tokens, head_tiles, max_seq_len):
    part_len, num_parts = mla_cuda.plan_mla(num_tokens, head_tiles, max_seq_len, 132)
    assert part_len * num_parts >= max_seq_len
    assert part_len * (num_parts - 1) < max_seq_len  # no empty partition
    assert num_parts <= 128
    assert num_parts == 1 or num_tokens * head_tiles * num_parts <= 132  # one wave
    if num_parts > 1:
        assert part_len % 32 == 0 and part_len >= 128


def test_smem_fits_h100():
    assert mla_cuda.smem_bytes(512, 64, 64) <= 227 * 1024
    assert mla_cuda.SM90_SMEM <= 227 * 1024
    assert mla_cuda.rows_per_cta(128) == 64 and mla_cuda.rows_per_cta(16) == 16
    assert mla_cuda.rows_per_cta(48) == 16 and mla_cuda.rows_per_cta(96) == 32
    with pytest.raises(ValueError, match="multiple of 16"):
        mla_cuda.rows_per_cta(20)


def _args(T=2, H=16, L=512, R=64, dtype=torch.bfloat16, bs=16):
    return dict(
        out=torch.empty(T, H, L, dtype=dtype),
        q_latent=torch.zeros(T, H, L, dtype=dtype),
        q_rope=torch.zeros(T, H, R, dtype=dtype),
        latent_cache=torch.zeros(4, bs, L + R, dtype=dtype),
        query_start_loc=torch.arange(T + 1, dtype=torch.int32),
        seq_lens=torch.ones(T, dtype=torch.int32),
        block_tables=torch.zeros(T, 2, dtype=torch.int32),
    )


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(latent_cache=torch.zeros(4, 16, 576, dtype=torch.float32)), "bf16 or fp16"),
        (dict(latent_cache=torch.zeros(4, 12, 576, dtype=torch.bfloat16)), "power of 2"),
        (dict(latent_cache=torch.zeros(4, 16, 570, dtype=torch.bfloat16)), "L \\+ R"),
        (
            dict(latent_cache=torch.zeros(4, 576, 16, dtype=torch.bfloat16).transpose(1, 2)),
            "contiguous",
        ),  # fmt: skip
        (dict(q_latent=torch.zeros(2, 16, 512, dtype=torch.float16)), "dtype"),
        (dict(q_latent=torch.zeros(2, 16, 1024, dtype=torch.bfloat16)[..., ::2]), "last dim"),
        (dict(q_latent=torch.zeros(2, 16, 520, dtype=torch.bfloat16)[..., 4:516]), "16-byte"),
        (dict(q_rope=torch.zeros(3, 16, 64, dtype=torch.bfloat16)), "does not match"),
        (dict(q_latent=torch.zeros(2 * 16 * 512, dtype=torch.bfloat16)), "3-D"),
        (dict(seq_lens=torch.ones(2, dtype=torch.int64)), "int32"),
        (dict(query_start_loc=torch.arange(2, dtype=torch.int32)), "num_seqs \\+ 1"),
        (dict(block_tables=torch.zeros(3, 2, dtype=torch.int32)), "block_tables rows"),
        (dict(out=torch.empty(2, 16, 256, dtype=torch.bfloat16)), "out must be"),
        (dict(), "CUDA device"),  # every shape right: the CPU tensors are refused
    ],
)
def test_validation_errors(change, match):
    args = _args()
    args.update(change)
    with pytest.raises(ValueError, match=match):
        mla_cuda.check_mla_args(**args)


@pytest.mark.parametrize(
    "H,L,R,match", [(20, 512, 64, "multiple of 16"), (16, 384, 64, "L=384"), (16, 512, 8, "R=8")]
)
def test_validation_unsupported_dims(H, L, R, match):
    with pytest.raises(ValueError, match=match):
        mla_cuda.check_mla_args(**_args(H=H, L=L, R=R))


def test_op_registered_and_launch_refuses_cpu():
    assert hasattr(torch.ops.tandem, "mla_attention")
    a = _args()
    with pytest.raises(ValueError, match="CUDA"):
        cuda_ext.mla_attention_cuda(
            a["q_latent"], a["q_rope"], a["latent_cache"], a["query_start_loc"], a["seq_lens"],
            a["block_tables"], 0.1,
        )  # fmt: skip


def test_fake_impl_launches_nothing():
    """Under fake tensors (torch.compile tracing) the op runs its fake, not the launcher, which
    would refuse these CPU tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        a = _args()
        torch.ops.tandem.mla_attention(*a.values(), 0.1, 16)


def test_backend_support_check():
    from tandem.models.cupy_backend import cupy_backend_supports_mla

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert not cupy_backend_supports_mla(512, 64, 128, torch.bfloat16, cpu)
    assert not cupy_backend_supports_mla(384, 64, 128, torch.bfloat16, cuda)
    assert not cupy_backend_supports_mla(512, 64, 20, torch.bfloat16, cuda)
    assert not cupy_backend_supports_mla(512, 64, 128, torch.float32, cuda)
    assert cupy_backend_supports_mla(512, 64, 128, torch.bfloat16, cuda) == cuda_ext.is_available()


# ---------------------------------------------------------------- GPU: kernel vs reference


def run_kernel(pairs, H, L=512, R=64, dtype=torch.bfloat16, block_size=16, seed=0,
               max_seq_len=None, kernel="auto"):  # fmt: skip
    """pairs: (prefix_len, query_len) per sequence; returns the per-token relative error."""
    query_lens = [n for _, n in pairs]
    seq_lens = [p + n for p, n in pairs]
    ql, qr, cache, qsl, sl, bt = make_batch(
        query_lens, seq_lens, H, L, R, dtype, block_size, seed, device="cuda"
    )
    scale = (128 + R) ** -0.5
    out = torch.full_like(ql, float("nan"))
    cuda_ext.mla_attention_cuda(ql, qr, cache, qsl, sl, bt, scale, max_seq_len, out=out,
                                kernel=kernel)  # fmt: skip
    ref = mla_attention_ref(ql, qr, cache, query_lens, seq_lens, bt, scale)
    return rel_err_per_token(out, ref)


@gpu_test
@pytest.mark.parametrize("H", [16, 128])
@pytest.mark.parametrize("batch", [1, 7, 64, 256])
@pytest.mark.parametrize("kernel", ["auto", "portable"])
def test_decode_random_batches(H, batch, kernel):
    """kernel="auto" takes the Hopper kernel for 128 heads on an H100/H200; "portable" keeps
    the mma.sync kernel tested there too."""
    rng = random.Random(batch * 131 + H)
    top = 3000 if batch <= 64 else 1200
    pairs = [(rng.randint(0, top), 1) for _ in range(batch)]
    pairs[0] = (0, 1)  # a context of one token
    assert run_kernel(pairs, H, seed=batch + H, kernel=kernel) < TOL


def _is_sm90() -> bool:
    return cuda_ext.is_available() and torch.cuda.get_device_capability() == (9, 0)


def sm90_test(fn):
    skip = pytest.mark.skipif(not _is_sm90(), reason="needs a compute-capability 9.0 GPU")
    return pytest.mark.gpu(skip(fn))


@sm90_test
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("seed", range(4))
def test_sm90_random_shapes(dtype, seed):
    """The wgmma kernel on random batches (1-256 rows), contexts (1-32k), block sizes and
    head counts (multiples of 64), block tables with holes, split-KV or not."""
    rng = random.Random(seed)
    batch = rng.choice([1, 2, 16, 100, 256])
    top = {1: 32768, 2: 32768, 16: 9000, 100: 3000, 256: 1500}[batch]
    pairs = [(rng.randint(0, top - 1), 1) for _ in range(batch)]
    H = rng.choice([64, 128, 128, 256])
    bs = rng.choice([1, 16, 64])
    err = run_kernel(pairs, H, dtype=dtype, block_size=bs, seed=seed, kernel="sm90")
    assert err < TOL, (batch, H, bs)


@sm90_test
@pytest.mark.parametrize("H", [64, 128])
def test_sm90_extend_and_tile_edges(H):
    """Extend rows, and contexts at and around the 64-row tile and the partition edges."""
    edges = [(0, 1), (62, 1), (63, 1), (64, 1), (127, 1), (128, 1), (4095, 1), (4096, 1)]
    assert run_kernel(edges + MIXED, H, seed=11, kernel="sm90") < TOL


@sm90_test
@pytest.mark.parametrize(
    "batch,H,dtype",
    [(24, 128, torch.bfloat16), (26, 128, torch.float16), (50, 64, torch.bfloat16)],
)
def test_sm90_cluster_merge(batch, H, dtype):
    """Two split-KV partitions merged inside a thread-block cluster: contexts over both, short
    ones whose second partition is empty, an extend row and a padded (seq_len 0) row, which
    must come out as zeros."""
    rng = random.Random(batch)
    pairs = [(rng.randint(0, 9000), 1) for _ in range(batch - 1)] + [(400, 3)]
    pairs[:3] = [(0, 1), (63, 1), (9999, 1)]
    query_lens = [n for _, n in pairs]
    seq_lens = [p + n for p, n in pairs]
    ql, qr, cache, qsl, sl, bt = make_batch(query_lens, seq_lens, H, 512, 64, dtype, seed=batch,
                                            device="cuda")  # fmt: skip
    sl[3] = 0
    seq_lens[3] = 0
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    _, parts = mla_cuda.plan_mla(ql.shape[0], H // 64, 10002, sms, mla_cuda.SM90_TILE)
    assert parts in mla_cuda.SM90_CLUSTERS, parts
    out = torch.full_like(ql, float("nan"))
    cuda_ext.mla_attention_cuda(ql, qr, cache, qsl, sl, bt, 0.07, 10002, out=out, kernel="sm90")
    assert torch.equal(out[3].float(), torch.zeros(H, 512, device="cuda"))
    ref = mla_attention_ref(ql, qr, cache, query_lens, seq_lens, bt, 0.07)
    assert rel_err_per_token(out, ref) < TOL


@sm90_test
def test_sm90_cubin_the_driver_refuses_falls_back(tmp_path, monkeypatch, caplog):
    """A cubin that builds but does not load on this GPU (here: built for sm_100a): "auto"
    warns once and computes with the portable kernel, "sm90" raises naming the cause."""
    src = tmp_path / "k.cu"
    src.write_text('extern "C" __global__ void mla90_bf16(float* x) { x[0] = 1.f; }\n')
    cubin = tmp_path / "k.cubin"
    nvcc = sm90_build.nvcc_path()
    assert nvcc is not None
    subprocess.run([nvcc, "-arch=sm_100a", "-cubin", "-o", str(cubin), str(src)], check=True)
    monkeypatch.setattr(mla_cuda, "sm90_cubin", lambda name: cubin)
    monkeypatch.setattr(mla_cuda, "_sm90_warned", False)
    mla_cuda._sm90_module.cache_clear()
    try:
        with caplog.at_level("WARNING"):
            assert run_kernel([(3000, 1), (10, 1)], 128, seed=2) < TOL
            assert run_kernel([(50, 1)], 128, seed=3) < TOL
        assert sum("Hopper kernel is unavailable" in r.message for r in caplog.records) == 1
        with pytest.raises(RuntimeError, match="sm90 MLA kernel is unavailable"):
            run_kernel([(50, 1)], 128, seed=3, kernel="sm90")
    finally:
        mla_cuda._sm90_module.cache_clear()


def test_kernel_choice_on_cpu():
    assert mla_cuda.choose_kernel("portable", 512, 64, 128, 0) is None
    with pytest.raises(ValueError, match="kernel must be"):
        mla_cuda.choose_kernel("fast", 512, 64, 128, 0)
    with pytest.raises(ValueError, match="sm90 MLA kernel needs L, R"):
        mla_cuda.choose_kernel("sm90", 128, 32, 128, 0)
    with pytest.raises(ValueError, match="heads % 64"):
        mla_cuda.choose_kernel("sm90", 512, 64, 16, 0)
    assert mla_cuda.plan_mla(1, 2, 32768, 132, tile=64)[0] % 64 == 0


def test_kernel_choice_falls_back_when_the_cubin_is_unavailable(monkeypatch, caplog):
    """No nvcc / a failed build / a cubin the driver refuses: "auto" takes the portable kernel
    with one warning, "sm90" raises."""
    monkeypatch.setattr(mla_cuda, "_sm90_device", lambda index: True)
    monkeypatch.setattr(mla_cuda, "_sm90_warned", False)
    err = sm90_build.Sm90BuildError("nvcc not found")
    monkeypatch.setattr(mla_cuda, "_sm90_module", lambda index: err)
    with caplog.at_level("WARNING"):
        assert mla_cuda.choose_kernel("auto", 512, 64, 128, 0) is None
        assert mla_cuda.choose_kernel("auto", 512, 64, 128, 0) is None
    assert sum("Hopper kernel is unavailable" in r.message for r in caplog.records) == 1
    with pytest.raises(RuntimeError, match="unavailable: nvcc not found"):
        mla_cuda.choose_kernel("sm90", 512, 64, 128, 0)
    monkeypatch.setattr(mla_cuda, "_sm90_module", lambda index: "/x/mla_sm90.cubin")
    assert mla_cuda.choose_kernel("auto", 512, 64, 128, 0) == "/x/mla_sm90.cubin"
    assert mla_cuda.choose_kernel("auto", 512, 64, 16, 0) is None  # V2-Lite's 16 heads


def test_sm90_module_reports_a_load_failure(monkeypatch):
    monkeypatch.setattr(mla_cuda, "sm90_cubin", lambda name: "/x/mla_sm90.cubin")

    def refuse(path, name, index):
        raise RuntimeError("CUDA_ERROR_NO_BINARY_FOR_GPU")

    monkeypatch.setattr(mla_cuda, "get_cubin_kernel", refuse)
    got = mla_cuda._sm90_module.__wrapped__(0)
    assert isinstance(got, RuntimeError) and "NO_BINARY" in str(got)


@pytest.mark.skipif(sm90_build.nvcc_path() is None, reason="needs nvcc")
def test_sm90_source_builds(tmp_path, monkeypatch):
    """The sm_90a source compiles (nvcc, no GPU needed) into a cubin naming its kernels."""
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path))
    monkeypatch.setattr(sm90_build, "_built", {})
    path = sm90_build.sm90_cubin("mla_sm90.cu")
    data = path.read_bytes()
    assert path.parent == tmp_path / "cuda_sm90"
    names = [mla_cuda.sm90_kernel_name(dt, cl) for dt in (torch.float16, torch.bfloat16)
             for cl in (1, *mla_cuda.SM90_CLUSTERS)]  # fmt: skip
    assert len(set(names)) == len(names)
    assert all(name.encode() in data for name in names)


@gpu_test
@pytest.mark.parametrize("H", [32, 48, 64])
def test_decode_other_head_counts(H):
    """16 warps over 32 or 64 heads a CTA; 48 heads: three CTAs of 16."""
    rng = random.Random(H)
    assert run_kernel([(rng.randint(0, 5000), 1) for _ in range(9)], H, seed=H) < TOL


@gpu_test
@pytest.mark.parametrize(
    "lens,H", [([32768, 1, 17001, 4097], 128), ([32767, 5], 16), ([8191] * 16, 128)]
)
def test_decode_long_context(lens, H):
    assert run_kernel([(s - 1, 1) for s in lens], H, seed=len(lens)) < TOL


@gpu_test
@pytest.mark.parametrize("H", [16, 32, 128])
@pytest.mark.parametrize("block_size", [1, 16, 64])
def test_decode_small_latent_fp16_block_sizes(H, block_size):
    pairs = [(0, 1), (31, 1), (32, 1), (700, 1), (2500, 1)]
    err = run_kernel(pairs, H, L=128, R=32, dtype=torch.float16, block_size=block_size, seed=5)
    assert err < TOL


MIXED = [(0, 37), (100, 1), (513, 64), (5, 200), (1000, 130), (0, 1), (47, 16)]


@gpu_test
@pytest.mark.parametrize("H", [16, 128])
def test_extend_mixed_batch(H):
    assert run_kernel(MIXED, H, seed=H) < TOL


@gpu_test
@pytest.mark.parametrize("max_grid_y", [5, 64])
def test_launch_split_over_grid_y(monkeypatch, max_grid_y):
    """More query rows than one launch's grid.y takes (65535 in production): the launcher
    issues several launches with a row offset; split-KV partials included (batch 1-2 rows)."""
    monkeypatch.setattr(mla_cuda, "_MAX_GRID_Y", max_grid_y)
    assert run_kernel(MIXED, 16, seed=3) < TOL
    assert run_kernel([(9000, 1), (300, 1), (5, 1)] * 4, 128, seed=4) < TOL


@gpu_test
def test_extend_long_prefix():
    assert run_kernel([(20000, 33), (0, 300)], 128, block_size=64, seed=8) < TOL


@gpu_test
def test_padded_rows_zero_and_strided_q():
    """seq_len 0 (graph padding) gives zeros; q_latent as a view with a wider row stride."""
    H, L, R = 128, 512, 64
    ql, qr, cache, qsl, sl, bt = make_batch([1, 1, 1], [50, 1, 900], H, L, R, torch.bfloat16,
                                            seed=4, device="cuda")  # fmt: skip
    sl[1] = 0
    wide = torch.randn(3, H, L + 64, device="cuda").to(torch.bfloat16)
    wide[..., :L] = ql
    out = torch.full_like(ql, float("nan"))
    cuda_ext.mla_attention_cuda(wide[..., :L], qr, cache, qsl, sl, bt, 0.07, 900, out=out)
    assert torch.equal(out[1].float(), torch.zeros(H, L, device="cuda"))
    ref = mla_attention_ref(ql, qr, cache, [1, 1, 1], [50, 0, 900], bt, 0.07)
    assert rel_err_per_token(out, ref) < TOL


@gpu_test
@pytest.mark.parametrize("H", [16, 128])
def test_cuda_graph_capture_replay(H):
    """Captured once with an upper-bound max_seq_len, replayed with new lengths and tables."""
    L, R = 512, 64
    lens1, lens2 = [4000, 100, 2048, 1], [7, 3900, 513, 64]
    a = make_batch([1] * 4, lens1, H, L, R, torch.bfloat16, seed=21, device="cuda")
    b = make_batch([1] * 4, lens2, H, L, R, torch.bfloat16, seed=22, device="cuda")
    ql, qr, cache1, qsl, sl, bt1 = a
    cache = torch.cat([cache1, b[2]])
    width = max(bt1.shape[1], b[5].shape[1])
    bt = torch.zeros(4, width, dtype=torch.int32, device="cuda")
    bt[:, : bt1.shape[1]] = bt1
    out = torch.full_like(ql, float("nan"))
    scale = 0.08

    def call():
        cuda_ext.mla_attention_cuda(ql, qr, cache, qsl, sl, bt, scale, 8192, out=out)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        call()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    for q_lat, q_rope, lens, table, offset in ((a[0], a[1], lens1, bt1, 0),
                                               (b[0], b[1], lens2, b[5], cache1.shape[0])):  # fmt: skip
        ql.copy_(q_lat)
        qr.copy_(q_rope)
        sl.copy_(torch.tensor(lens, dtype=torch.int32))
        bt.zero_()
        bt[:, : table.shape[1]] = table + offset
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = mla_attention_ref(ql, qr, cache, [1] * 4, lens, bt, scale)
        assert rel_err_per_token(out, ref) < TOL


@gpu_test
def test_cupy_backend_mla_matches_reference():
    """`CupyAttentionBackend.mla` on a ForwardBatch (decode-only and mixed), against the ext
    reference and, where the torch backend has `mla`, against it too."""
    from tandem.models.attention_backend import TorchAttentionBackend
    from tandem.models.batch import ForwardBatch, KVCache
    from tandem.models.cupy_backend import CupyAttentionBackend

    H, L, R = 16, 512, 64
    for pairs in ([(100, 1), (5000, 1), (0, 1)], MIXED):
        query_lens = [n for _, n in pairs]
        seq_lens = [p + n for p, n in pairs]
        ql, qr, cache, qsl, sl, bt = make_batch(query_lens, seq_lens, H, L, R, torch.bfloat16,
                                                seed=17, device="cuda", poison=0.0)  # fmt: skip
        batch = ForwardBatch(
            query_start_loc=qsl, seq_lens=sl, block_tables=bt,
            slot_mapping=torch.zeros(sum(query_lens), dtype=torch.int64, device="cuda"),
            logits_indices=torch.zeros(0, dtype=torch.int64, device="cuda"),
            query_lens_cpu=query_lens, seq_lens_cpu=seq_lens,
            kv_cache=KVCache(k=[], v=[], block_size=cache.shape[1]),
            max_query_len=max(query_lens), max_seq_len=max(seq_lens),
        )  # fmt: skip
        ours = CupyAttentionBackend().mla(ql, qr, cache, batch, 0.1)
        ref = mla_attention_ref(ql, qr, cache, query_lens, seq_lens, bt, 0.1)
        assert rel_err_per_token(ours, ref) < TOL
        torch_mla = getattr(TorchAttentionBackend(), "mla", None)
        if torch_mla is not None:
            assert rel_err_per_token(ours, torch_mla(ql, qr, cache, batch, 0.1)) < TOL

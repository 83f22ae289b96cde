"""The skinny decode GEMM (ext/cuda/skinny_gemm.cu) against a float32 product, its custom op,
the launcher's input checks, and the model-level swap (models/layers/cuda_linear.py).

GPU tests carry the `gpu` marker and skip without CUDA/CuPy; outputs are poisoned with NaN
before each launch, so an unwritten element fails.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import tandem.ext.cuda as cuda_ext
from tandem.ext.cuda import skinny
from tandem.models.layers.cuda_linear import SkinnyGatedMLP, SkinnyLinear, use_cuda_skinny_linear

_requires_cuda = pytest.mark.skipif(not cuda_ext.is_available(), reason="needs CUDA and CuPy")


def gpu_test(fn):
    return pytest.mark.gpu(_requires_cuda(fn))


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.float() - ref).norm() / ref.norm()).item()


# ------------------------------------------------------------------------- CPU: checks, swap


def test_launcher_rejects_bad_operands():
    x = torch.zeros(2, 16, dtype=torch.bfloat16)
    w = torch.zeros(8, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="rows"):
        skinny.launch_skinny_gemm(torch.zeros(9, 16, dtype=torch.bfloat16), w, torch.zeros(9, 8))
    with pytest.raises(ValueError, match="shapes"):
        skinny.launch_skinny_gemm(x, torch.zeros(8, 24, dtype=torch.bfloat16), torch.zeros(2, 8))
    with pytest.raises(ValueError, match="dtypes"):
        skinny.launch_skinny_gemm(x, w, torch.zeros(2, 8, dtype=torch.float32))
    with pytest.raises(ValueError, match="CUDA"):
        skinny.launch_skinny_gemm(x, w, torch.zeros(2, 8, dtype=torch.bfloat16))


def test_supported_only_for_small_cuda_products():
    w = torch.zeros(8, 16, dtype=torch.bfloat16)
    assert not skinny.supported(torch.zeros(1, 16, dtype=torch.bfloat16), w)  # CPU


def test_swap_is_a_noop_off_cuda():
    model = nn.Sequential()
    model.add_module("qkv_proj", nn.Linear(16, 48, bias=False))
    assert use_cuda_skinny_linear(model) == 0
    assert type(model.qkv_proj) is nn.Linear


def _qkv_inputs(device, dtype, t, heads, kv_heads, d, k=256, bias=True, seed=0):
    from tandem.models.layers.rotary import RotaryEmbedding

    g = torch.Generator(device="cpu").manual_seed(seed)
    rows = (heads + 2 * kv_heads) * d
    x = torch.randn(t, k, generator=g).to(device, dtype)
    w = (torch.randn(rows, k, generator=g) * 0.05).to(device, dtype)
    b = (torch.randn(rows, generator=g) * 0.1).to(device, dtype) if bias else None
    pos = torch.randint(0, 5000, (t,), generator=g).to(device)
    cos, sin = RotaryEmbedding(d, 10000.0, None).cos_sin(pos, dtype)
    cache = [
        torch.full((8, 16, kv_heads, d), float("nan"), device=device, dtype=dtype) for _ in range(2)
    ]
    slots = torch.randperm(128, generator=g)[:t].to(device)
    if t > 1:
        slots[1] = -1  # a padding row: writes nothing
    return x, w, b, cos.reshape(t, d), sin.reshape(t, d), cache, slots


def _qkv_expected(x, w, b, cos, sin, heads, kv_heads, d):
    """float32: q rotated, k rotated, v (as [T, heads, D])."""
    from tandem.models.layers.rotary import RotaryEmbedding

    t = x.shape[0]
    qkv = x.float() @ w.float().t() + (0 if b is None else b.float())
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    c, s_ = cos.float()[:, None], sin.float()[:, None]
    q = RotaryEmbedding.apply(q.reshape(t, heads, d), c, s_)
    k = RotaryEmbedding.apply(k.reshape(t, kv_heads, d), c, s_)
    return q, k, v.reshape(t, kv_heads, d)


def _check_qkv(q, cache, slots, expected, tol):
    q_ref, k_ref, v_ref = expected
    assert _rel(q, q_ref) < tol
    kc, vc = (c.reshape(-1, *c.shape[2:]) for c in cache)
    written = torch.zeros(kc.shape[0], dtype=torch.bool, device=kc.device)
    for i, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert _rel(kc[slot], k_ref[i]) < tol and _rel(vc[slot], v_ref[i]) < tol
            written[slot] = True
    assert kc[~written].isnan().all() and vc[~written].isnan().all(), "wrote outside the slots"


@pytest.mark.parametrize("bias", [True, False])
def test_qkv_rope_fallback_on_cpu(bias):
    x, w, b, cos, sin, cache, slots = _qkv_inputs("cpu", torch.float32, 3, 4, 2, 32, bias=bias)
    q = torch.ops.tandem.skinny_qkv_rope(x, w, b, cos, sin, *cache, slots, 4, 2)
    _check_qkv(q, cache, slots, _qkv_expected(x, w, b, cos, sin, 4, 2, 32), 1e-5)


# --------------------------------------------------------------------------------- GPU


@gpu_test
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("t", [1, 2, 3, 8])
@pytest.mark.parametrize(("heads", "kv_heads", "d"), [(4, 4, 64), (8, 2, 128), (8, 1, 64)])
def test_qkv_rope_kernel(dtype, t, heads, kv_heads, d):
    x, w, b, cos, sin, cache, slots = _qkv_inputs("cuda", dtype, t, heads, kv_heads, d, seed=t + d)
    expected = _qkv_expected(x, w, b, cos, sin, heads, kv_heads, d)
    for tile in {skinny.tile_for(t), (1, 2), (2, 4)}:
        for c in cache:
            c.fill_(float("nan"))
        q = torch.full((t, heads, d), float("nan"), device="cuda", dtype=dtype)
        skinny.launch_skinny_qkv_rope(x, w, b, cos, sin, q, *cache, slots, heads, kv_heads, tile)
        torch.cuda.synchronize()
        _check_qkv(q, cache, slots, expected, 1e-2)
    for c in cache:
        c.fill_(float("nan"))
    q = torch.ops.tandem.skinny_qkv_rope(x, w, None, cos, sin, *cache, slots, heads, kv_heads)
    _check_qkv(q, cache, slots, _qkv_expected(x, w, None, cos, sin, heads, kv_heads, d), 1e-2)


@gpu_test
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize(("n", "k"), [(1, 8), (7, 264), (513, 2048), (4099, 4096), (300, 14336)])
def test_matches_float32(dtype, m, n, k):
    torch.manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    w = torch.randn(n, k, device="cuda", dtype=dtype) * 0.05
    ref = x.float() @ w.float().t()
    for tile in {skinny.tile_for(m), (1, 2), (4, 4)}:
        out = torch.full((m, n), float("nan"), device="cuda", dtype=dtype)
        skinny.launch_skinny_gemm(x, w, out, tile)
        torch.cuda.synchronize()
        assert not out.isnan().any(), f"unwritten output (tile {tile})"
        assert _rel(out, ref) < 1e-2, f"tile {tile}"


@gpu_test
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 2, 4])
@pytest.mark.parametrize(("n", "k"), [(1, 8), (7, 264), (513, 2048), (1000, 4096)])
def test_glu_matches_float32(dtype, m, n, k):
    torch.manual_seed(m + n + k)
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    w = torch.randn(2 * n, k, device="cuda", dtype=dtype) * 0.05
    gate, up = (x.float() @ w.float().t()).chunk(2, dim=-1)
    ref = torch.nn.functional.silu(gate) * up
    for tile in {skinny.tile_for(m), (1, 2), (4, 4)}:
        out = torch.full((m, n), float("nan"), device="cuda", dtype=dtype)
        skinny.launch_skinny_gemm(x, w, out, tile, glu=True)
        torch.cuda.synchronize()
        assert not out.isnan().any(), f"unwritten output (tile {tile})"
        assert _rel(out, ref) < 1e-2, f"tile {tile}"
    y = torch.ops.tandem.skinny_swiglu(x, w)
    assert _rel(y, ref) < 1e-2


@gpu_test
def test_strided_x_and_out_rows():
    x_big = torch.randn(3, 1032, device="cuda", dtype=torch.bfloat16)
    x = x_big[:, :1024]  # row stride 1032
    w = torch.randn(96, 1024, device="cuda", dtype=torch.bfloat16)
    out_big = torch.full((3, 128), float("nan"), device="cuda", dtype=torch.bfloat16)
    out = out_big[:, :96]
    skinny.launch_skinny_gemm(x, w, out)
    assert _rel(out, x.float() @ w.float().t()) < 1e-2
    assert out_big[:, 96:].isnan().all(), "wrote past the output rows"


@gpu_test
def test_op_falls_back_and_traces():
    w = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16)
    for rows in (1, 2, 16):  # 16 > MAX_ROWS: F.linear inside the op
        x = torch.randn(rows, 128, device="cuda", dtype=torch.bfloat16)
        y = torch.ops.tandem.skinny_linear(x, w)
        assert y.shape == (rows, 64)
        assert _rel(y, x.float() @ w.float().t()) < 1e-2
    torch.library.opcheck(torch.ops.tandem.skinny_linear.default, (x[:2], w))

    lin = SkinnyLinear(128, 64, bias=True, device="cuda", dtype=torch.bfloat16)
    f = torch.compile(lin, fullgraph=True)
    x = torch.randn(1, 128, device="cuda", dtype=torch.bfloat16)
    assert _rel(f(x), x.float() @ lin.weight.float().t() + lin.bias.float()) < 1e-2


@gpu_test
def test_model_swap_keeps_logits():
    from tandem.models.config import ModelConfig
    from tandem.models.loader import build_model
    from tandem.models.loader.dummy import init_dummy_weights

    cfg = ModelConfig.from_hf_dict(
        {
            "architectures": ["LlamaForCausalLM"],
            "hidden_size": 256,
            "intermediate_size": 512,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": 1000,
            "max_position_embeddings": 512,
            "tie_word_embeddings": False,
        }
    )
    model = build_model(cfg, dtype=torch.bfloat16, device="cuda")
    init_dummy_weights(model, 0)
    hidden = torch.randn(2, 256, device="cuda", dtype=torch.bfloat16)
    before = model.compute_logits(hidden)
    assert use_cuda_skinny_linear(model) == 2 * 4 + 1
    assert isinstance(model.layers[0].mlp.down_proj, SkinnyLinear)
    after = model.compute_logits(hidden)
    assert _rel(after, before) < 1e-2
    assert dict(model.named_parameters()).keys() >= {"layers.0.mlp.down_proj.weight"}
    mlp = model.layers[0].mlp
    assert isinstance(mlp, SkinnyGatedMLP)
    for rows in (1, 2, 5):  # 5 > max_rows: the torch path
        x = torch.randn(rows, 256, device="cuda", dtype=torch.bfloat16)
        gate, up = (x.float() @ mlp.gate_up_proj.weight.float().t()).chunk(2, dim=-1)
        ref = (torch.nn.functional.silu(gate) * up) @ mlp.down_proj.weight.float().t()
        assert _rel(mlp(x), ref) < 2e-2

"""ext/cuda/moe_quant (packed experts on the GPU) against dequantize-then-torch-expert-loop,
through the gpu expert backend's paths (in-place GEMV and dequantize + grouped GEMMs), with
GPT-OSS's biases and clamped SwiGLU, and inside a CUDA graph (GPU tests)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tandem.ext.cuda as cuda_ext

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not cuda_ext.is_available(), reason="needs CUDA and CuPy"),
]

TYPES = [
    "Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "MXFP4", "int4-g32", "int4-g128", "fp8-b32",
]  # fmt: skip
ROWS = [1, 2, 7, 16, 64, 300]


def _experts(qtype: str, num: int, hidden: int, inter: int, seed: int):
    """A PackedExperts on CUDA with random packed weights of `qtype` ("int4-gG": GPTQ-style
    int4 with groups of G; "fp8-b32": e4m3 with 32 x 32 block scales)."""
    from tandem.models.quant.experts import PackedExperts, expert_names
    from tandem.models.quant.tensor import QuantizedTensor
    from tests.models.hf_quant_cases import random_fp8, random_int4
    from tests.models.quant_cases import pack

    rng = np.random.default_rng(seed)
    kind = qtype.split("-")[0]
    names = expert_names("model.layers.0.mlp.", 0, num)
    experts = PackedExperts(names, kind, hidden, inter).cuda()
    for i in range(num * 3):
        rows, cols = (hidden, inter) if i % 3 == 2 else (inter, hidden)
        if kind == "int4":
            experts.set_part(i, random_int4(rows, cols, int(qtype[6:]), seed * 100 + i))
            continue
        if kind == "fp8":  # 32 x 32 blocks (tests/models/hf_quant_cases.py)
            experts.set_part(i, random_fp8(rows, cols, "block", seed * 100 + i))
            continue
        w = rng.standard_normal((rows, cols)).astype(np.float32) * 0.1
        data = torch.from_numpy(np.ascontiguousarray(pack(w, qtype))).reshape(rows, -1)
        experts.set_part(i, QuantizedTensor(qtype, data, cols))
    return experts


def _ops(experts):
    return (experts.data13, experts.scales13, experts.data2, experts.scales2, experts.type_id)


def _shape(qtype: str, rows: int) -> tuple[int, int]:
    if qtype.endswith("_K"):
        return 512, 256 * (1 + rows % 2)
    if qtype == "int4-g128":
        return 384, 128 * (1 + rows % 2)
    return 96 + 32 * (rows % 3), 160  # odd multiples of the 32-value block


def _routing(t: int, num: int, top_k: int, seed: int):
    g = torch.Generator("cuda").manual_seed(seed)
    logits = torch.randn(t, num, device="cuda", generator=g)
    w, ids = torch.topk(torch.softmax(logits, -1), top_k, dim=-1)
    return ids, w / w.sum(-1, keepdim=True)


def _reference(x, ids, w, experts, bias=None):
    from tandem.models.layers.experts import ExpertBias, TorchExpertBackend

    w13, w2 = experts.dequantize(torch.float64)
    b = None
    if bias is not None:
        b = ExpertBias(bias.b13.double(), bias.b2.double(), bias.activation)
    return TorchExpertBackend().forward(0, x.double(), ids, w.double(), w13, w2, b)


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("rows", ROWS)
def test_routed_kernel_matches_reference(qtype: str, rows: int) -> None:
    from tandem.ext.cuda import moe_quant  # noqa: F401

    num, top_k = 7, 3
    hidden, inter = _shape(qtype, rows)
    experts = _experts(qtype, num, hidden, inter, rows)
    ids, w = _routing(rows, num, top_k, rows)
    x = torch.randn(rows, hidden, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    for dtype in (torch.bfloat16, torch.float16) if rows == 7 else (torch.bfloat16,):
        xd = x.to(dtype)
        expected = _reference(xd, ids, w, experts)
        got = torch.ops.tandem.qmoe_routed_experts(xd, ids, w, *_ops(experts))
        assert got.dtype == dtype and got.shape == (rows, hidden)
        scale = expected.abs().max().item()
        torch.testing.assert_close(got.double(), expected, rtol=0, atol=2e-2 * scale)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_K", "MXFP4", "int4-g128"])
@pytest.mark.parametrize("rows", ROWS)
def test_backend_paths_match_reference(qtype: str, rows: int) -> None:
    """Both of the backend's packed paths at every size: in place (gemv) and dequantized into
    a scratch of the routed experts (grouped GEMMs), bf16."""
    from tandem.models.layers.gpu_experts import GpuExpertBackend
    from tandem.models.quant.experts import PackedExpertWeight

    num, top_k = 9, 2
    hidden, inter = _shape(qtype, rows)
    experts = _experts(qtype, num, hidden, inter, 100 + rows)
    w13, w2 = PackedExpertWeight(experts, "13"), PackedExpertWeight(experts, "2")
    ids, w = _routing(rows, num, top_k, rows)
    x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
    expected = _reference(x, ids, w, experts)
    scale = expected.abs().max().item()
    for limit, path in ((10_000, "qgemv"), (0, "qgrouped")):
        backend = GpuExpertBackend(packed_gemv_max_tokens=limit)
        got = backend.forward(0, x, ids, w, w13, w2)
        assert backend.calls[path] == 1, backend.calls
        torch.testing.assert_close(got.double(), expected, rtol=0, atol=2e-2 * scale)


@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_gpt_oss_biases_and_clamped_swiglu(rows: int) -> None:
    from tandem.models.layers.experts import ClampedSwiGLU, ExpertBias
    from tandem.models.layers.gpu_experts import GpuExpertBackend
    from tandem.models.quant.experts import PackedExpertWeight

    num, top_k, hidden, inter = 8, 4, 160, 96
    experts = _experts("MXFP4", num, hidden, inter, rows)
    w13, w2 = PackedExpertWeight(experts, "13"), PackedExpertWeight(experts, "2")
    g = torch.Generator("cuda").manual_seed(rows)
    bias = ExpertBias(
        (torch.randn(num, 2 * inter, device="cuda", generator=g) * 0.5).bfloat16(),
        (torch.randn(num, hidden, device="cuda", generator=g) * 0.5).bfloat16(),
        ClampedSwiGLU(alpha=1.702, limit=0.4),  # a low limit: the clamps are exercised
    )
    ids, w = _routing(rows, num, top_k, rows)
    x = torch.randn(rows, hidden, device="cuda", generator=g).bfloat16() * 4
    expected = _reference(x, ids, w, experts, bias)
    scale = expected.abs().max().item()
    for limit in (10_000, 0):
        got = GpuExpertBackend(packed_gemv_max_tokens=limit).forward(
            0, x, ids, w, w13, w2, bias=bias
        )
        torch.testing.assert_close(got.double(), expected, rtol=0, atol=2e-2 * scale)


def test_ids_outside_the_experts_add_nothing_and_graph_capture() -> None:
    num, top_k, hidden, inter = 6, 2, 128, 64
    experts = _experts("Q8_0", num, hidden, inter, 5)
    x = torch.randn(3, hidden, device="cuda", dtype=torch.bfloat16)
    ids, w = _routing(3, num, top_k, 5)
    ids[1, 0] = -1  # computed elsewhere (the CPU pool)
    ids[2, 1] = num  # another rank's expert
    op = torch.ops.tandem.qmoe_routed_experts
    got = op(x, ids, w, *_ops(experts))
    w_kept = w * ((ids >= 0) & (ids < num))
    expected = _reference(x, ids.clamp(0, num - 1), w_kept, experts)
    torch.testing.assert_close(got.double(), expected, rtol=0, atol=2e-2 * expected.abs().max())
    # inside a CUDA graph: same result on replay with new inputs, no host sync
    ids2, w2 = _routing(3, num, top_k, 6)
    static_x, static_ids, static_w = x.clone(), ids.clone(), w.clone()
    op(static_x, static_ids, static_w, *_ops(experts))  # warm
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = op(static_x, static_ids, static_w, *_ops(experts))
    static_ids.copy_(ids2)
    static_w.copy_(w2)
    graph.replay()
    expected2 = _reference(x, ids2, w2, experts)
    torch.testing.assert_close(out.double(), expected2, rtol=0, atol=2e-2 * expected2.abs().max())


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("rows", [1, 3, 16])
def test_decode_from_logits_matches_reference(qtype: str, rows: int) -> None:
    """The backend's decode path from the router's logits (route + sort, gate_up, token-major
    down), softmax top-k renormalized, against routing and experts in torch."""
    from tandem.models.layers.gpu_experts import GpuExpertBackend
    from tandem.models.quant.experts import PackedExpertWeight

    num, top_k = 10, 4
    hidden, inter = _shape(qtype, rows)
    experts = _experts(qtype, num, hidden, inter, 7 + rows)
    w13, w2 = PackedExpertWeight(experts, "13"), PackedExpertWeight(experts, "2")
    g = torch.Generator("cuda").manual_seed(rows)
    x = torch.randn(rows, hidden, device="cuda", generator=g).bfloat16()
    logits = (torch.randn(rows, num, device="cuda", generator=g) * 2).bfloat16()
    backend = GpuExpertBackend()
    got = backend.forward_logits(0, x, logits, top_k, True, w13, w2)
    assert got is not None and backend.calls["qdecode"] == 1
    w, ids = torch.topk(torch.softmax(logits.float(), -1), top_k, dim=-1)
    expected = _reference(x, ids, w / w.sum(-1, keepdim=True), experts)
    torch.testing.assert_close(got.double(), expected, rtol=0, atol=2e-2 * expected.abs().max())

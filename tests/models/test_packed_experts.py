"""GGUF experts kept packed for the "gpu" expert backend (models/quant/experts.py): which
tensors stay packed, their resident bytes, and logits against the dequantized model. On the
CPU the backend runs the torch reference on the dequantized bytes; the CUDA kernels are
checked in tests/ext/test_cuda_moe_quant.py."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
import torch

from tandem.models.config import UnsupportedModelError
from tandem.models.loader import load_model
from tandem.models.quant.experts import PackedExperts, PackedExpertWeight, expert_names
from tandem.models.quant.tensor import QuantizedTensor
from tests.models.quant_cases import pack, write_tiny_gguf


def _expert_bytes(path: Path) -> int:
    return sum(t.n_bytes for t in gguf.GGUFReader(path).tensors if "_exps" in t.name)


@pytest.mark.parametrize("experts_type", ["Q4_0", "Q8_0", "Q4_K", "Q6_K", "MXFP4"])
def test_gpu_backend_keeps_gguf_experts_packed(tmp_path: Path, experts_type: str, paged_runner):
    path = write_tiny_gguf(tmp_path / "m.gguf", "Q8_0", moe=True, experts_type=experts_type)
    packed, cfg = load_model(
        path, dtype=torch.float32, device="cpu", quantization="gguf", expert_backend="gpu"
    )
    dense, _ = load_model(path, dtype=torch.float32, device="cpu", quantization="none")
    blocks = [layer.mlp for layer in packed.layers]
    assert all(isinstance(b.w13, PackedExpertWeight) for b in blocks)
    assert all(isinstance(layer.mlp.w13, torch.nn.Parameter) for layer in dense.layers)
    assert blocks[0].w13.shape == tuple(dense.layers[0].mlp.w13.shape)
    resident = sum(b.packed_experts.nbytes for b in blocks)
    assert resident == _expert_bytes(path)  # the file's bytes, not a dequantized copy
    for b, d in zip(blocks, dense.layers, strict=True):
        w13, w2 = b.packed_experts.dequantize(torch.float32)
        torch.testing.assert_close(w13, d.mlp.w13, rtol=0, atol=0)
        torch.testing.assert_close(w2, d.mlp.w2, rtol=0, atol=0)
    ids = [int(i) for i in torch.randint(0, 96, (24,), generator=torch.Generator().manual_seed(1))]
    a = paged_runner(packed, cfg, block_size=4).step([(0, ids)])[0]
    b = paged_runner(dense, cfg, block_size=4).step([(0, ids)])[0]
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert packed.expert_backend.calls["torch"] > 0  # no CUDA here: the reference path


def test_other_backends_and_none_dequantize_experts(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "m.gguf", "Q8_0", moe=True, experts_type="Q4_0")
    torch_be, _ = load_model(
        path, dtype=torch.float32, device="cpu", quantization="gguf", expert_backend="torch"
    )
    none, _ = load_model(
        path, dtype=torch.float32, device="cpu", quantization="none", expert_backend="gpu"
    )
    auto_cpu, _ = load_model(path, dtype=torch.float32, device="cpu", expert_backend="gpu")
    for model in (torch_be, none, auto_cpu):  # auto on the CPU: no kernel reads them packed
        assert not any(hasattr(layer.mlp, "packed_experts") for layer in model.layers)


def test_set_part_refuses_wrong_type_and_shape() -> None:
    experts = PackedExperts(expert_names("model.layers.0.mlp.", 0, 2), "Q4_0", 64, 32)
    gate = pack(torch.randn(32, 64).numpy(), "Q4_0")
    experts.set_part(0, QuantizedTensor("Q4_0", torch.from_numpy(gate), 64))
    with pytest.raises(UnsupportedModelError, match="is Q8_0, expected Q4_0"):
        q8 = pack(torch.randn(32, 64).numpy(), "Q8_0")
        experts.set_part(1, QuantizedTensor("Q8_0", torch.from_numpy(q8), 64))
    with pytest.raises(UnsupportedModelError, match=r"shape \(32, 64\), expected \(64, 32\)"):
        experts.set_part(2, QuantizedTensor("Q4_0", torch.from_numpy(gate), 64))
    with pytest.raises(UnsupportedModelError, match="multiples of 256"):
        PackedExperts(expert_names("p.", 0, 1), "Q4_K", 64, 32)


@pytest.mark.gpu
@pytest.mark.parametrize("experts_type", ["Q4_0", "Q4_K", "MXFP4"])
def test_packed_experts_model_on_cuda_close_to_dequantized(
    tmp_path: Path, experts_type: str, paged_runner
):
    import tandem.ext.cuda as cuda_ext

    if not cuda_ext.is_available():
        pytest.skip("needs CUDA and CuPy")
    from tests.models.test_cuda_parity import CudaPagedRunner

    path = write_tiny_gguf(tmp_path / "m.gguf", "Q8_0", moe=True, experts_type=experts_type)
    fast, cfg = load_model(path, dtype=torch.bfloat16, device="cuda", expert_backend="gpu")
    assert all(layer.mlp.packed_experts.data13.is_cuda for layer in fast.layers)
    ref, _ = load_model(
        path, dtype=torch.bfloat16, device="cuda", quantization="none", expert_backend="gpu"
    )
    gen = torch.Generator().manual_seed(2)
    for rows in (1, 2, 7, 16, 64, 300):
        ids = [int(i) for i in torch.randint(0, 96, (rows,), generator=gen)]
        a = CudaPagedRunner(paged_runner, fast, cfg, block_size=16, seed=1).step([(0, ids)])[0]
        b = CudaPagedRunner(paged_runner, ref, cfg, block_size=16, seed=1).step([(0, ids)])[0]
        row_ok = (a - b).abs().amax(-1) <= 0.03 * b.abs().max()
        assert int((~row_ok).sum()) <= max(1, rows // 10), rows  # routing flips allowed
    calls = fast.expert_backend.calls
    assert calls["qgemv"] > 0 and calls["qgrouped"] > 0 and calls["torch"] == 0, calls


def test_mxfp4_to_ggml_blocks_keeps_the_values() -> None:
    from tandem.models.gguf_dequant import dequantize
    from tandem.models.mxfp4 import dequantize_mxfp4, quantize_mxfp4, to_ggml_blocks

    x = torch.randn(6, 96) * torch.logspace(-3, 1, 6)[:, None]
    blocks, scales = quantize_mxfp4(x)
    rows = to_ggml_blocks(blocks, scales)
    assert rows.shape == (6, 3 * 17)
    ours = dequantize(rows.reshape(-1), 39, (6, 96), torch.float32)
    assert torch.equal(ours, dequantize_mxfp4(blocks, scales))


@pytest.mark.gpu
def test_gpt_oss_mxfp4_checkpoint_experts_stay_packed_on_cuda(tmp_path: Path, paged_runner):
    import tandem.ext.cuda as cuda_ext

    if not cuda_ext.is_available():
        pytest.skip("needs CUDA and CuPy")
    import transformers as hf

    from tests.models.test_cuda_parity import CudaPagedRunner
    from tests.models.test_gpt_oss import GPT_OSS, _save_hf_model, _to_mxfp4

    _save_hf_model(hf.GptOssConfig(**GPT_OSS), tmp_path / "q")
    _to_mxfp4(tmp_path / "q")
    fast, cfg = load_model(
        tmp_path / "q", dtype=torch.bfloat16, device="cuda", expert_backend="gpu"
    )
    ref, _ = load_model(
        tmp_path / "q", dtype=torch.bfloat16, device="cuda", expert_backend="gpu",
        quantization="none",
    )  # fmt: skip
    assert all(layer.mlp.packed_experts.qtype == "MXFP4" for layer in fast.layers)
    assert all(isinstance(layer.mlp.w13, torch.nn.Parameter) for layer in ref.layers)
    w13, w2 = fast.layers[0].mlp.packed_experts.dequantize(torch.bfloat16)
    assert torch.equal(w13, ref.layers[0].mlp.w13) and torch.equal(w2, ref.layers[0].mlp.w2)
    gen = torch.Generator().manual_seed(3)
    for rows in (1, 7, 64):
        ids = [int(i) for i in torch.randint(0, 128, (rows,), generator=gen)]
        a = CudaPagedRunner(paged_runner, fast, cfg, block_size=16, seed=1).step([(0, ids)])[0]
        b = CudaPagedRunner(paged_runner, ref, cfg, block_size=16, seed=1).step([(0, ids)])[0]
        row_ok = (a - b).abs().amax(-1) <= 0.03 * b.abs().max()
        assert int((~row_ok).sum()) <= max(1, rows // 10), rows


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_int4_experts_stay_packed_with_gpu_backend(tmp_path: Path, method: str, paged_runner):
    from tests.models.hf_quant_cases import write_quantized

    write_quantized(tmp_path, method, moe=True, group=32)
    packed, cfg = load_model(tmp_path, dtype=torch.bfloat16, device="cpu", expert_backend="gpu")
    dense, _ = load_model(
        tmp_path, dtype=torch.bfloat16, device="cpu", quantization="none", expert_backend="gpu"
    )
    moe = [i for i, layer in enumerate(packed.layers) if hasattr(layer.mlp, "packed_experts")]
    assert moe and all(hasattr(dense.layers[i].mlp, "w13") for i in moe)
    experts = packed.layers[moe[0]].mlp.packed_experts
    assert experts.qtype == "int4" and experts.group == 32
    e, h, inter = experts.num_experts, experts.hidden, experts.inter
    codes = e * 3 * h * inter // 2
    assert experts.nbytes == codes + codes // 16 * 3  # a 2-byte scale and a zero per 32 values
    for i in moe:
        w13, w2 = packed.layers[i].mlp.packed_experts.dequantize(torch.bfloat16)
        torch.testing.assert_close(w13, dense.layers[i].mlp.w13, rtol=0, atol=0)
        torch.testing.assert_close(w2, dense.layers[i].mlp.w2, rtol=0, atol=0)
    ids = [int(i) for i in torch.randint(0, 96, (12,), generator=torch.Generator().manual_seed(4))]
    a = paged_runner(packed, cfg, block_size=4).step([(0, ids)])[0]
    b = paged_runner(dense, cfg, block_size=4).step([(0, ids)])[0]
    torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)


def test_act_order_int4_experts_are_refused_by_name(tmp_path: Path) -> None:
    from tests.models.hf_quant_cases import write_quantized

    write_quantized(tmp_path, "gptq", moe=True, group=32, act_order=True)
    with pytest.raises(UnsupportedModelError, match="act-order .* --quantization none"):
        load_model(tmp_path, dtype=torch.bfloat16, device="cpu", expert_backend="gpu")
    model, _ = load_model(  # the way out the message names
        tmp_path, dtype=torch.bfloat16, device="cpu", expert_backend="gpu", quantization="none"
    )
    assert not any(hasattr(layer.mlp, "packed_experts") for layer in model.layers)


@pytest.mark.gpu
def test_int4_experts_model_on_cuda_close_to_dequantized(tmp_path: Path, paged_runner):
    import tandem.ext.cuda as cuda_ext

    if not cuda_ext.is_available():
        pytest.skip("needs CUDA and CuPy")
    from tests.models.hf_quant_cases import write_quantized
    from tests.models.test_cuda_parity import CudaPagedRunner

    write_quantized(tmp_path, "gptq", moe=True, group=32)
    fast, cfg = load_model(tmp_path, dtype=torch.bfloat16, device="cuda", expert_backend="gpu")
    assert any(hasattr(layer.mlp, "packed_experts") for layer in fast.layers)
    ref, _ = load_model(
        tmp_path, dtype=torch.bfloat16, device="cuda", quantization="none", expert_backend="gpu"
    )
    gen = torch.Generator().manual_seed(5)
    for rows in (1, 7, 64):
        ids = [int(i) for i in torch.randint(0, 96, (rows,), generator=gen)]
        a = CudaPagedRunner(paged_runner, fast, cfg, block_size=16, seed=1).step([(0, ids)])[0]
        b = CudaPagedRunner(paged_runner, ref, cfg, block_size=16, seed=1).step([(0, ids)])[0]
        row_ok = (a - b).abs().amax(-1) <= 0.03 * b.abs().max()
        assert int((~row_ok).sum()) <= max(1, rows // 10), rows


def test_fp8_experts_stay_packed_with_gpu_backend(tmp_path: Path, paged_runner):
    from tests.models.hf_quant_cases import write_quantized

    write_quantized(tmp_path, "fp8", moe=True, scheme="block")  # 32 x 32 blocks
    packed, cfg = load_model(tmp_path, dtype=torch.bfloat16, device="cpu", expert_backend="gpu")
    dense, _ = load_model(
        tmp_path, dtype=torch.bfloat16, device="cpu", quantization="none", expert_backend="gpu"
    )
    moe = [i for i, layer in enumerate(packed.layers) if hasattr(layer.mlp, "packed_experts")]
    experts = packed.layers[moe[0]].mlp.packed_experts
    assert experts.qtype == "fp8" and experts.group == 32
    codes = experts.num_experts * 3 * experts.hidden * experts.inter
    assert experts.nbytes == codes + codes // 32 * 4  # a block's scale on each of its rows
    for i in moe:
        w13, w2 = packed.layers[i].mlp.packed_experts.dequantize(torch.bfloat16)
        torch.testing.assert_close(w13, dense.layers[i].mlp.w13, rtol=0, atol=0)
        torch.testing.assert_close(w2, dense.layers[i].mlp.w2, rtol=0, atol=0)
    ids = [int(i) for i in torch.randint(0, 96, (12,), generator=torch.Generator().manual_seed(6))]
    a = paged_runner(packed, cfg, block_size=4).step([(0, ids)])[0]
    b = paged_runner(dense, cfg, block_size=4).step([(0, ids)])[0]
    torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)

"""GGUF weights kept packed (models/quant): loading, the torch reference forward, options."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from tandem.models.config import UnsupportedModelError
from tandem.models.loader import load_model
from tandem.models.quant.linear import QuantEmbedding, QuantLinear, quantized_bytes
from tandem.models.quant.reference import quantize_k
from tests.models.quant_cases import write_tiny_gguf

TYPES = ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K"])
def test_reference_k_quantizer_roundtrips_through_gguf(qtype: str) -> None:
    x = np.random.default_rng(1).standard_normal((3, 512)).astype(np.float32)
    packed = quantize_k(x, qtype)
    back = gguf.quants.dequantize(packed, Q[qtype])
    step = {"Q4_K": 15, "Q5_K": 31, "Q6_K": 63}[qtype]
    assert np.abs(back - x).max() < 2.5 * (x.max() - x.min()) / step


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
@pytest.mark.parametrize("qtype", TYPES)
def test_packed_model_matches_dequantized(tmp_path: Path, qtype: str, moe: bool, paged_runner):
    path = write_tiny_gguf(tmp_path / "m.gguf", qtype, moe=moe, head_type="Q6_K" if moe else None)
    packed, cfg = load_model(path, dtype=torch.float32, device="cpu", quantization="gguf")
    dense, _ = load_model(path, dtype=torch.float32, device="cpu", quantization="none")
    auto, _ = load_model(path, dtype=torch.float32, device="cpu")  # no float32 kernel: dense
    assert not any(isinstance(m, QuantLinear) for m in auto.modules())
    assert isinstance(packed.layers[0].self_attn.qkv_proj, QuantLinear)
    assert isinstance(packed.embed_tokens, QuantEmbedding)
    assert not any(isinstance(m, QuantLinear) for m in dense.modules())
    # every matrix but the dense MoE experts and norms stays packed: the file's bytes
    file_bytes = sum(t.n_bytes for t in gguf.GGUFReader(path).tensors if t.tensor_type != Q.F32)
    expert_bytes = 0
    if moe:
        expert_bytes = sum(t.n_bytes for t in gguf.GGUFReader(path).tensors if "_exps" in t.name)
    assert quantized_bytes(packed) == file_bytes - expert_bytes
    ids = [int(i) for i in torch.randint(0, 96, (40,), generator=torch.Generator().manual_seed(0))]
    a = paged_runner(packed, cfg, block_size=4).step([(0, ids)])[0]
    b = paged_runner(dense, cfg, block_size=4).step([(0, ids)])[0]
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_quantization_gguf_needs_gguf_and_unknown_is_refused(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "m.gguf", "Q8_0")
    with pytest.raises(ValueError, match="unknown quantization"):
        load_model(path, dtype=torch.float32, device="cpu", quantization="int3")
    model, _ = load_model(path, dtype=torch.float32, device="cpu", quantization="gguf")
    assert isinstance(model.layers[1].mlp.down_proj, QuantLinear)


def test_unservable_type_names_type_and_way_out(tmp_path: Path) -> None:
    path = tmp_path / "q2k.gguf"
    write_tiny_gguf(path, "Q8_0")
    # the same file with one matrix stored as Q2_K bytes
    w = gguf.GGUFWriter(str(tmp_path / "q2.gguf"), "llama")
    r = gguf.GGUFReader(path)
    for field in r.fields.values():
        if field.name.startswith("llama."):
            val = field.contents()
            (w.add_float32 if isinstance(val, float) else w.add_uint32)(field.name, val)
    for t in r.tensors:
        if t.name == "blk.0.attn_output.weight":
            raw = np.zeros((256, 84), np.uint8)  # 256 rows of one Q2_K block each
            w.add_tensor(t.name, raw, raw_dtype=Q.Q2_K)
        else:
            w.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedModelError, match=r"blk\.0\.attn_output\.weight.*Q2_K"):
        load_model(tmp_path / "q2.gguf", dtype=torch.float32, device="cpu")


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
@pytest.mark.parametrize("qtype", TYPES)
def test_cpu_kernel_model_close_to_torch_reference(
    tmp_path: Path, qtype: str, moe: bool, paged_runner
):
    """bf16 model, packed weights through ext/cpu's kernel vs the same weights dequantized by
    torch: logits within 3% of their range at 1, 2, 7, 16, 64 and 300 rows (one prefill each;
    the difference is the rounding of activations (bf16, or int8 per 32 values for Q4_0 / Q4_1 /
    Q8_0 where the CPU has VNNI) and outputs in another summation order).
    MoE: a near-tie in the router may pick another expert for a token under that rounding, so
    there up to a tenth of the tokens (at least one) may fall outside it."""
    from tandem.models.quant.cpu import use_cpu_quant_kernels

    path = write_tiny_gguf(tmp_path / "m.gguf", qtype, moe=moe, head_type="Q8_0" if moe else None)
    fast, cfg = load_model(path, dtype=torch.bfloat16, device="cpu")
    assert all(m.kernel is not None for m in fast.modules() if isinstance(m, QuantLinear))
    ref, _ = load_model(path, dtype=torch.bfloat16, device="cpu", quantization="none")
    assert use_cpu_quant_kernels(ref) == 0
    gen = torch.Generator().manual_seed(1)
    agree = []
    for rows in (1, 2, 7, 16, 64, 300):
        ids = [int(i) for i in torch.randint(0, 96, (rows,), generator=gen)]
        a = paged_runner(fast, cfg, block_size=16, num_blocks=32, dtype=torch.bfloat16).step(
            [(0, ids)]
        )[0]
        b = paged_runner(ref, cfg, block_size=16, num_blocks=32, dtype=torch.bfloat16).step(
            [(0, ids)]
        )[0]
        row_ok = (a - b).abs().amax(-1) <= 0.03 * b.abs().max()
        allowed = max(1, rows // 10) if moe else 0  # tokens whose routing may flip
        assert int((~row_ok).sum()) <= allowed, rows
        agree.append(a.argmax(-1) == b.argmax(-1))
    if not moe:  # over all 390 rows: a single row's near-tie may go either way
        assert torch.cat(agree).float().mean() >= 0.9

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
from tandem.models.quant.tensor import QuantizedTensor
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


def _round_like_int8_path(fast: torch.nn.Module, ref: torch.nn.Module) -> int:
    """Give each of ref's linears whose twin in fast takes the int8-activation kernel the
    kernel's activation rounding (reference.quantize_activations), computed in float32. (A
    quantized head has no twin by name; its rounding reaches only the logits.)"""
    from tandem.ext.cpu.reference import quantize_activations

    def hook(m: torch.nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        x = quantize_activations(args[0].float())
        bias = None if m.bias is None else m.bias.float()
        return torch.nn.functional.linear(x, m.weight.float(), bias).to(out.dtype)

    mods = dict(ref.named_modules())
    n = 0
    for name, m in fast.named_modules():
        if (
            name in mods
            and isinstance(m, QuantLinear)
            and all(
                isinstance(s, QuantizedTensor) and m.kernel.pool.int8_serves(s.qtype)
                for s in m.segments
            )
        ):
            mods[name].register_forward_hook(hook)
            n += 1
    return n


def _capture_router(model: torch.nn.Module) -> list[torch.Tensor]:
    """The router logits of each MoE layer in call order, appended on every forward."""
    seen: list[torch.Tensor] = []
    for name, m in model.named_modules():
        if name.endswith("mlp.gate"):
            m.register_forward_hook(lambda _m, _a, out: seen.append(out.detach().float()))
    assert seen == [] and any(n.endswith("mlp.gate") for n, _ in model.named_modules())
    return seen


def _first_reroute(fast: list[torch.Tensor], ref: list[torch.Tensor], k: int, rows: int) -> int:
    """The first token whose top-k experts differ in some layer (rows if none); it must be a
    near tie in the reference: its k-th and k+1-th logits no further apart than twice the
    largest change of its logits."""
    assert len(fast) == len(ref) > 0
    first = rows
    for f, r in zip(fast, ref, strict=True):
        fk, rk = f.topk(k, -1).indices.sort(-1).values, r.topk(k, -1).indices.sort(-1).values
        moved = (fk != rk).any(-1).nonzero().flatten()
        if len(moved):
            t = int(moved[0])
            if t < first:
                top = r[t].sort(descending=True).values
                shift = (f[t] - r[t]).abs().max()  # the rounding's change of the logits
                assert top[k - 1] - top[k] <= 2 * shift, ("not a tie", t)
                first = t
    return first


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
@pytest.mark.parametrize("qtype", TYPES)
def test_cpu_kernel_model_close_to_torch_reference(
    tmp_path: Path, qtype: str, moe: bool, paged_runner
):
    """bf16 model, packed weights through ext/cpu's kernel vs the same weights dequantized by
    torch: logits within 3% of their range at 1, 2, 7, 16, 64 and 300 rows (one prefill each;
    the difference is the rounding of activations to bf16 and outputs in another summation
    order; where the kernel takes the int8-activation path (VNNI or AVX2) the reference's
    linear rounds its input the same way, per 32 values).
    MoE: a near-tie in the router may pick another expert for a token under that rounding, and
    attention carries that token's changed state to every later one: there the rows before the
    first token routed differently are compared, and that token's reference router must be
    near a tie (_first_reroute)."""
    from tandem.models.quant.cpu import use_cpu_quant_kernels

    path = write_tiny_gguf(tmp_path / "m.gguf", qtype, moe=moe, head_type="Q8_0" if moe else None)
    fast, cfg = load_model(path, dtype=torch.bfloat16, device="cpu")
    assert all(m.kernel is not None for m in fast.modules() if isinstance(m, QuantLinear))
    ref, _ = load_model(path, dtype=torch.bfloat16, device="cpu", quantization="none")
    assert use_cpu_quant_kernels(ref) == 0
    _round_like_int8_path(fast, ref)
    gates = {"fast": _capture_router(fast), "ref": _capture_router(ref)} if moe else {}
    gen = torch.Generator().manual_seed(1)
    agree = []
    for rows in (1, 2, 7, 16, 64, 300):
        ids = [int(i) for i in torch.randint(0, 96, (rows,), generator=gen)]
        for g in gates.values():
            g.clear()
        a = paged_runner(fast, cfg, block_size=16, num_blocks=32, dtype=torch.bfloat16).step(
            [(0, ids)]
        )[0]
        b = paged_runner(ref, cfg, block_size=16, num_blocks=32, dtype=torch.bfloat16).step(
            [(0, ids)]
        )[0]
        row_ok = (a - b).abs().amax(-1) <= 0.03 * b.abs().max()
        if moe:
            first = _first_reroute(gates["fast"], gates["ref"], cfg.num_experts_per_tok, rows)
            row_ok = row_ok[:first]
        assert bool(row_ok.all()), rows
        agree.append(a.argmax(-1) == b.argmax(-1))
    if not moe:  # over all 390 rows: a single row's near-tie may go either way
        assert torch.cat(agree).float().mean() >= 0.9

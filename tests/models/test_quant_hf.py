"""GPTQ, AWQ and FP8 safetensors checkpoints (written by tests/models/hf_quant_cases.py's own
quantizer in the formats' real layouts): the reader decodes them to exactly the quantizer's
weights, the packed model matches transformers holding those weights, bad configs are refused
naming the format, and resident bytes stay within 5% of the checkpoint's quantized bytes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tandem.models.config import UnsupportedModelError
from tandem.models.loader import load_model
from tandem.models.loader.safetensors import iter_safetensors_weights
from tandem.models.quant.fp8 import Fp8Tensor
from tandem.models.quant.int4 import Int4Tensor
from tandem.models.quant.linear import QuantLinear, quantized_bytes
from tests.models.hf_quant_cases import write_quantized

INT4_CASES = [
    ("gptq", dict(group=32, sym=True)),
    ("gptq", dict(group=64, sym=False)),
    ("gptq", dict(group=32, sym=False, act_order=True)),
    ("gptq", dict(group=-1, sym=True)),
    ("gptq", dict(group=32, sym=False, v2=True)),
    ("awq", dict(group=32)),
    ("awq", dict(group=128)),
]
FP8_CASES = [("fp8", dict(scheme=s)) for s in ("tensor", "channel", "block")]
CASES = INT4_CASES + FP8_CASES
IDS = [f"{m}-{'-'.join(f'{k}{v}' for k, v in o.items())}" for m, o in CASES]


@pytest.mark.parametrize(("method", "opts"), CASES, ids=IDS)
def test_reader_decodes_the_quantizers_weights(tmp_path: Path, method: str, opts: dict) -> None:
    _, deq = write_quantized(tmp_path, method, **opts)
    seen = 0
    for name, t in iter_safetensors_weights(tmp_path, torch.float32, packed=frozenset(deq)):
        if name in deq:
            assert isinstance(t, Fp8Tensor if method == "fp8" else Int4Tensor)
            torch.testing.assert_close(t.dequantize(), deq[name], rtol=0, atol=0)
            seen += 1
    assert seen == len(deq)
    dense = dict(iter_safetensors_weights(tmp_path, torch.float32))
    for name, d in deq.items():
        torch.testing.assert_close(dense[name], d, rtol=0, atol=0)


def test_gptq_v1_zero_point_zero_is_stored_as_15() -> None:
    """v1 stores zero - 1 in a nibble, so a zero point of 0 is on disk as 15 and reads back 0."""
    from tandem.models.quant.int4 import from_gptq
    from tests.models.hf_quant_cases import dequant_int4, pack_gptq

    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (16, 64), generator=g, dtype=torch.int32)
    scales = (torch.rand(16, 2, generator=g) * 0.01 + 0.001).half()
    zeros = torch.randint(0, 16, (16, 2), generator=g, dtype=torch.int32)
    zeros[:, 0] = 0
    g_idx = (torch.arange(64) // 32).to(torch.int32)
    p = pack_gptq(codes, scales, zeros, g_idx)
    assert int(p["qzeros"][0, 0] & 15) == 15
    w = from_gptq("w", p["qweight"], p["qzeros"], p["scales"], p["g_idx"], 32, zero_offset=1)
    torch.testing.assert_close(w.dequantize(), dequant_int4(codes, scales, zeros, g_idx))


def _checkpoint_quant_bytes(path: Path) -> int:
    total = 0
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        for name in f.keys():  # noqa: SIM118
            quantized = any(name.endswith(s) for s in (".qweight", ".qzeros", ".scales", ".g_idx"))
            t = f.get_tensor(name)
            if (
                quantized
                or t.dtype == torch.float8_e4m3fn
                or name.endswith("_scale")
                or (name.endswith("_scale_inv"))
            ):
                total += t.numel() * t.element_size()
    return total


MODEL_CASES, MODEL_IDS = [], []
for case_id, (case_method, case_opts) in zip(IDS, CASES, strict=True):
    for case_moe in (False, True):
        if not (case_moe and case_opts.get("group") == 128):  # experts' 64-wide down_proj
            MODEL_CASES.append((case_method, case_opts, case_moe))
            MODEL_IDS.append(f"{case_id}-{'moe' if case_moe else 'dense'}")


@pytest.mark.parametrize(("method", "opts", "moe"), MODEL_CASES, ids=MODEL_IDS)
def test_packed_model_matches_hf(tmp_path: Path, method: str, opts: dict, moe: bool, paged_runner):
    """float32, packed layers through the torch reference: logits of transformers holding the
    dequantized weights (1e-4); the dense projections stay packed, their bytes within 5% of
    the checkpoint's."""
    ref, _ = write_quantized(tmp_path, method, moe=moe, **opts)
    model, cfg = load_model(tmp_path, dtype=torch.float32, device="cpu", quantization=method)
    linears = [m for m in model.modules() if isinstance(m, QuantLinear)]
    dense_mlps = 1 if moe else cfg.num_hidden_layers  # the MoE case's layer 0 is dense
    assert len(linears) == 2 * cfg.num_hidden_layers + 2 * dense_mlps
    if opts.get("act_order"):  # down_proj's gather folded into gate_up; qkv and o keep theirs
        downs = [m.down_proj for m in model.modules()
                 if isinstance(getattr(m, "down_proj", None), QuantLinear)]  # fmt: skip
        assert downs and all(d.segments[0].perm is None for d in downs)
        assert all(layer.self_attn.qkv_proj.segments[0].perm is not None for layer in model.layers)
    ids = [5, 17, 3, 60, 9, 1, 33, 2, 90, 127, 0]
    ours = paged_runner(model, cfg, block_size=4).step([(0, ids)])[0]
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-4)
    if not moe:
        assert quantized_bytes(model) <= 1.05 * _checkpoint_quant_bytes(tmp_path)


KERNEL_CASES = [
    ("gptq", dict(group=32, sym=True), False),
    ("gptq", dict(group=64, sym=False, act_order=True), False),
    ("awq", dict(group=32), True),
    ("gptq", dict(group=32, sym=False, act_order=True), True),
    ("fp8", dict(scheme="block"), False),
    ("fp8", dict(scheme="channel"), True),
    ("fp8", dict(scheme="tensor"), False),
]


@pytest.mark.parametrize(("method", "opts", "moe"), KERNEL_CASES)
def test_cpu_kernels_close_to_torch_reference(
    tmp_path: Path, method: str, opts: dict, moe: bool, paged_runner
) -> None:
    """bf16 model with the packed weights through ext/cpu's kernel vs the same checkpoint
    dequantized at load (torch): logits within 3% of their range at 1, 2, 7, 16, 64 and 300
    rows (bf16 rounding of activations and outputs in another order). MoE: a near-tie in the
    router may flip a tenth of the tokens (at least one)."""
    from tandem.ext.cpu import supported_isas

    write_quantized(tmp_path, method, moe=moe, **opts)
    fast, cfg = load_model(tmp_path, dtype=torch.bfloat16, device="cpu")
    linears = [m for m in fast.modules() if isinstance(m, QuantLinear)]
    assert linears and all(m.kernel is not None for m in linears)
    if "avx512" in supported_isas():
        assert all(m.kernel.vector for m in linears)
    ref, _ = load_model(tmp_path, dtype=torch.bfloat16, device="cpu", quantization="none")
    assert not any(isinstance(m, QuantLinear) for m in ref.modules())
    gen = torch.Generator().manual_seed(1)
    for rows in (1, 2, 7, 16, 64, 300):
        ids = [int(i) for i in torch.randint(0, 128, (rows,), generator=gen)]
        run = [paged_runner(m, cfg, block_size=16, num_blocks=32, dtype=torch.bfloat16)
               for m in (fast, ref)]  # fmt: skip
        a, b = (r.step([(0, ids)])[0] for r in run)
        row_ok = (a - b).abs().amax(-1) <= 0.03 * b.abs().max()
        allowed = max(1, rows // 10) if moe else 0
        assert int((~row_ok).sum()) <= allowed, rows


@pytest.mark.parametrize("method", ["gptq", "fp8"])
def test_moe_experts_go_to_the_cpu_pool(tmp_path: Path, method: str, paged_runner) -> None:
    """--cpu-experts on a GPTQ / FP8 checkpoint: each layer's experts are dequantized right
    before the pool converts them (bf16 here) and the torch copies freed; logits as the
    torch experts' within 3% of their range."""
    write_quantized(tmp_path, method, moe=True, group=32)
    options = {"num_threads": 1, "expert_cache": False}
    pooled, cfg = load_model(tmp_path, dtype=torch.bfloat16, device="cpu",
                             expert_backend="cpu_pool", expert_options=options)  # fmt: skip
    ref, _ = load_model(tmp_path, dtype=torch.bfloat16, device="cpu")
    assert all(b.w13.numel() == 0 for b in pooled.modules() if hasattr(b, "w13"))
    ids = [5, 17, 3, 60, 9, 1, 33, 2, 90, 127, 0]
    a = paged_runner(pooled, cfg, block_size=4, dtype=torch.bfloat16).step([(0, ids)])[0]
    b = paged_runner(ref, cfg, block_size=4, dtype=torch.bfloat16).step([(0, ids)])[0]
    assert int(((a - b).abs().amax(-1) > 0.03 * b.abs().max()).sum()) <= 1
    pooled.expert_backend.close()


def _config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


@pytest.mark.parametrize(
    ("quant", "message"),
    [
        ({"quant_method": "gptq", "bits": 8, "group_size": 128}, "GPTQ with 8-bit"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 48}, "GPTQ group size 48"),
        ({"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemv"}, "AWQ version"),
        ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method 'bitsandbytes'"),
        ({"quant_method": "compressed-tensors", "format": "pack-quantized"}, "compressed-tensors"),
        ({"quant_method": "fp8", "fmt": "e5m2"}, "FP8 format 'e5m2'"),
    ],
)
def test_unsupported_config_is_refused_naming_the_format(
    tmp_path: Path, quant: dict, message: str
) -> None:
    write_quantized(tmp_path, "gptq", group=32)
    config = _config(tmp_path)
    config["quantization_config"] = quant
    (tmp_path / "config.json").write_text(json.dumps(config))
    for q in ("auto", "none"):
        with pytest.raises(UnsupportedModelError, match=message):
            load_model(tmp_path, dtype=torch.bfloat16, device="cpu", quantization=q)


def test_quantization_flag_names_the_format_when_config_json_does_not(tmp_path: Path) -> None:
    ref, _ = write_quantized(tmp_path, "awq", group=64, config_json=False)
    with pytest.raises(UnsupportedModelError, match="--quantization gptq or --quantization awq"):
        load_model(tmp_path, dtype=torch.float32, device="cpu")
    model, cfg = load_model(tmp_path, dtype=torch.float32, device="cpu", quantization="awq")
    assert any(isinstance(m, QuantLinear) for m in model.modules())
    with pytest.raises(ValueError, match="needs an HF safetensors"):
        load_model(tmp_path / "x.gguf", dtype=torch.float32, device="cpu", quantization="gptq")
    write_quantized(tmp_path / "f", "fp8", scheme="channel")
    with pytest.raises(UnsupportedModelError, match="--quantization gptq but .* says fp8"):
        load_model(tmp_path / "f", dtype=torch.float32, device="cpu", quantization="gptq")


def test_int4_experts_reach_the_pool_one_layer_at_a_time(tmp_path: Path, monkeypatch) -> None:
    """--cpu-experts all on a GPTQ checkpoint: a layer's experts are read (and dequantized)
    right before that layer is converted into the pool, never all layers first."""
    from tandem.ext.cpu import CpuExpertPool
    from tandem.models.loader import safetensors as st_loader
    from tandem.models.weights import expert_layer
    from tests.models import hf_quant_cases

    monkeypatch.setitem(hf_quant_cases.DENSE, "num_hidden_layers", 3)
    write_quantized(tmp_path, "gptq", moe=True, group=32)
    events: list[tuple[str, int]] = []
    read = st_loader.iter_safetensors_weights

    def spy_read(*args, **kwargs):
        for name, t in read(*args, **kwargs):
            if expert_layer(name) is not None:
                assert not isinstance(t, Int4Tensor)  # dequantized for the pool
                events.append(("read", expert_layer(name)))
            yield name, t

    add = CpuExpertPool.add_layer

    def spy_add(self, layer, *args, **kwargs):
        events.append(("convert", layer))
        return add(self, layer, *args, **kwargs)

    monkeypatch.setattr(st_loader, "iter_safetensors_weights", spy_read)
    monkeypatch.setattr(CpuExpertPool, "add_layer", spy_add)
    options = {"num_threads": 1, "expert_cache": False, "fmt": "int4"}
    model, _ = load_model(tmp_path, dtype=torch.bfloat16, device="cpu", expert_backend="cpu_pool",
                          expert_options=options)  # fmt: skip
    collapsed = [e for i, e in enumerate(events) if i == 0 or e != events[i - 1]]
    assert collapsed == [("read", 1), ("convert", 1), ("read", 2), ("convert", 2)]
    model.expert_backend.close()


def test_cuda_dispatch_leaves_hf_segments_to_hf_linear(tmp_path: Path) -> None:
    """The CUDA set-up re-lays GGUF segments into tiles and pairs tiled gate_up rows; GPTQ and
    FP8 segments are neither (checked on the CPU: no GPU needed for the layout decisions)."""
    from tandem.models.quant.cuda import pair_gate_up, tile_segments

    for method in ("gptq", "fp8"):
        write_quantized(tmp_path / method, method, group=32)
        model, _ = load_model(tmp_path / method, dtype=torch.float32, device="cpu",
                              quantization=method)  # fmt: skip
        linears = [m for m in model.modules() if isinstance(m, QuantLinear)]
        assert linears and all(tile_segments(m) == 0 for m in linears)
        assert not any(pair_gate_up(m) for m in model.modules())


def test_quant_config_forms() -> None:
    from tandem.models.quant.hf_config import HfQuantConfig, parse_quant_config

    assert parse_quant_config(None) is None
    assert parse_quant_config({"quant_method": "gptq", "bits": 4, "group_size": -1}) == (
        HfQuantConfig("gptq", 0, 1)
    )
    assert parse_quant_config({"quant_method": "awq", "bits": 4, "group_size": 64}) == (
        HfQuantConfig("awq", 64)
    )
    assert parse_quant_config({"quant_method": "fbgemm_fp8"}) == HfQuantConfig("fp8")
    blocks = {"quant_method": "compressed-tensors", "format": "float-quantized",
              "config_groups": {"group_0": {"weights": {"num_bits": 8, "type": "float",
              "strategy": "block", "block_structure": [64, 128]}}}}  # fmt: skip
    assert parse_quant_config(blocks) == HfQuantConfig("fp8", block=(64, 128))
    with pytest.raises(UnsupportedModelError, match="quant_method ''"):
        parse_quant_config({"bits": 4})


def test_compressed_tensors_fp8_with_input_scales(tmp_path: Path, paged_runner) -> None:
    """compressed-tensors' float-quantized FP8 (weight_scale per channel, a static input_scale
    Tandem does not use) loads packed and matches transformers holding the decoded weights."""
    from safetensors.torch import load_file, save_file

    ref, deq = write_quantized(tmp_path, "fp8", scheme="channel")
    tensors = load_file(tmp_path / "model.safetensors")
    for name in deq:
        tensors[name[: -len("weight")] + "input_scale"] = torch.tensor(0.02)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    config = _config(tmp_path)
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "float-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 8, "type": "float", "strategy": "channel"}}},
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    model, cfg = load_model(tmp_path, dtype=torch.float32, device="cpu", quantization="fp8")
    assert any(isinstance(m, QuantLinear) for m in model.modules())
    ids = [5, 17, 3, 60, 9, 1, 33]
    ours = paged_runner(model, cfg, block_size=4).step([(0, ids)])[0]
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-4)

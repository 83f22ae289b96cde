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


def _checkpoint_quant_bytes(path: Path) -> int:
    total = 0
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        for name in f.keys():  # noqa: SIM118
            quantized = any(name.endswith(s) for s in (".qweight", ".qzeros", ".scales", ".g_idx"))
            t = f.get_tensor(name)
            if quantized or t.dtype == torch.float8_e4m3fn or name.endswith("_scale") or (
                name.endswith("_scale_inv")
            ):
                total += t.numel() * t.element_size()
    return total


MODEL_CASES = [(m, o, moe) for m, o in CASES for moe in (False, True)
               if not (moe and o.get("group") == 128)]  # experts' 64-wide down_proj: no g128
MODEL_IDS = [f"{i}-{'moe' if moe else 'dense'}" for i, (_, _, moe) in
             zip([i for i, (_, o) in zip(IDS, CASES) for moe in (False, True)
                  if not (moe and o.get("group") == 128)], MODEL_CASES)]  # fmt: skip


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
    ids = [5, 17, 3, 60, 9, 1, 33, 2, 90, 127, 0]
    ours = paged_runner(model, cfg, block_size=4).step([(0, ids)])[0]
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-4)
    if not moe:
        assert quantized_bytes(model) <= 1.05 * _checkpoint_quant_bytes(tmp_path)

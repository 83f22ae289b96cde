"""FP8 checkpoints as DeepSeek ships them (e4m3 linear weights with a float32 weight_scale_inv
per block, per-expert tensors, router and embeddings unquantized), written here from tiny random
HF models: the loader decodes them to the model dtype, and the experts go to the CPU pool layer
by layer; both give the logits of the HF model holding the decoded weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tandem.models.config import UnsupportedModelError
from tandem.models.loader import load_model
from tandem.models.quant.fp8 import dequant_fp8_blockwise
from tests.models.deepseek_cases import save_deepseek

BLOCK = (16, 16)  # the tiny shapes (24, 40, 64 ...) leave partial edge blocks


def _quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [out, in] -> (fp8 values, scale_inv per block, the dequantized weight), with
    power-of-two scales so the decoded weight is exact in bf16 too. Block by block, loops."""
    rows, cols = w.shape
    nr, nc = -(-rows // BLOCK[0]), -(-cols // BLOCK[1])
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    scale = torch.empty(nr, nc)
    deq = torch.empty(rows, cols)
    for i in range(nr):
        for j in range(nc):
            r, c = slice(i * BLOCK[0], (i + 1) * BLOCK[0]), slice(j * BLOCK[1], (j + 1) * BLOCK[1])
            amax = float(w[r, c].abs().max().clamp(min=1e-12))
            s = 2.0 ** torch.ceil(torch.log2(torch.tensor(amax / 448.0))).item()
            q[r, c] = (w[r, c] / s).to(torch.float8_e4m3fn)
            scale[i, j] = s
            deq[r, c] = q[r, c].float() * s
    return q, scale, deq


def _fp8_checkpoint(tmp_path: Path) -> torch.nn.Module:
    """The "v3" case as an FP8 checkpoint in tmp_path; returns the HF model with the weights
    the checkpoint decodes to."""
    ref = save_deepseek("v3", tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if ".mlp.experts." in name and t.dim() == 3:  # fused [E, ...] -> DeepSeek's per expert
            prefix, kind = name.rsplit(".", 1)
            for e in range(t.shape[0]):
                if kind == "down_proj":
                    out[f"{prefix}.{e}.down_proj.weight"] = t[e]
                else:
                    gate, up = t[e].chunk(2)
                    out[f"{prefix}.{e}.gate_proj.weight"] = gate
                    out[f"{prefix}.{e}.up_proj.weight"] = up
        else:
            out[name] = t
    state = {}
    for name, t in list(out.items()):
        quantized = (t.dim() == 2 and name.endswith("_proj.weight")) or "kv_a_proj" in name
        if quantized and ".bias" not in name:
            q, s, deq = _quantize(t.float())
            out[name], out[name + "_scale_inv"] = q, s
            state[name] = deq
    save_file({k: v.contiguous() for k, v in out.items()}, tmp_path / "model.safetensors",
              metadata={"format": "pt"})  # fmt: skip
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                     "activation_scheme": "dynamic",
                                     "weight_block_size": list(BLOCK)}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    with torch.no_grad():  # the HF model takes the decoded weights
        params = dict(ref.named_parameters())
        for name, deq in state.items():
            if ".mlp.experts." in name:
                layer_prefix, rest = name.split(".mlp.experts.")
                e, proj, _ = rest.split(".")
                inter = deq.shape[0] if proj != "down_proj" else None
                if proj == "down_proj":
                    params[f"{layer_prefix}.mlp.experts.down_proj"][int(e)] = deq
                else:
                    off = 0 if proj == "gate_proj" else inter
                    params[f"{layer_prefix}.mlp.experts.gate_up_proj"][
                        int(e), off : off + inter
                    ] = deq
            else:
                params[name].copy_(deq)
    return ref


def test_dequant_fp8_blockwise_tiles_partial_blocks() -> None:
    w = torch.randn(40, 24)
    q, s, deq = _quantize(w)
    assert torch.equal(dequant_fp8_blockwise(q, s, BLOCK), deq)
    assert (deq - w).abs().max() <= 0.07 * w.abs().max()  # e4m3: 3 mantissa bits
    with pytest.raises(ValueError, match="do not tile"):
        dequant_fp8_blockwise(q, s[:, :1], BLOCK)


@pytest.mark.parametrize("experts", ["torch", "cpu_pool"])
def test_fp8_checkpoint_matches_hf(experts: str, tmp_path: Path, paged_runner) -> None:
    ref = _fp8_checkpoint(tmp_path)
    options = {"isa": "scalar", "num_threads": 1} if experts == "cpu_pool" else None
    model, config = load_model(tmp_path, dtype=torch.float32, device="cpu",
                               expert_backend=experts, expert_options=options)  # fmt: skip
    ids = [5, 17, 3, 60, 9, 1, 33, 2, 90]
    ours = paged_runner(model, config, block_size=4).step([(0, ids)])[0]
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-4)
    if experts == "cpu_pool":
        assert all(b.w13.numel() == 0 for b in model.modules() if hasattr(b, "w13"))
        model.expert_backend.close()


def test_fp8_experts_reach_the_pool_one_layer_at_a_time(tmp_path: Path, monkeypatch) -> None:
    """--cpu-experts all on an FP8 safetensors checkpoint: a layer's experts are read (and
    decoded) right before that layer is converted into the pool, never all layers first."""
    from tandem.ext.cpu import CpuExpertPool
    from tandem.models.loader import safetensors as st_loader
    from tandem.models.weights import expert_layer

    _fp8_checkpoint(tmp_path)
    events: list[tuple[str, int]] = []
    read = st_loader.iter_safetensors_weights

    def spy_read(*args, **kwargs):
        for name, t in read(*args, **kwargs):
            if expert_layer(name) is not None:
                events.append(("read", expert_layer(name)))
            yield name, t

    add = CpuExpertPool.add_layer

    def spy_add(self, layer, *args, **kwargs):
        events.append(("convert", layer))
        return add(self, layer, *args, **kwargs)

    monkeypatch.setattr(st_loader, "iter_safetensors_weights", spy_read)
    monkeypatch.setattr(CpuExpertPool, "add_layer", spy_add)
    model, _ = load_model(tmp_path, dtype=torch.bfloat16, device="cpu", expert_backend="cpu_pool",
                          expert_options={"isa": "scalar", "num_threads": 1,
                                          "expert_cache": False})  # fmt: skip
    collapsed = [e for i, e in enumerate(events) if i == 0 or e != events[i - 1]]
    assert collapsed == [("read", 1), ("convert", 1), ("read", 2), ("convert", 2)]
    model.expert_backend.close()


def test_fp8_weight_without_scale_is_refused(tmp_path: Path) -> None:
    _fp8_checkpoint(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.0.self_attn.o_proj.weight_scale_inv"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(UnsupportedModelError, match="o_proj.weight_scale_inv"):
        load_model(tmp_path, dtype=torch.float32, device="cpu")

"""Linear biases where transformers' code for the family has them, and nowhere else: the config
flags against the modules transformers builds from the same config, the dummy loader, and the
bf16 CPU fast linears (logits parity with HF per family: tests/models/test_hf_parity.py)."""

from __future__ import annotations

import pytest
import torch
import transformers as hf

from tandem.models.config import ModelConfig
from tandem.models.loader import load_model
from tests.models.test_hf_parity import _save_hf_model

TINY = dict(
    vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
    num_attention_heads=2, num_key_value_heads=1,
)  # fmt: skip
MOE = dict(num_experts=2, num_experts_per_tok=1, moe_intermediate_size=16)
# Flags each family's config may carry; a family whose code has no such switch ignores them.
FLAGS = [
    (hf.LlamaConfig, {}),
    (hf.LlamaConfig, dict(attention_bias=True)),
    (hf.LlamaConfig, dict(mlp_bias=True)),
    (hf.MistralConfig, dict(attention_bias=True, mlp_bias=True)),
    (hf.Qwen2Config, dict(attention_bias=False, mlp_bias=True)),
    (hf.Qwen3Config, dict(attention_bias=True, mlp_bias=True)),
    (hf.Qwen3Config, {}),
    (hf.Qwen3MoeConfig, dict(**MOE, attention_bias=True, mlp_bias=True, mlp_only_layers=[0])),
    (hf.Qwen2MoeConfig, dict(**MOE, qkv_bias=True, attention_bias=True)),
    (hf.Qwen2MoeConfig, dict(**MOE, qkv_bias=False)),
    (hf.MixtralConfig, dict(num_local_experts=2, num_experts_per_tok=1, attention_bias=True)),
    (hf.OlmoeConfig, dict(num_experts=2, num_experts_per_tok=1, attention_bias=True)),
    (hf.OlmoeConfig, dict(num_experts=2, num_experts_per_tok=1, mlp_bias=True)),
]


def _has_bias(linear: torch.nn.Linear) -> bool:
    return linear.bias is not None


@pytest.mark.parametrize("config_cls,flags", FLAGS)
def test_bias_flags_follow_transformers(config_cls, flags: dict) -> None:
    hf_cfg = config_cls(**TINY, **flags)
    ours = ModelConfig.from_hf_dict(hf_cfg.to_dict())
    layer = hf.AutoModelForCausalLM.from_config(hf_cfg).model.layers[0]
    attn = layer.self_attn
    assert ours.attention_bias is _has_bias(attn.q_proj) is _has_bias(attn.v_proj)
    assert ours.o_proj_bias is _has_bias(attn.o_proj)
    if hasattr(layer.mlp, "gate_proj"):  # a dense MLP
        mlp = layer.mlp
        assert ours.mlp_bias is _has_bias(mlp.gate_proj) is _has_bias(mlp.down_proj)


def test_dummy_weights_fill_the_biases(tmp_path) -> None:
    d = hf.LlamaConfig(**TINY, attention_bias=True, mlp_bias=True).to_dict()
    config = ModelConfig.from_hf_dict(d)
    model, _ = load_model(
        tmp_path, dtype=torch.float32, device="cpu", load_format="dummy", config=config
    )
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    for bias in (attn.qkv_proj.bias, attn.o_proj.bias, mlp.gate_up_proj.bias, mlp.down_proj.bias):
        assert bias is not None and 0.01 < float(bias.std()) < 0.03


def test_cpu_fast_linears_add_the_biases(tmp_path, paged_runner, monkeypatch) -> None:
    """bf16 on the CPU: decode rows (M <= 4) go through ext/cpu's kernel, which must add every
    bias; its logits against the same bf16 model on torch's linears."""
    from tandem.models.layers.cpu_linear import CpuDenseLinear

    _save_hf_model(hf.LlamaConfig(**TINY, attention_bias=True, mlp_bias=True), tmp_path)
    models = {}
    for fmt in ("0", "bf16"):
        monkeypatch.setenv("TANDEM_CPU_LINEAR", fmt)
        models[fmt], config = load_model(tmp_path, dtype=torch.bfloat16, device="cpu")
    layer = models["bf16"].layers[0]
    for linear in (layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
        assert isinstance(linear, CpuDenseLinear) and linear.bias is not None
    rows = {}
    for fmt, model in models.items():
        runner = paged_runner(model, config, block_size=4, dtype=torch.bfloat16)
        rows[fmt] = [runner.step([(0, [3, 1, 4, 1, 5])])[0]]
        rows[fmt] += [runner.step([(0, [t])])[0] for t in (9, 2, 6)]
    ref, fast = torch.cat(rows["0"]), torch.cat(rows["bf16"])
    assert ((fast - ref).norm(dim=-1) / ref.norm(dim=-1)).max() < 2e-2

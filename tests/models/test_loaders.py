"""models/loader: sharded safetensors, fused expert layouts, error messages naming the
offending tensor or architecture, dummy weights, backend registries."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch
import transformers as hf
from safetensors.torch import load_file, save_file

from tandem.models.config import ModelConfig, UnsupportedModelError
from tandem.models.layers.expert_registry import get_expert_backend, register_expert_backend
from tandem.models.layers.experts import TorchExpertBackend
from tandem.models.loader import build_model, load_model
from tandem.models.loader.safetensors import iter_safetensors_weights
from tandem.models.registry import MODEL_MODULES, get_model_class

TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)


def _save(config: hf.PretrainedConfig, path: Path, **save_kwargs: object) -> torch.nn.Module:
    torch.manual_seed(0)
    model = hf.AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(path, **save_kwargs)
    return model


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return dict(model.named_parameters())


def _assert_same_params(a: torch.nn.Module, b: torch.nn.Module) -> None:
    pa, pb = _params(a), _params(b)
    assert pa.keys() == pb.keys()
    for name in pa:
        torch.testing.assert_close(pa[name], pb[name], rtol=0, atol=0, msg=name)


def _rewrite(path: Path, edit) -> None:
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def test_sharded_safetensors_with_index(tmp_path: Path) -> None:
    cfg = hf.Qwen2Config(**TINY)
    _save(cfg, tmp_path / "one")
    _save(cfg, tmp_path / "sharded", max_shard_size="40KB")
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    single, _ = load_model(tmp_path / "one", dtype=torch.float32, device="cpu")
    sharded, _ = load_model(tmp_path / "sharded", dtype=torch.float32, device="cpu")
    _assert_same_params(single, sharded)
    assert not any(p.requires_grad for p in sharded.parameters()) and not sharded.training
    names = [n for n, _ in iter_safetensors_weights(tmp_path / "sharded", torch.bfloat16)]
    assert sorted(names) == sorted(index["weight_map"])
    _, t = next(iter_safetensors_weights(tmp_path / "sharded", torch.bfloat16))
    assert t.dtype == torch.bfloat16


@pytest.mark.parametrize(
    "config",
    [
        hf.MixtralConfig(**TINY, num_local_experts=4, num_experts_per_tok=2),
        hf.Qwen2MoeConfig(
            **TINY,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
        ),
        hf.OlmoeConfig(**TINY, num_experts=4, num_experts_per_tok=2),
    ],
    ids=["mixtral", "qwen2_moe", "olmoe"],
)
def test_fused_3d_expert_layout_matches_per_expert(
    config: hf.PretrainedConfig, tmp_path: Path
) -> None:
    model = _save(config, tmp_path / "per_expert")
    fused_dir = tmp_path / "fused"
    fused_dir.mkdir()
    (fused_dir / "config.json").write_text((tmp_path / "per_expert" / "config.json").read_text())
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)  # transformers' 3-D layout
    save_file(state, fused_dir / "model.safetensors", metadata={"format": "pt"})
    a, _ = load_model(tmp_path / "per_expert", dtype=torch.float32, device="cpu")
    b, _ = load_model(fused_dir, dtype=torch.float32, device="cpu")
    _assert_same_params(a, b)


def test_missing_tensor_is_named(tmp_path: Path) -> None:
    _save(hf.Qwen2Config(**TINY), tmp_path)
    _rewrite(tmp_path, lambda t: t.pop("model.layers.1.self_attn.k_proj.bias"))
    with pytest.raises(UnsupportedModelError, match=r"model\.layers\.1\.self_attn\.k_proj\.bias"):
        load_model(tmp_path, dtype=torch.float32, device="cpu")


def test_missing_mixtral_expert_is_named_in_its_scheme(tmp_path: Path) -> None:
    _save(hf.MixtralConfig(**TINY, num_local_experts=4, num_experts_per_tok=2), tmp_path)
    _rewrite(tmp_path, lambda t: t.pop("model.layers.0.block_sparse_moe.experts.2.w3.weight"))
    with pytest.raises(UnsupportedModelError, match=r"block_sparse_moe\.experts\.2\.w3\.weight"):
        load_model(tmp_path, dtype=torch.float32, device="cpu")


def test_unexpected_tensor_is_named(tmp_path: Path) -> None:
    _save(hf.LlamaConfig(**TINY), tmp_path)
    _rewrite(tmp_path, lambda t: t.update({"model.layers.0.mlp.mystery.weight": torch.zeros(2)}))
    with pytest.raises(UnsupportedModelError, match=r"model\.layers\.0\.mlp\.mystery\.weight"):
        load_model(tmp_path, dtype=torch.float32, device="cpu")


def test_wrong_shape_is_named(tmp_path: Path) -> None:
    _save(hf.LlamaConfig(**TINY), tmp_path)
    _rewrite(tmp_path, lambda t: t.update({"model.norm.weight": torch.ones(63)}))
    with pytest.raises(UnsupportedModelError, match=r"model\.norm\.weight.*\(63,\)"):
        load_model(tmp_path, dtype=torch.float32, device="cpu")


def test_qwen2_moe_without_shared_expert(tmp_path: Path) -> None:
    """shared_expert_intermediate_size 0: the zero-size shared-expert tensors and their gate
    are accepted and dropped (logits: test_hf_parity), absent ones are not missed, and a
    shared expert with rows after all is refused by name (it would not be computed)."""
    cfg = hf.Qwen2MoeConfig(
        **TINY, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        shared_expert_intermediate_size=0,
    )  # fmt: skip
    _save(cfg, tmp_path)
    shared = re.compile(r"model\.layers\.\d+\.mlp\.shared_expert")
    assert sum(bool(shared.match(k)) for k in load_file(tmp_path / "model.safetensors")) == 8
    model, config = load_model(tmp_path, dtype=torch.float32, device="cpu")
    assert config.shared_expert_intermediate_size == 0
    assert model.layers[0].mlp.shared_expert is None

    def drop_shared(tensors: dict[str, torch.Tensor]) -> None:
        for k in [k for k in tensors if shared.match(k)]:
            del tensors[k]

    _rewrite(tmp_path, drop_shared)
    load_model(tmp_path, dtype=torch.float32, device="cpu")
    name = "model.layers.1.mlp.shared_expert.up_proj.weight"
    _rewrite(tmp_path, lambda t: t.update({name: torch.zeros(8, 64)}))
    with pytest.raises(UnsupportedModelError, match=rf"{re.escape(name)}.*\(8, 64\)"):
        load_model(tmp_path, dtype=torch.float32, device="cpu")


def test_unsupported_architecture_is_named(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["GPT2LMHeadModel"],
                "vocab_size": 8,
                "hidden_size": 8,
                "num_hidden_layers": 1,
                "num_attention_heads": 1,
            }
        )
    )
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        load_model(tmp_path, dtype=torch.float32, device="cpu")
    with pytest.raises(UnsupportedModelError, match="FancyForCausalLM"):
        get_model_class("FancyForCausalLM")


def test_every_registered_architecture_imports_its_class() -> None:
    from tandem.models.decoder import DecoderForCausalLM

    for arch in MODEL_MODULES:
        cls = get_model_class(arch)
        assert cls.__name__ == arch and issubclass(cls, DecoderForCausalLM)


def _moe_config() -> ModelConfig:
    return ModelConfig(
        architecture="Qwen2MoeForCausalLM",
        vocab_size=96,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        attention_bias=True,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=24,
        mlp_only_layers=(1,),
    )


@pytest.mark.parametrize(
    "change,match",
    [
        ({"num_experts_per_tok": 5}, "num_experts_per_tok"),  # top-5 of 4 experts
        ({"num_experts_per_tok": 0}, "num_experts_per_tok"),
        ({"moe_intermediate_size": 0}, "intermediate size"),
        ({"hidden_size": 36, "head_dim": 9}, "even head_dim"),
    ],
)
@pytest.mark.parametrize("experts", ["torch", "cpu_pool"])
def test_configs_that_cannot_run_are_refused_at_build(
    change: dict, match: str, experts: str, tmp_path: Path
) -> None:
    """A config no forward can compute is an UnsupportedModelError naming the key when the
    model is built, before a weight is read. Before: top-5 of 4 and head_dim 9 loaded and failed
    in the first forward (torch.topk, rotary's shapes), top-0 computed zeros on the torch
    backend, and the pool refused its inputs mid-forward."""
    cfg = dataclasses.replace(_moe_config(), **change)
    with pytest.raises(UnsupportedModelError, match=match):
        build_model(cfg, dtype=torch.float32, device="cpu", expert_backend=experts)
    with pytest.raises(UnsupportedModelError, match=match):
        load_model(tmp_path, dtype=torch.float32, device="cpu", load_format="dummy", config=cfg,
                   expert_backend=experts)  # fmt: skip


def test_dummy_weights_shapes_and_seed(tmp_path: Path) -> None:
    cfg = _moe_config()
    a, _ = load_model(tmp_path, dtype=torch.float32, device="cpu", load_format="dummy", config=cfg)
    b, _ = load_model(tmp_path, dtype=torch.float32, device="cpu", load_format="dummy", config=cfg)
    c, _ = load_model(
        tmp_path, dtype=torch.float32, device="cpu", load_format="dummy", config=cfg, seed=1
    )
    _assert_same_params(a, b)
    assert not torch.equal(_params(a)["embed_tokens.weight"], _params(c)["embed_tokens.weight"])
    p = _params(a)
    q, kv = cfg.q_size, cfg.kv_size
    assert p["layers.0.self_attn.qkv_proj.weight"].shape == (q + 2 * kv, 32)
    assert p["layers.0.self_attn.qkv_proj.bias"].shape == (q + 2 * kv,)
    assert p["layers.0.mlp.w13"].shape == (4, 2 * 16, 32)
    assert p["layers.0.mlp.w2"].shape == (4, 32, 16)
    assert p["layers.0.mlp.shared_expert.gate_up_proj.weight"].shape == (48, 32)
    assert p["layers.1.mlp.gate_up_proj.weight"].shape == (96, 32)  # mlp_only layer: dense
    assert p["lm_head.weight"].shape == (96, 32)
    assert torch.all(p["layers.1.input_layernorm.weight"] == 1.0)
    assert torch.all(p["norm.weight"] == 1.0)
    assert 0.015 < float(p["layers.0.mlp.w13"].std()) < 0.025


def test_dummy_values_do_not_depend_on_fill_order_chunks_or_threads(monkeypatch) -> None:
    """Each parameter has its own generator (seed, name): filling a subset later gives the same
    values as filling everything at once. Host tensors above CHUNK elements are filled in fixed
    chunks from a thread pool; the thread count does not change the values."""
    import tandem.models.loader.dummy as dummy

    cfg = _moe_config()
    monkeypatch.setattr(dummy, "CHUNK", 100)  # w13 (4 * 32 * 32) and w2 go through chunks
    whole = build_model(cfg, dtype=torch.float32, device="cpu")
    dummy.init_dummy_weights(whole, seed=7)
    names = sorted(_params(whole))
    parts = build_model(cfg, dtype=torch.float32, device="cpu")
    monkeypatch.setattr(dummy.os, "cpu_count", lambda: 1)
    for name in reversed(names):  # one at a time, in the opposite order, on one thread
        dummy.init_dummy_weights(parts, seed=7, select=lambda n, name=name: n == name)
    _assert_same_params(whole, parts)
    w13 = _params(whole)["layers.0.mlp.w13"]
    first, second = w13.view(-1)[:100], w13.view(-1)[100:200]
    assert not torch.equal(first, second)  # each chunk its own stream
    assert 0.015 < float(w13.std()) < 0.025 and int((w13 == 0).sum()) == 0
    other = build_model(cfg, dtype=torch.float32, device="cpu")
    dummy.init_dummy_weights(other, seed=8, select=lambda n: n == "layers.0.mlp.w13")
    assert not torch.equal(_params(other)["layers.0.mlp.w13"], w13)


def test_dummy_experts_fill_the_cpu_pool_layer_by_layer(
    tmp_path: Path, monkeypatch, caplog
) -> None:
    """Random weights with the cpu_pool backend: each MoE layer's host experts are filled right
    before the pool converts them (never all layers' bf16 copies at once), with the values the
    torch backend's dummy model gets, and nothing goes to the expert cache."""
    import logging

    monkeypatch.setenv("TANDEM_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("TANDEM_EXPERT_CACHE", raising=False)
    import dataclasses

    cfg = dataclasses.replace(_moe_config(), num_hidden_layers=3, mlp_only_layers=(1,))
    ref, _ = load_model(
        tmp_path, dtype=torch.float32, device="cpu", load_format="dummy", config=cfg
    )
    import tandem.models.loader.dummy as dummy

    filled: list[set[str]] = []
    real = dummy.init_dummy_weights

    def spy(model, seed=0, std=0.02, select=None):
        names = {n for n, _ in model.named_parameters() if select is None or select(n)}
        filled.append({n for n in names if n.endswith((".w13", ".w2"))})
        real(model, seed, std, select)

    monkeypatch.setattr("tandem.models.loader.init_dummy_weights", spy)
    with caplog.at_level(logging.WARNING):
        model, _ = load_model(
            tmp_path,
            dtype=torch.float32,
            device="cpu",
            load_format="dummy",
            config=cfg,
            expert_backend="cpu_pool",
            expert_options={"fmt": "bf16", "num_threads": 1},
        )
    backend = model.expert_backend
    try:
        moe = [0, 2]  # layer 1 is dense
        assert filled == [set()] + [{f"layers.{i}.mlp.w13", f"layers.{i}.mlp.w2"} for i in moe]
        p = _params(ref)
        for i in moe:  # layer 2 was filled in layer 0's buffer: each got its own values
            w13, w2 = backend.pool.dequantize(i)
            want13, want2 = p[f"layers.{i}.mlp.w13"], p[f"layers.{i}.mlp.w2"]
            torch.testing.assert_close(w13, want13.bfloat16().float(), rtol=0, atol=0)
            torch.testing.assert_close(w2, want2.bfloat16().float(), rtol=0, atol=0)
            assert _params(model)[f"layers.{i}.mlp.w13"].numel() == 0  # the torch copy is freed
        assert not torch.equal(p["layers.0.mlp.w13"], p["layers.2.mlp.w13"])
        assert not (tmp_path / "home" / "expert_cache").exists()
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    finally:
        backend.close()


def test_dummy_from_config_json_in_bf16(tmp_path: Path) -> None:
    hf.LlamaConfig(**TINY, tie_word_embeddings=True).save_pretrained(tmp_path)
    model, cfg = load_model(tmp_path, dtype=torch.bfloat16, device="cpu", load_format="dummy")
    assert cfg.tie_word_embeddings and model.lm_head is None
    assert all(p.dtype == torch.bfloat16 and p.device.type == "cpu" for p in model.parameters())


def test_backend_registries(tmp_path: Path, paged_runner) -> None:
    calls: list[int] = []

    class CountingBackend(TorchExpertBackend):
        name = "counting"

        def forward(self, layer_idx, hidden, topk_ids, topk_weights, w13, w2):  # type: ignore[override]
            calls.append(layer_idx)
            return super().forward(layer_idx, hidden, topk_ids, topk_weights, w13, w2)

    register_expert_backend("counting", CountingBackend)
    assert isinstance(get_expert_backend("counting"), CountingBackend)
    with pytest.raises(ValueError, match="nope"):
        get_expert_backend("nope")
    cfg = _moe_config()
    with pytest.raises(ValueError, match="nope"):
        build_model(cfg, dtype=torch.float32, device="cpu", attn_backend="nope")
    model = build_model(cfg, dtype=torch.float32, device="cpu", expert_backend="counting")
    from tandem.models.loader.dummy import init_dummy_weights

    init_dummy_weights(model)
    runner = paged_runner(model, cfg, block_size=4)
    runner.step([(0, [1, 2, 3]), (1, [4])])
    assert calls == [0]  # layer 1 is dense (mlp_only_layers)

"""GGUF reader, dequantization and loader, checked against references we did not write: the
`gguf` package (llama.cpp's python reader and numpy dequantizers) and transformers' GGUF loading."""

from __future__ import annotations

import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from tandem.models import gguf_dequant
from tandem.models.config import UnsupportedModelError
from tandem.models.gguf_dequant import dequantize
from tandem.models.gguf_reader import GGML_TYPES, GGUFReader
from tandem.models.hub import resolve_model
from tandem.models.loader.gguf import gguf_model_config, load_gguf_weights, unpermute_qk


@pytest.fixture(scope="module")
def smollm_path() -> Path:
    return resolve_model(None)  # the cached default model, fetched on first use


# -- dequantization ---------------------------------------------------------------------------


def test_type_table_matches_gguf_package() -> None:
    for type_id, (name, block_size, type_size) in GGML_TYPES.items():
        assert Q(type_id).name == name
        assert gguf.GGML_QUANT_SIZES[Q(type_id)] == (block_size, type_size), name


def _random_k_blocks(qtype: Q, n_blocks: int, rng: np.random.Generator) -> np.ndarray:
    """Random k-quant blocks `[n_blocks, type_size]` uint8 whose fp16 scale fields are sane."""
    _, type_size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (n_blocks, type_size), dtype=np.uint8)
    scales = rng.uniform(-0.05, 0.05, (n_blocks, 2)).astype(np.float16).view(np.uint8)
    if qtype == Q.Q6_K:
        raw[:, 208:210] = scales[:, :2]  # d sits at the end of a Q6_K block
    else:
        raw[:, 0:4] = scales  # d, dmin lead Q4_K / Q5_K blocks
    return raw


@pytest.mark.parametrize("shape", [(4, 256), (3, 2, 512), (1536,)])
@pytest.mark.parametrize(
    "qtype", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.MXFP4]
)
def test_dequantize_matches_gguf_package(qtype: Q, shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(int(qtype) * 7 + len(shape))
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    if qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K):
        n_blocks = int(np.prod(shape)) // block_size
        packed = _random_k_blocks(qtype, n_blocks, rng).reshape(*shape[:-1], -1)
    else:
        values = (rng.standard_normal(shape) * 3).astype(np.float32)
        packed = gguf.quants.quantize(values, qtype)
    expected = gguf.quants.dequantize(packed, qtype).astype(np.float32)  # [*shape]
    raw = np.ascontiguousarray(packed).view(np.uint8).reshape(-1)
    ours = dequantize(raw, int(qtype), shape, torch.float32, name="t")
    assert ours.shape == shape and ours.dtype == torch.float32
    np.testing.assert_array_equal(ours.numpy(), expected)  # same float ops in the same order
    half = dequantize(raw, int(qtype), shape, torch.float16, name="t")
    torch.testing.assert_close(half, torch.from_numpy(expected).half(), rtol=1e-3, atol=1e-5)


def test_dequantize_in_chunks_equals_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(1)
    raw = _random_k_blocks(Q.Q6_K, 13, rng).reshape(-1)
    whole = dequantize(raw, int(Q.Q6_K), (13, 256))
    monkeypatch.setattr(gguf_dequant, "_CHUNK_BYTES", 3 * 210)  # 3 blocks per chunk, ragged tail
    np.testing.assert_array_equal(dequantize(raw, int(Q.Q6_K), (13, 256)).numpy(), whole.numpy())


def test_unsupported_type_names_type_and_tensor() -> None:
    raw = np.zeros(22, dtype=np.uint8)
    with pytest.raises(UnsupportedModelError, match=r"'blk\.3\.ffn_up\.weight'.*Q5_0"):
        dequantize(raw, int(Q.Q5_0), (32,), name="blk.3.ffn_up.weight")


# -- reader -----------------------------------------------------------------------------------


def test_reader_matches_gguf_package_on_real_file(smollm_path: Path) -> None:
    ours = GGUFReader(smollm_path)
    ref = gguf.GGUFReader(smollm_path)
    fields = {k: f for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert list(ours.metadata) == list(fields)
    for key, field in fields.items():
        assert ours.metadata_types[key] == tuple(int(t) for t in field.types), key
        expected = field.contents()
        assert ours.metadata[key] == (
            expected.tolist() if hasattr(expected, "tolist") else expected
        ), key
    assert ours.version == ref.fields["GGUF.version"].contents()
    assert list(ours.tensors) == [t.name for t in ref.tensors]
    for t in ref.tensors:
        info = ours.tensors[t.name]
        assert info.shape == tuple(int(x) for x in t.shape)
        assert (info.ggml_type, info.offset, info.n_bytes) == (
            int(t.tensor_type),
            t.data_offset,
            t.n_bytes,
        )
    for t in ref.tensors[:4] + ref.tensors[-2:]:
        np.testing.assert_array_equal(ours.tensor_data(t.name), t.data.view(np.uint8).reshape(-1))


def _write_gguf(
    path: Path, arch: str, kv: dict, tensors: dict[str, np.ndarray], alignment: int | None = None
) -> None:
    w = gguf.GGUFWriter(str(path), arch)
    if alignment is not None:
        w.add_custom_alignment(alignment)
    for key, value in kv.items():
        adder = {
            bool: w.add_bool,
            int: w.add_uint32,
            float: w.add_float32,
            str: w.add_string,
            list: w.add_array,
        }
        adder[type(value)](key, value)
    for name, array in tensors.items():
        w.add_tensor(name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_reader_long_arrays_decode_on_access(tmp_path: Path) -> None:
    """Arrays past LAZY_ARRAY_LEN are skipped at parse and decoded when read; every key after
    them (and the tensor table) still parses, and each read gives a fresh, equal list."""
    from tandem.models.gguf_reader import LAZY_ARRAY_LEN

    n = LAZY_ARRAY_LEN + 37
    words = [f"w{i}" + "é" * (i % 3) for i in range(n)]
    path = tmp_path / "lazy.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_array("t.words", words)
    w.add_array("t.ints", list(range(-n, n)))
    w.add_array("t.nested", [[i, i + 1] for i in range(n)])
    w.add_array("t.short", ["x"] * LAZY_ARRAY_LEN)
    w.add_uint32("t.after", 7)
    w.add_tensor("a", np.arange(32, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    r = GGUFReader(path)
    assert list(r.metadata)[-5:] == ["t.words", "t.ints", "t.nested", "t.short", "t.after"]
    assert r.metadata.array_len("t.words") == n and r.metadata.array_len("t.ints") == 2 * n
    assert r.metadata.array_len("t.short") == LAZY_ARRAY_LEN
    assert r.metadata.array_len("t.after") is None and r.metadata.array_len("nope") is None
    assert r.get("t.words") == words and r.metadata["t.words"] is not r.metadata["t.words"]
    assert r.get("t.ints") == list(range(-n, n))
    assert r.get("t.nested") == [[i, i + 1] for i in range(n)]
    assert r.get("t.after") == 7 and r.get("t.missing", 3) == 3
    assert dict(r.metadata.items())["t.words"] == words
    assert np.array_equal(r.tensor_data("a").view(np.float32), np.arange(32, dtype=np.float32))


def test_reader_all_value_types_and_custom_alignment(tmp_path: Path) -> None:
    path = tmp_path / "types.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_custom_alignment(64)
    scalars = {
        "t.u8": (w.add_uint8, 200),
        "t.i8": (w.add_int8, -100),
        "t.u16": (w.add_uint16, 60000),
        "t.i16": (w.add_int16, -30000),
        "t.u32": (w.add_uint32, 4_000_000_000),
        "t.i32": (w.add_int32, -2_000_000_000),
        "t.f32": (w.add_float32, 0.5),
        "t.u64": (w.add_uint64, 2**60),
        "t.i64": (w.add_int64, -(2**60)),
        "t.f64": (w.add_float64, 1.0 / 3.0),
        "t.bool": (w.add_bool, True),
        "t.str": (w.add_string, "héllo ✓"),
    }
    for key, (add, value) in scalars.items():
        add(key, value)
    w.add_array("t.arr_i", [1, 2, 3])
    w.add_array("t.arr_s", ["a", "", "ü"])
    w.add_array("t.arr_f", [0.25, -1.5])
    w.add_array("t.arr_nested", [[1, 2], [3]])
    a = np.arange(6 * 5, dtype=np.float32).reshape(6, 5)
    b = np.arange(7, dtype=np.float16)
    w.add_tensor("a", a)
    w.add_tensor("b", b)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    r = GGUFReader(path)
    for key, (_, value) in scalars.items():
        assert r.metadata[key] == value, key
    assert r.metadata["t.arr_i"] == [1, 2, 3]
    assert r.metadata["t.arr_s"] == ["a", "", "ü"]
    assert r.metadata["t.arr_f"] == [0.25, -1.5]
    assert r.metadata["t.arr_nested"] == [[1, 2], [3]]
    assert r.alignment == 64 and r.data_offset % 64 == 0
    assert all(info.offset % 64 == 0 for info in r.tensors.values())
    assert r.tensors["a"].shape == (5, 6) and r.tensors["a"].torch_shape == (6, 5)
    from tandem.models.gguf_dequant import dequantize_tensor

    np.testing.assert_array_equal(dequantize_tensor(r, r.tensors["a"]).numpy(), a)
    np.testing.assert_array_equal(dequantize_tensor(r, r.tensors["b"], torch.float16).numpy(), b)


# -- loader: synthetic files ------------------------------------------------------------------


def test_qwen3moe_config_and_expert_names(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    hidden, heads, kv_heads, hd, experts, inter = 16, 4, 2, 8, 3, 12

    def rand(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32)

    tensors = {
        "token_embd.weight": rand(32, hidden),
        "output_norm.weight": rand(hidden),
        "output.weight": rand(32, hidden),
        "blk.0.attn_norm.weight": rand(hidden),
        "blk.0.attn_q.weight": rand(heads * hd, hidden),
        "blk.0.attn_k.weight": rand(kv_heads * hd, hidden),
        "blk.0.attn_v.weight": rand(kv_heads * hd, hidden),
        "blk.0.attn_output.weight": rand(hidden, heads * hd),
        "blk.0.attn_q_norm.weight": rand(hd),
        "blk.0.attn_k_norm.weight": rand(hd),
        "blk.0.ffn_norm.weight": rand(hidden),
        "blk.0.ffn_gate_inp.weight": rand(experts, hidden),
        "blk.0.ffn_gate_exps.weight": rand(experts, inter, hidden),
        "blk.0.ffn_up_exps.weight": rand(experts, inter, hidden),
        "blk.0.ffn_down_exps.weight": rand(experts, hidden, inter),
    }
    kv = {
        "qwen3moe.block_count": 1,
        "qwen3moe.embedding_length": hidden,
        "qwen3moe.feed_forward_length": 64,
        "qwen3moe.attention.head_count": heads,
        "qwen3moe.attention.head_count_kv": kv_heads,
        "qwen3moe.attention.key_length": hd,
        "qwen3moe.rope.freq_base": 1e6,
        "qwen3moe.attention.layer_norm_rms_epsilon": 1e-6,
        "qwen3moe.expert_count": experts,
        "qwen3moe.expert_used_count": 2,
        "qwen3moe.expert_feed_forward_length": inter,
        "qwen3moe.context_length": 4096,
        "tokenizer.ggml.eos_token_id": 7,
    }
    path = tmp_path / "moe.gguf"
    _write_gguf(path, "qwen3moe", kv, tensors)
    cfg = gguf_model_config(path)
    assert cfg.architecture == "Qwen3MoeForCausalLM" and cfg.qk_norm and not cfg.tie_word_embeddings
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (
        experts,
        2,
        inter,
    )
    assert (cfg.head_dim, cfg.num_key_value_heads, cfg.rope_theta, cfg.eos_token_ids) == (
        hd,
        kv_heads,
        1e6,
        (7,),
    )
    got = dict(load_gguf_weights(path, torch.float32))
    assert len(got) == 12 + 3 * experts
    for e in range(experts):
        for gg, hf in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
            np.testing.assert_array_equal(
                got[f"model.layers.0.mlp.experts.{e}.{hf}.weight"].numpy(),
                tensors[f"blk.0.ffn_{gg}_exps.weight"][e],
            )
    # qwen files are not permuted: q/k come through unchanged
    np.testing.assert_array_equal(
        got["model.layers.0.self_attn.q_proj.weight"].numpy(), tensors["blk.0.attn_q.weight"]
    )
    np.testing.assert_array_equal(
        got["model.layers.0.mlp.gate.weight"].numpy(), tensors["blk.0.ffn_gate_inp.weight"]
    )
    assert "lm_head.weight" in got and "model.layers.0.self_attn.k_norm.weight" in got


def test_unexpected_tensor_and_architecture_are_named(tmp_path: Path) -> None:
    kv = {"llama.block_count": 1, "llama.embedding_length": 4, "llama.attention.head_count": 1}
    path = tmp_path / "odd.gguf"
    _write_gguf(path, "llama", kv, {"blk.0.mystery.weight": np.zeros(4, np.float32)})
    with pytest.raises(UnsupportedModelError, match=r"blk\.0\.mystery\.weight"):
        list(load_gguf_weights(path))
    path2 = tmp_path / "arch.gguf"
    _write_gguf(path2, "rwkv6", {}, {"x": np.zeros(4, np.float32)})
    with pytest.raises(UnsupportedModelError, match="rwkv6"):
        gguf_model_config(path2)


def _permute_qk(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's q/k row order (rotate_half halves -> interleaved pairs), per head:
    rows `[2, head_dim/2]` -> `[head_dim/2, 2]`; weights and biases alike."""
    half = w.shape[0] // heads // 2
    return w.reshape(heads, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# llama.cpp's names for HF's, as its converter writes them.
_GGUF_GLOBALS = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def _gguf_tensors(ref, layer_tensors) -> dict[str, np.ndarray]:
    """An HF model's state dict as GGUF tensors: the globals by _GGUF_GLOBALS, and each
    `model.layers.N.<rest>` through layer_tensors(rest, array) -> {name after blk.N.: array}."""
    tensors = {}
    for name, t in ref.state_dict().items():
        a = t.numpy()
        if name in _GGUF_GLOBALS:
            tensors[_GGUF_GLOBALS[name]] = a
            continue
        layer, rest = name.removeprefix("model.layers.").split(".", 1)
        for suffix, arr in layer_tensors(rest, a).items():
            tensors[f"blk.{layer}.{suffix}"] = arr
    return tensors


def _assert_hf_logits(path: Path, ref, ids: list[int], paged_runner) -> None:
    """The GGUF at `path`, loaded and run on `ids`, gives the HF model's logits."""
    from tandem.models.loader import load_model

    model, config = load_model(path, dtype=torch.float32, device="cpu")
    ours = paged_runner(model, config, block_size=4).step([(0, ids)])[0]
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-4)


def _moe_expert_tensors(rest: str, a, inter: int):
    """GGUF tensors of a DeepSeek-style MoE layer's HF tensor `rest` (fused gate_up experts
    `[E, 2I, H]` apart, down experts, the router's correction bias); None for any other."""
    import numpy as np

    if rest == "mlp.experts.gate_up_proj":
        return {"ffn_gate_exps.weight": np.ascontiguousarray(a[:, :inter]),
                "ffn_up_exps.weight": np.ascontiguousarray(a[:, inter:])}  # fmt: skip
    if rest == "mlp.experts.down_proj":
        return {"ffn_down_exps.weight": a}
    if rest == "mlp.gate.e_score_correction_bias":
        return {"exp_probs_b.bias": a}
    return None


def _assert_pool_logits(path: Path, ref, paged_runner) -> None:
    """`--cpu-experts all` on the GGUF at `path` (bf16-valued experts): the stacked expert
    tensors go from the file straight into the scalar pool (none stays on the model), and the
    logits equal the HF model's."""
    from tandem.models.loader import load_model

    model, config = load_model(
        path, dtype=torch.float32, device="cpu", expert_backend="cpu_pool",
        expert_options={"isa": "scalar", "num_threads": 1},
    )  # fmt: skip
    assert all(b.w13.numel() == 0 for b in model.modules() if hasattr(b, "w13"))
    ids = [5, 17, 3, 60, 9, 1, 33, 2]
    ours = paged_runner(model, config, block_size=4).step([(0, ids)])[0]
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-4)
    model.expert_backend.close()


_GGUF_OF_HF = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}  # fmt: skip


def test_llama_biases_match_hf(tmp_path: Path, paged_runner) -> None:
    """A "llama" GGUF with biases on q/k/v, o_proj (attn_output.bias) and the MLP (ffn_*.bias):
    its config says so and its logits equal HF's on the checkpoint it was written from."""
    import transformers as hf

    from tests.models.test_hf_parity import _save_hf_model

    heads, kv_heads = 4, 2
    hf_cfg = hf.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=heads, num_key_value_heads=kv_heads, attention_bias=True,
        mlp_bias=True,
    )  # fmt: skip
    ref = _save_hf_model(hf_cfg, tmp_path / "hf")  # random biases

    def layer_tensors(rest: str, a: np.ndarray) -> dict[str, np.ndarray]:
        module, kind = rest.rsplit(".", 1)
        if module in ("self_attn.q_proj", "self_attn.k_proj"):  # llama.cpp's row order
            a = _permute_qk(a, heads if module == "self_attn.q_proj" else kv_heads)
        return {f"{_GGUF_OF_HF[module]}.{kind}": a}

    tensors = _gguf_tensors(ref, layer_tensors)
    assert "blk.1.attn_output.bias" in tensors and "blk.1.ffn_gate.bias" in tensors
    kv = {
        "llama.block_count": 2, "llama.embedding_length": 32, "llama.feed_forward_length": 48,
        "llama.attention.head_count": heads, "llama.attention.head_count_kv": kv_heads,
        "llama.rope.freq_base": 10000.0, "llama.attention.layer_norm_rms_epsilon": 1e-6,
        "llama.context_length": 256, "llama.vocab_size": 64,
    }  # fmt: skip
    path = tmp_path / "bias.gguf"
    _write_gguf(path, "llama", kv, tensors)
    cfg = gguf_model_config(path)
    assert cfg.attention_bias and cfg.o_proj_bias and cfg.mlp_bias
    _assert_hf_logits(path, ref, [5, 17, 3, 60, 9, 1, 33], paged_runner)


def test_olmoe_matches_hf(tmp_path: Path, paged_runner) -> None:
    """An "olmoe" GGUF as llama.cpp's converter writes it: q/k unpermuted, attn_q_norm and
    attn_k_norm over the whole q and k rows, stacked experts, no expert_weights_norm (llama.cpp
    does not renormalize OLMoE's top-k), plus attention.clamp_kqv for clip_qkv. Its config says
    so and its logits equal HF's on the checkpoint it was written from."""
    import transformers as hf

    from tests.models.test_hf_parity import OLMOE, _save_hf_model

    ref = _save_hf_model(hf.OlmoeConfig(**OLMOE, clip_qkv=0.5), tmp_path / "hf")
    inter = OLMOE["intermediate_size"]
    names = {**_GGUF_OF_HF, "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
             "mlp.gate": "ffn_gate_inp"}  # fmt: skip

    def layer_tensors(rest: str, a: np.ndarray) -> dict[str, np.ndarray]:
        if rest == "mlp.experts.gate_up_proj":  # [E, 2I, H]: gate rows, then up rows
            return {
                "ffn_gate_exps.weight": np.ascontiguousarray(a[:, :inter]),
                "ffn_up_exps.weight": np.ascontiguousarray(a[:, inter:]),
            }
        if rest == "mlp.experts.down_proj":  # [E, H, I]
            return {"ffn_down_exps.weight": a}
        module, kind = rest.rsplit(".", 1)
        return {f"{names[module]}.{kind}": a}

    tensors = _gguf_tensors(ref, layer_tensors)
    assert tensors["blk.0.attn_q_norm.weight"].shape == (OLMOE["hidden_size"],)
    kv = {
        "olmoe.block_count": 2, "olmoe.embedding_length": 64, "olmoe.feed_forward_length": inter,
        "olmoe.attention.head_count": 4, "olmoe.attention.head_count_kv": 2,
        "olmoe.rope.freq_base": 10000.0, "olmoe.attention.layer_norm_rms_epsilon": 1e-5,
        "olmoe.context_length": 256, "olmoe.vocab_size": 128, "olmoe.expert_count": 8,
        "olmoe.expert_used_count": 2, "olmoe.attention.clamp_kqv": 0.5,
    }  # fmt: skip
    path = tmp_path / "olmoe.gguf"
    _write_gguf(path, "olmoe", kv, tensors)
    cfg = gguf_model_config(path)
    assert cfg.architecture == "OlmoeForCausalLM" and cfg.qk_norm and cfg.qk_norm_full
    assert cfg.clip_qkv == 0.5 and not cfg.norm_topk_prob
    assert (cfg.num_experts, cfg.moe_intermediate_size) == (8, inter)
    _assert_hf_logits(path, ref, [5, 17, 3, 60, 9, 1, 33, 2, 90], paged_runner)


# -- loader: the real SmolLM2 file ------------------------------------------------------------


def _rope(x: torch.Tensor, pos: torch.Tensor, base: float, interleaved: bool) -> torch.Tensor:
    """x: [tokens, heads, head_dim]. interleaved: llama.cpp pairs (2i, 2i+1); else HF's (i, i+d/2)."""
    d = x.shape[-1]
    freqs = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)  # [d/2]
    ang = pos[:, None].double() * freqs[None]  # [tokens, d/2]
    cos, sin = ang.cos()[:, None].float(), ang.sin()[:, None].float()
    a, b = (x[..., 0::2], x[..., 1::2]) if interleaved else (x[..., : d // 2], x[..., d // 2 :])
    ra, rb = a * cos - b * sin, a * sin + b * cos
    return torch.stack((ra, rb), -1).flatten(-2) if interleaved else torch.cat((ra, rb), -1)


def test_qk_unpermute_matches_rope_conventions(smollm_path: Path) -> None:
    """Attention scores from llama.cpp's raw q/k with its interleaved rope equal the scores from
    our un-permuted q/k with HF's rotate_half rope; skipping the un-permute breaks that."""
    reader = GGUFReader(smollm_path)
    cfg = gguf_model_config(reader)
    hd, heads, kv_heads = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    from tandem.models.gguf_dequant import dequantize_tensor

    wq = dequantize_tensor(reader, reader.tensors["blk.2.attn_q.weight"])  # [heads*hd, hidden]
    wk = dequantize_tensor(reader, reader.tensors["blk.2.attn_k.weight"])  # [kv_heads*hd, hidden]
    x = torch.randn(7, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    pos = torch.tensor([0, 1, 2, 5, 17, 300, 4000])

    def scores(wq: torch.Tensor, wk: torch.Tensor, interleaved: bool) -> torch.Tensor:
        q = _rope((x @ wq.T).view(7, heads, hd), pos, cfg.rope_theta, interleaved)
        k = _rope((x @ wk.T).view(7, kv_heads, hd), pos, cfg.rope_theta, interleaved)
        k = k.repeat_interleave(heads // kv_heads, dim=1)
        return torch.einsum("qhd,khd->hqk", q, k)

    expected = scores(wq, wk, interleaved=True)
    ours = scores(unpermute_qk(wq, heads), unpermute_qk(wk, kv_heads), interleaved=False)
    torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(scores(wq, wk, interleaved=False), expected, rtol=1e-2, atol=1e-2)


def test_smollm_config(smollm_path: Path) -> None:
    from transformers import AutoConfig

    cfg = gguf_model_config(smollm_path)
    ref = AutoConfig.from_pretrained(str(smollm_path.parent), gguf_file=smollm_path.name)
    assert cfg.architecture == "LlamaForCausalLM"
    assert (
        cfg.num_hidden_layers,
        cfg.hidden_size,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
    ) == (30, 576, 9, 3)
    assert (cfg.vocab_size, cfg.head_dim, cfg.tie_word_embeddings) == (49152, 64, True)
    assert cfg.intermediate_size == ref.intermediate_size
    assert cfg.max_position_embeddings == ref.max_position_embeddings
    assert cfg.rms_norm_eps == pytest.approx(ref.rms_norm_eps)
    assert cfg.rope_theta == ref.rope_parameters["rope_theta"]
    assert cfg.bos_token_id == ref.bos_token_id and cfg.eos_token_ids == (ref.eos_token_id,)


@pytest.fixture(scope="module")
def transformers_tensors(smollm_path: Path) -> dict[str, torch.Tensor]:
    """transformers' own GGUF conversion of the file (takes ~20 s: once per module). We call its
    `load_gguf_checkpoint` on a model built from the GGUF config, which is the conversion
    `from_pretrained(gguf_file=...)` runs, without needing `accelerate`."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(str(smollm_path.parent), gguf_file=smollm_path.name)
    model = AutoModelForCausalLM.from_config(config)
    return load_gguf_checkpoint(str(smollm_path), return_tensors=True, model_to_load=model)[
        "tensors"
    ]


def test_smollm_weights_match_transformers(smollm_path: Path, transformers_tensors: dict) -> None:
    ours = dict(load_gguf_weights(smollm_path, torch.float32))
    assert set(ours) == set(transformers_tensors)
    assert "lm_head.weight" not in ours  # tied to the embedding
    for name, ref in transformers_tensors.items():
        assert ours[name].shape == ref.shape, name
        torch.testing.assert_close(ours[name], ref.float(), rtol=0, atol=1e-6, msg=name)


def test_smollm_load_time(smollm_path: Path) -> None:
    best = float("inf")
    for _ in range(2):  # best of two: the machine is shared
        start = time.perf_counter()
        gguf_model_config(smollm_path)
        n = sum(t.numel() for _, t in load_gguf_weights(smollm_path, torch.float32))
        best = min(best, time.perf_counter() - start)
    print(f"SmolLM2-135M Q4_1 config+weights (float32): {best:.2f} s, {n / 1e6:.1f}M params")
    assert n == 134_515_008
    assert best < 5.0

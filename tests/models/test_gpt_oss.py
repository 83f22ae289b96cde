"""GPT-OSS (`GptOssForCausalLM`) and sliding-window attention against HF transformers: tiny
random checkpoints saved with save_pretrained, run as ragged, chunk-prefilled, mixed
prefill+decode batches over a paged cache with shuffled block ids, with sequences several
windows long; every logit row must match HF's full-sequence forward at the same position.
Also MXFP4 experts (a checkpoint re-saved with `_blocks` / `_scales` by our own encoder)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers as hf
from safetensors.torch import load_file, save_file

from tandem.models.config import ModelConfig, UnsupportedModelError
from tandem.models.loader import load_model
from tandem.models.mxfp4 import dequantize_mxfp4, quantize_mxfp4

GPT_OSS = dict(
    vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=8,
    num_experts_per_tok=2, sliding_window=8, max_position_embeddings=256, initializer_range=0.1,
    rope_parameters={
        "rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
        "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 16,
    },
)  # fmt: skip
DENSE = dict(
    vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, initializer_range=0.05,
    max_position_embeddings=256,
)  # fmt: skip

CASES = {
    # layers 0 and 2 windowed (8 tokens), layer 1 full; sinks, biases, clamped SwiGLU, YaRN
    "gpt_oss": (lambda: hf.GptOssConfig(**GPT_OSS), 4),
    # a window that is no multiple of the block size, every layer windowed but the middle one
    "gpt_oss_window_5": (
        lambda: hf.GptOssConfig(
            **{**GPT_OSS, "sliding_window": 5},
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        ),
        4,
    ),
    "mistral_window": (lambda: hf.MistralConfig(**DENSE, sliding_window=6), 4),
    "mixtral_window": (
        lambda: hf.MixtralConfig(
            **{**DENSE, "intermediate_size": 32},
            sliding_window=7,
            num_local_experts=4,
            num_experts_per_tok=2,
        ),
        8,
    ),  # fmt: skip
    # layers from max_window_layers on are windowed
    "qwen2_window": (
        lambda: hf.Qwen2Config(
            **DENSE, use_sliding_window=True, sliding_window=9, max_window_layers=1
        ),
        4,
    ),  # fmt: skip
}
PROMPT_LENS = [5, 17, 33, 9]


def _save_hf_model(config: hf.PretrainedConfig, path: Path) -> torch.nn.Module:
    torch.manual_seed(0)
    model = hf.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():  # HF starts biases and sinks at zero, norms at one: random values
        for name, param in model.named_parameters():
            if name.endswith("bias") or name.endswith("sinks"):
                param.normal_(0.0, 0.5)
            elif "norm." in name:
                param.normal_(1.0, 0.2)
    model.save_pretrained(path)
    return model


def round_experts_as_pool(hf_model: torch.nn.Module, fmt: str, group: int = 64) -> None:
    """The HF model's experts rounded as the CPU pool stores them (ext/cpu/reference.quantize;
    rows along the input dimension: `[E, H, 2I]` and `[E, I, H]` transposed)."""
    from tandem.ext.cpu import quantize

    with torch.no_grad():
        for name, p in hf_model.named_parameters():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                p.copy_(quantize(p.transpose(1, 2), fmt, group).transpose(1, 2))


def _run_and_check(
    hf_model, model, config, paged_runner, block_size: int, seed: int, device: str = "cpu",
    dtype: torch.dtype = torch.float32, tol: float = 1e-4,
) -> None:  # fmt: skip
    runner = paged_runner(
        model, config, block_size=block_size, num_blocks=96, seed=seed, dtype=dtype, device=device
    )
    gen = torch.Generator().manual_seed(seed)
    seqs = {
        i: torch.randint(0, config.vocab_size, (n,), generator=gen).tolist()
        for i, n in enumerate(PROMPT_LENS)
    }
    rows: dict[int, list[torch.Tensor]] = {i: [] for i in seqs}

    def run(work: list[tuple[int, list[int]]], sample: set[int]) -> None:
        for seq_id, logits in runner.step(work).items():
            rows[seq_id].append(logits)
            if seq_id in sample:
                seqs[seq_id].append(int(logits[-1].argmax()))

    run([(0, seqs[0][:5]), (1, seqs[1][:8]), (2, seqs[2][:16])], sample={0})
    run(
        [(1, seqs[1][8:17]), (0, seqs[0][5:6]), (2, seqs[2][16:33]), (3, seqs[3][:9])],
        sample={0, 1, 2, 3},
    )
    # decode steps past every window (sequence 0: 6 -> 15 tokens, window 8)
    for step in range(9):
        order = [(step + j) % 4 for j in range(4)]
        run([(i, seqs[i][-1:]) for i in order], sample=set(order))
    for seq_id, produced in rows.items():
        ours = torch.cat(produced).float().cpu()
        ids = torch.tensor([seqs[seq_id][: ours.shape[0]]])
        with torch.no_grad():
            ref = hf_model(ids).logits[0].float()
        rel = (ours - ref).abs().max() / ref.abs().max()
        assert rel < tol, f"sequence {seq_id}: relative max diff {rel:.3e}"


@pytest.mark.parametrize("name", list(CASES))
def test_parity_with_hf(name: str, tmp_path: Path, paged_runner) -> None:
    make_config, block_size = CASES[name]
    hf_model = _save_hf_model(make_config(), tmp_path)
    model, config = load_model(tmp_path, dtype=torch.float32, device="cpu")
    assert type(model).__name__ == config.architecture
    assert config.sliding_window is not None and config.max_context == 256
    _run_and_check(hf_model, model, config, paged_runner, block_size, seed=len(name))


def test_windowed_layers_read_only_their_window(tmp_path: Path, paged_runner) -> None:
    """Blocks wholly before every window are never read: poisoning them changes nothing."""
    _save_hf_model(hf.MistralConfig(**DENSE, sliding_window=6), tmp_path)
    model, config = load_model(tmp_path, dtype=torch.float32, device="cpu")
    runner = paged_runner(model, config, block_size=4, seed=3)
    prompt = list(range(1, 31))
    runner.step([(0, prompt)])
    clean = runner.step([(0, [7])])[0]
    table = runner.block_tables[0]  # position 30 sees 25..30: blocks 6 and 7 only
    runner2 = paged_runner(model, config, block_size=4, seed=3)
    runner2.step([(0, prompt)])
    for layer in range(config.num_hidden_layers):
        for cache in (runner2.kv_cache.k[layer], runner2.kv_cache.v[layer]):
            cache[torch.tensor(table[:6])] = float("nan")
    assert torch.equal(runner2.step([(0, [7])])[0], clean)


def test_gpt_oss_config_defaults_match_transformers() -> None:
    d = hf.GptOssConfig().to_dict()
    d["architectures"] = ["GptOssForCausalLM"]
    cfg = ModelConfig.from_hf_dict(d)
    assert (cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok, cfg.head_dim) == (
        2880,
        128,
        4,
        64,
    )
    assert cfg.sliding_window == 128 and cfg.sliding_layers == tuple(range(0, 36, 2))
    assert cfg.attention_sinks and cfg.attention_bias and cfg.o_proj_bias
    assert (cfg.swiglu_alpha, cfg.swiglu_limit) == (1.702, 7.0)
    assert cfg.rope_theta == 150000.0 and cfg.rope_scaling["rope_type"] == "yarn"
    # a minimal config.json means what it means to transformers
    minimal = {
        "architectures": ["GptOssForCausalLM"], "vocab_size": 64, "hidden_size": 32,
        "num_hidden_layers": 2, "num_attention_heads": 4,
    }  # fmt: skip
    cfg = ModelConfig.from_hf_dict(minimal)
    ref = hf.GptOssConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4)
    assert cfg.head_dim == ref.head_dim and cfg.moe_intermediate_size == ref.intermediate_size
    assert cfg.num_key_value_heads == ref.num_key_value_heads
    assert cfg.rope_scaling["factor"] == ref.rope_parameters["factor"]
    assert cfg.rope_scaling["truncate"] is False
    assert cfg.sliding_layers == (0,) and cfg.rms_norm_eps == ref.rms_norm_eps


def test_mxfp4_matches_transformers_decoder() -> None:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 10, 4, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(110, 140, (3, 10, 4), generator=gen, dtype=torch.uint8)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, cols, rows]
    assert torch.equal(dequantize_mxfp4(blocks, scales), theirs.transpose(1, 2))
    x = torch.randn(4, 96, generator=gen)
    b, s = quantize_mxfp4(x)
    y = dequantize_mxfp4(b, s)
    assert b.shape == (4, 3, 16) and s.shape == (4, 3)
    # e2m1 rounding: within half a step (a quarter of the block's scale at the top of the range)
    step = torch.exp2(s.float() - 127).repeat_interleave(32, dim=1)
    assert ((x - y).abs() <= step + 1e-6).all()
    assert torch.equal(dequantize_mxfp4(*quantize_mxfp4(y)), y)  # representable: exact
    with pytest.raises(ValueError, match="do not match"):
        dequantize_mxfp4(b, s[:, :2])


def _to_mxfp4(path: Path) -> None:
    """Re-save the checkpoint's expert weights as MXFP4, laid out as the official checkpoints
    store them: `[E, out, in / 32, 16]` blocks and `[E, out, in / 32]` scales."""
    tensors = load_file(path / "model.safetensors")
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        w = tensors.pop(name).transpose(1, 2).contiguous()  # [E, out, in]
        blocks, scales = quantize_mxfp4(w)
        tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def test_mxfp4_checkpoint_matches_its_dequantized_twin(tmp_path: Path, paged_runner) -> None:
    """A checkpoint with MXFP4 experts loads to exactly the weights of the same checkpoint
    with those experts dequantized, and that one matches HF's logits."""
    hf_model = _save_hf_model(hf.GptOssConfig(**GPT_OSS), tmp_path / "q")
    _to_mxfp4(tmp_path / "q")
    quantized, config = load_model(tmp_path / "q", dtype=torch.float32, device="cpu")
    with torch.no_grad():  # HF's model with the dequantized experts
        tensors = load_file(tmp_path / "q" / "model.safetensors")
        for i, layer in enumerate(hf_model.model.layers):
            p = f"model.layers.{i}.mlp.experts."
            for proj in ("gate_up_proj", "down_proj"):
                w = dequantize_mxfp4(tensors[p + proj + "_blocks"], tensors[p + proj + "_scales"])
                getattr(layer.mlp.experts, proj).copy_(w.transpose(1, 2))
    block = quantized.layers[0].mlp
    hf_experts = hf_model.model.layers[0].mlp.experts
    inter = config.moe_intermediate_size
    assert torch.equal(block.w13[:, :inter], hf_experts.gate_up_proj[:, :, 0::2].transpose(1, 2))
    assert torch.equal(block.w13[:, inter:], hf_experts.gate_up_proj[:, :, 1::2].transpose(1, 2))
    assert torch.equal(block.w2, hf_experts.down_proj.transpose(1, 2))
    _run_and_check(hf_model, quantized, config, paged_runner, 4, seed=5)


def test_mxfp4_checkpoint_missing_scales_is_named(tmp_path: Path) -> None:
    _save_hf_model(hf.GptOssConfig(**GPT_OSS), tmp_path)
    _to_mxfp4(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(UnsupportedModelError, match=r"layers\.1\.mlp\.experts\.down_proj"):
        load_model(tmp_path, dtype=torch.float32, device="cpu")


def test_a_bias_free_backend_refuses_gpt_oss_by_name() -> None:
    """A backend without expert biases and the clamped SwiGLU is refused, not run wrong."""
    from tandem.models.gpt_oss import GptOssMoeBlock

    class BiasFreeBackend:
        name = "cpu_pool"

    d = hf.GptOssConfig(**GPT_OSS).to_dict()
    d["architectures"] = ["GptOssForCausalLM"]
    cfg = ModelConfig.from_hf_dict(d)
    with pytest.raises(UnsupportedModelError, match="biases and clamped SwiGLU"):
        GptOssMoeBlock(cfg, 0, BiasFreeBackend())


def test_grouped_experts_with_biases_match_the_reference() -> None:
    """The gpu backend's grouped-GEMM path for biased, clamped-SwiGLU experts (run here on the
    CPU, where torch has grouped GEMMs for float32) against the torch reference loop."""
    from tandem.models.layers.experts import ClampedSwiGLU, ExpertBias, TorchExpertBackend
    from tandem.models.layers.gpu_experts import grouped_experts, grouped_supported

    gen = torch.Generator().manual_seed(0)
    e, h, i, t, k = 6, 32, 16, 9, 2
    hidden = torch.randn(t, h, generator=gen)
    w13 = torch.randn(e, 2 * i, h, generator=gen) * 0.3
    w2 = torch.randn(e, h, i, generator=gen) * 0.3
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
    weights = torch.rand(t, k, generator=gen)
    bias = ExpertBias(
        torch.randn(e, 2 * i, generator=gen), torch.randn(e, h, generator=gen),
        ClampedSwiGLU(1.702, 1.0),  # a low limit: the clamps bite
    )  # fmt: skip
    if not grouped_supported(hidden, w13, w2):
        pytest.skip("this torch has no grouped GEMMs on the CPU")
    ref = TorchExpertBackend().forward(0, hidden, ids, weights, w13, w2, bias)
    out = grouped_experts(hidden, ids, weights, w13, w2, bias)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    plain = TorchExpertBackend().forward(0, hidden, ids, weights, w13, w2)
    assert (plain - ref).abs().max() > 0.1  # the biases and the activation matter


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("head_dim,expected", [(16, "torch"), (64, "cupy")])
def test_gpt_oss_on_cuda_bf16(tmp_path: Path, paged_runner, head_dim: int, expected: str) -> None:
    """GPT-OSS on CUDA in bf16 with the engine's automatic backends (head_dim 64: the cupy
    kernels with windows and sinks; 16: the torch reference; the gpu experts' biased grouped
    GEMMs) against HF in float32 on the same bf16-rounded weights, decoding past the window;
    every expert a token, so no routing flip."""
    from tandem.runtime.engine_setup import _auto_attention_backend

    cfg = hf.GptOssConfig(
        **{**GPT_OSS, "num_local_experts": 4, "num_experts_per_tok": 4, "head_dim": head_dim}
    )
    hf_model = _save_hf_model(cfg, tmp_path)
    with torch.no_grad():
        for param in hf_model.parameters():
            param.copy_(param.to(torch.bfloat16).float())
    device = torch.device("cuda")
    tconfig = ModelConfig.from_pretrained(tmp_path)
    attn = _auto_attention_backend(device, torch.bfloat16, tconfig)
    assert attn == expected
    model, config = load_model(
        tmp_path, dtype=torch.bfloat16, device=device, attn_backend=attn, expert_backend="gpu"
    )
    _run_and_check(
        hf_model, model, config, paged_runner, 4, seed=2, device="cuda", dtype=torch.bfloat16,
        tol=3e-2,
    )  # fmt: skip
    assert model.expert_backend.calls["grouped"] > 0


@pytest.mark.parametrize("pool", [False, True], ids=["torch", "cpu_pool"])
@pytest.mark.parametrize("experts_mxfp4", [False, True])
def test_gguf_gpt_oss_matches_hf(
    tmp_path: Path, paged_runner, experts_mxfp4: bool, pool: bool
) -> None:
    """A "gpt-oss" GGUF as llama.cpp's converter lays it out (gate and up experts apart,
    post_attention_norm, attn_sinks, biases; experts F32 or MXFP4 blocks), written from a tiny
    HF model: its config and its logits equal HF's (experts set to the file's values). Through
    the CPU pool, "auto" converts MXFP4 experts to int8 and F32 ones to bf16 (HF's experts get
    the same rounding)."""
    import gguf
    import numpy as np

    from tandem.models.loader.gguf import gguf_model_config

    ref = _save_hf_model(hf.GptOssConfig(**GPT_OSS), tmp_path / "hf")
    names = {
        "input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
        "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output", "mlp.router": "ffn_gate_inp",
    }  # fmt: skip
    globals_ = {"model.embed_tokens.weight": "token_embd.weight",
                "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}  # fmt: skip
    tensors: dict[str, np.ndarray] = {}
    raw: dict[str, gguf.GGMLQuantizationType] = {}

    def experts(name: str, w: torch.Tensor) -> None:  # w [E, out, in]
        if experts_mxfp4:
            packed = gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType.MXFP4)
            tensors[name], raw[name] = packed, gguf.GGMLQuantizationType.MXFP4
        else:
            tensors[name] = np.ascontiguousarray(w.numpy())

    for name, t in ref.state_dict().items():
        if name in globals_:
            tensors[globals_[name]] = t.numpy()
            continue
        layer, rest = name.removeprefix("model.layers.").split(".", 1)
        p = f"blk.{layer}."
        if rest == "self_attn.sinks":
            tensors[p + "attn_sinks.weight"] = t.numpy()
        elif rest == "mlp.experts.gate_up_proj":  # [E, H, 2I] interleaved
            experts(p + "ffn_gate_exps.weight", t[:, :, 0::2].transpose(1, 2))
            experts(p + "ffn_up_exps.weight", t[:, :, 1::2].transpose(1, 2))
        elif rest == "mlp.experts.gate_up_proj_bias":
            tensors[p + "ffn_gate_exps.bias"] = np.ascontiguousarray(t[:, 0::2].numpy())
            tensors[p + "ffn_up_exps.bias"] = np.ascontiguousarray(t[:, 1::2].numpy())
        elif rest == "mlp.experts.down_proj":  # [E, I, H]
            experts(p + "ffn_down_exps.weight", t.transpose(1, 2))
        elif rest == "mlp.experts.down_proj_bias":
            tensors[p + "ffn_down_exps.bias"] = t.numpy()
        else:
            module, kind = rest.rsplit(".", 1)
            tensors[p + f"{names[module]}.{kind}"] = t.numpy()
    if experts_mxfp4:  # HF's reference gets the experts the file holds
        with torch.no_grad():
            for i, layer in enumerate(ref.model.layers):
                deq = {
                    w: torch.from_numpy(
                        gguf.quants.dequantize(tensors[f"blk.{i}.ffn_{w}_exps.weight"], raw[f"blk.{i}.ffn_{w}_exps.weight"])
                    )
                    for w in ("gate", "up", "down")
                }  # fmt: skip
                gate_up = layer.mlp.experts.gate_up_proj
                gate_up[:, :, 0::2] = deq["gate"].transpose(1, 2)
                gate_up[:, :, 1::2] = deq["up"].transpose(1, 2)
                layer.mlp.experts.down_proj.copy_(deq["down"].transpose(1, 2))
    kv = {
        "gpt-oss.block_count": 3, "gpt-oss.embedding_length": 64,
        "gpt-oss.expert_feed_forward_length": 32, "gpt-oss.attention.head_count": 4,
        "gpt-oss.attention.head_count_kv": 2, "gpt-oss.attention.key_length": 16,
        "gpt-oss.attention.value_length": 16, "gpt-oss.rope.freq_base": 150000.0,
        "gpt-oss.attention.layer_norm_rms_epsilon": 1e-5, "gpt-oss.context_length": 256,
        "gpt-oss.vocab_size": 128, "gpt-oss.expert_count": 8, "gpt-oss.expert_used_count": 2,
        "gpt-oss.attention.sliding_window": 8, "gpt-oss.rope.scaling.type": "yarn",
        "gpt-oss.rope.scaling.factor": 32.0, "gpt-oss.rope.scaling.original_context_length": 16,
    }  # fmt: skip
    path = tmp_path / "gpt-oss.gguf"
    w = gguf.GGUFWriter(str(path), "gpt-oss")
    for key, value in kv.items():
        {int: w.add_uint32, float: w.add_float32, str: w.add_string}[type(value)](key, value)
    for name, array in tensors.items():
        w.add_tensor(name, array, raw_dtype=raw.get(name))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    cfg = gguf_model_config(path)
    assert cfg.architecture == "GptOssForCausalLM" and cfg.sliding_layers == (0, 2)
    assert cfg.attention_sinks and cfg.attention_bias and cfg.o_proj_bias
    if not pool:
        model, config = load_model(path, dtype=torch.float32, device="cpu")
        _run_and_check(ref, model, config, paged_runner, 4, seed=9)
        return
    fmt = "int8" if experts_mxfp4 else "bf16"
    round_experts_as_pool(ref, fmt)
    model, config = load_model(
        path, dtype=torch.float32, device="cpu", expert_backend="cpu_pool",
        expert_options={"fmt": "auto", "isa": "scalar", "num_threads": 2},
    )  # fmt: skip
    backend = model.expert_backend
    assert [backend.pool.layer_format(i)[0] for i in range(3)] == [fmt] * 3
    _run_and_check(ref, model, config, paged_runner, 4, seed=9)
    backend.close()


@pytest.mark.parametrize(
    "spec", [dict(cpu_experts="all"), dict(gpu_experts=2), dict(expert_backend="cpu_pool")]
)
def test_engine_takes_the_cpu_pool_for_gpt_oss(spec: dict) -> None:
    """The pool has GPT-OSS's biases and clamped SwiGLU (tests/models/test_gpt_oss_pool.py),
    and so has the GPU prefill from the pool's weights (tests/models/test_gpu_prefill_bias.py):
    --gpu-prefill is taken on CUDA and refused by name on the CPU, as for every family."""
    from tandem.runtime.config import ModelSpec
    from tandem.runtime.engine_setup import check_expert_options

    d = hf.GptOssConfig(**GPT_OSS).to_dict()
    d["architectures"] = ["GptOssForCausalLM"]
    cfg = ModelConfig.from_hf_dict(d)
    check_expert_options(ModelSpec(**spec), torch.device("cuda"), cfg)
    check_expert_options(ModelSpec(**spec, gpu_prefill="64"), torch.device("cuda"), cfg)
    with pytest.raises(ValueError, match="--gpu-prefill 64 computes the pool's layers on the GPU"):
        check_expert_options(ModelSpec(**spec, gpu_prefill="64"), torch.device("cpu"), cfg)
    check_expert_options(ModelSpec(), torch.device("cpu"), cfg)


def test_engine_bounds_the_windowed_layers_cache(tmp_path: Path) -> None:
    """Through the engine: the windowed layers (0 and 2) keep a pool of their own, sized for
    the window, while the full layer's pool grows with the context; greedy tokens past the
    window equal transformers' (the unbounded reference), a repeated prompt hits the prefix
    cache, and both pools are free afterwards."""
    from tandem.runtime.config import CacheConfig, EngineConfig, ModelSpec, SchedulerConfig
    from tandem.runtime.llm import LLM
    from tandem.runtime.sampling_params import SamplingParams

    hf_model = _save_hf_model(hf.GptOssConfig(**GPT_OSS), tmp_path)
    ec = EngineConfig(
        model=ModelSpec(model=str(tmp_path), device="cpu", dtype="float32"),
        cache=CacheConfig(block_size=4, cpu_kv_bytes=1 << 20),
        scheduler=SchedulerConfig(max_num_seqs=2, max_model_len=96, max_num_batched_tokens=16),
    )
    llm = LLM(engine_config=ec)
    eng = llm.engine
    layout = eng.layout
    assert eng.kv_cache.window_layers == (0, 2)
    # 2 sequences x (ceil(7 / 4) + 2) + one step's 4 blocks + the null block
    assert layout.num_window_blocks == 2 * 4 + 4 + 1
    assert layout.bytes_per_block == 2 * 4 * 2 * 16 * 4  # the full layer only
    assert layout.bytes_per_window_block == 2 * layout.bytes_per_block
    assert eng.kv_cache.k[0].shape[0] == eng.kv_cache.k[2].shape[0] == layout.num_window_blocks
    assert eng.kv_cache.k[1].shape[0] == layout.num_blocks > layout.num_window_blocks
    sched = eng.scheduler
    held: list[int] = []
    step = eng.step

    def counting_step():
        result = step()
        held.append(sched.window_pool.num_usable_blocks - sched.window_pool.num_free_blocks)
        return result

    eng.step = counting_step
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in (21, 9)]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params)
    # the same prompt again at once: its window's blocks are still cached in the window pool
    short = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    llm.generate([prompts[0]], short)
    hits = sched.prefix_cache_hits
    outs += llm.generate([prompts[0]], params)
    assert sched.prefix_cache_hits - hits == 20  # 5 full blocks of the 21-token prompt
    for prompt, out in zip(prompts + [prompts[0]], outs, strict=True):
        ref = hf_model.generate(
            torch.tensor([prompt]), max_new_tokens=40, do_sample=False, min_new_tokens=40
        )
        assert list(out.outputs[0].token_ids) == ref[0, len(prompt) :].tolist()
    assert max(held) <= layout.num_window_blocks - 1
    assert max(held) < 2 * (61 // 4)  # what two 61-token sequences would hold unreleased
    for pool in (sched.block_pool, sched.window_pool):
        pool.check_invariants()
        assert pool.num_free_blocks == pool.num_usable_blocks

"""Full-model logits on CUDA: the cupy attention backend against the torch backend (same bf16
weights), and against HF transformers (float32 activations on the same bf16-rounded weights),
for ragged, chunk-prefilled, mixed prefill+decode batches over a paged KV cache with shuffled
block ids. Llama, Qwen3 and OLMoE shapes (GQA 4 and 2, head_dim 128 and 64).

GPU tests: marked `gpu`, skipped without CUDA and CuPy. Set TANDEM_GPU_LOG=path to record the
errors (one `family<TAB>error` line each).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import tandem.ext.cuda as cuda_ext
from tandem.models.batch import KVCache
from tandem.models.loader import build_model, load_model
from tandem.models.loader.dummy import init_dummy_weights

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not cuda_ext.is_available(), reason="needs CUDA and CuPy"),
]

BF16_TOL = 2e-2  # ||ours - ref|| / ||ref|| per logits row


def _record(family: str, err: float) -> None:
    path = os.environ.get("TANDEM_GPU_LOG")
    if path:
        with open(path, "a") as f:
            f.write(f"{family}\t{err:.3e}\n")


def _hf_config(name: str):
    import transformers as hf

    common = dict(vocab_size=2048, initializer_range=0.02, max_position_embeddings=1024)
    if name == "llama":  # Llama-3 proportions: GQA 4, head_dim 128
        return hf.LlamaConfig(
            **common, hidden_size=1024, intermediate_size=2048, num_hidden_layers=3,
            num_attention_heads=8, num_key_value_heads=2, rope_theta=500000.0,
        )  # fmt: skip
    if name == "qwen3":  # q/k norm, head_dim 64 != hidden / heads, GQA 2
        return hf.Qwen3Config(
            **common, hidden_size=512, intermediate_size=1024, num_hidden_layers=3,
            num_attention_heads=8, num_key_value_heads=4, head_dim=64,
        )  # fmt: skip
    if name == "olmoe":  # q/k norms over whole rows, clip_qkv, head_dim 64, GQA 2. Every expert
        # a token (top-4 of 4): routing stays continuous, so bf16 rounding flips no expert.
        return hf.OlmoeConfig(
            **common, hidden_size=512, intermediate_size=256, num_hidden_layers=3,
            num_attention_heads=8, num_key_value_heads=4, num_experts=4, num_experts_per_tok=4,
            clip_qkv=2.0,
        )  # fmt: skip
    raise ValueError(name)


class CudaPagedRunner:
    """The model tests' paged runner (tests/models/conftest.py), with its cache and batch
    tensors on CUDA."""

    def __init__(self, base_cls, model, config, *, block_size: int, seed: int) -> None:
        self.inner = base_cls(model, config, block_size=block_size, num_blocks=128, seed=seed)
        self.inner.kv_cache = KVCache.allocate(
            config.num_hidden_layers, 128, block_size, config.num_key_value_heads,
            config.head_dim, torch.bfloat16, "cuda",
        )  # fmt: skip
        if model.attn_backend.name == "cupy":
            # NaN everywhere: a read of a slot no step wrote poisons the logits. (The torch
            # reference gathers whole blocks and multiplies masked slots by 0, so it gets zeros.)
            for t in self.inner.kv_cache.k + self.inner.kv_cache.v:
                t.fill_(float("nan"))
        self.model = model

    @torch.inference_mode()
    def step(self, work):
        ids, positions, batch = self.inner.build_batch(work)
        for name in ("query_start_loc", "seq_lens", "block_tables", "slot_mapping"):
            setattr(batch, name, getattr(batch, name).cuda())
        batch.logits_indices = batch.logits_indices.cuda()
        logits = self.model.compute_logits(self.model(ids.cuda(), positions.cuda(), batch))
        out, row = {}, 0
        for seq_id, tokens in work:
            out[seq_id] = logits[row : row + len(tokens)].float()
            row += len(tokens)
        return out


PROMPT_LENS = [5, 17, 70, 9, 300]


def _schedule(seqs: dict[int, list[int]]):
    """Steps of (seq_id, token slice) work: chunked prefills, decodes mixed with prefills, then
    pure decode steps (the decode kernel); yields work lists over `seqs`' growing token lists."""
    yield [(0, (0, 5)), (1, (0, 8)), (2, (0, 40)), (4, (0, 100))]
    yield [(0, (5, 6)), (1, (8, 17)), (2, (40, 70)), (3, (0, 9)), (4, (100, 300))]
    for _ in range(3):
        yield [(i, None) for i in range(5)]  # one decode token each


def _run(runner, seqs, vocab, gen):
    """Run `_schedule` and return, per seq, its logits rows in position order."""
    rows: dict[int, list[torch.Tensor]] = {i: [] for i in seqs}
    for work in _schedule(seqs):
        concrete = []
        for seq_id, span in work:
            if span is None:  # decode: the last token, appended by the previous step
                span = (len(seqs[seq_id]) - 1, len(seqs[seq_id]))
            concrete.append((seq_id, seqs[seq_id][span[0] : span[1]]))
        out = runner.step(concrete)
        for seq_id, logits in out.items():
            rows[seq_id].append(logits)
        for seq_id, _ in concrete:  # every sequence whose tokens are all in samples next
            done = sum(r.shape[0] for r in rows[seq_id])
            if done == len(seqs[seq_id]):
                seqs[seq_id].append(int(torch.randint(0, vocab, (1,), generator=gen)))
    return {i: torch.cat(r) for i, r in rows.items()}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max over rows of ||a - b|| / ||b||; NaN anywhere -> inf."""
    if not torch.isfinite(a).all():
        return float("inf")
    return ((a - b).norm(dim=-1) / b.norm(dim=-1).clamp_min(1e-6)).max().item()


def _prompts(vocab: int, seed: int) -> dict[int, list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return {
        i: torch.randint(0, vocab, (n,), generator=gen).tolist() for i, n in enumerate(PROMPT_LENS)
    }


@pytest.mark.parametrize("name", ["llama", "qwen3"])
@pytest.mark.parametrize("block_size", [16, 32])
def test_cupy_matches_torch_backend(name: str, block_size: int, paged_runner) -> None:
    from tandem.models.config import ModelConfig

    config = ModelConfig.from_hf_dict(_hf_config(name).to_dict() | {"architectures": None})
    results = {}
    for backend in ("torch", "cupy"):
        model = build_model(config, dtype=torch.bfloat16, device="cuda", attn_backend=backend)
        init_dummy_weights(model, seed=3)
        runner = CudaPagedRunner(paged_runner, model, config, block_size=block_size, seed=5)
        seqs = _prompts(config.vocab_size, seed=7)
        results[backend] = _run(runner, seqs, config.vocab_size, torch.Generator().manual_seed(9))
    for seq_id, ref in results["torch"].items():
        assert torch.isfinite(ref).all()
        err = _rel(results["cupy"][seq_id], ref)
        _record(f"model {name} bs{block_size} cupy vs torch", err)
        assert err < BF16_TOL, f"{name} seq {seq_id}: {err:.3e}"


@pytest.mark.parametrize("name", ["llama", "qwen3", "olmoe"])
def test_cupy_matches_hf(name: str, tmp_path: Path, paged_runner) -> None:
    import transformers as hf

    torch.manual_seed(0)
    hf_model = hf.AutoModelForCausalLM.from_config(_hf_config(name), attn_implementation="eager")
    with torch.no_grad():  # the weights both sides use: bf16-rounded
        for p in hf_model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    hf_model.save_pretrained(tmp_path)
    hf_model = hf_model.cuda().eval()
    model, config = load_model(tmp_path, dtype=torch.bfloat16, device="cuda", attn_backend="cupy")
    assert model.attn_backend.name == "cupy"
    runner = CudaPagedRunner(paged_runner, model, config, block_size=16, seed=11)
    seqs = _prompts(config.vocab_size, seed=13)
    ours = _run(runner, seqs, config.vocab_size, torch.Generator().manual_seed(15))
    worst = 0.0
    for seq_id, rows in ours.items():
        ids = torch.tensor([seqs[seq_id][: rows.shape[0]]], device="cuda")
        with torch.no_grad():
            ref = hf_model(ids).logits[0].float()
        worst = max(worst, _rel(rows, ref))
    _record(f"model {name} cupy bf16 vs HF fp32", worst)
    assert worst < BF16_TOL, f"{name}: {worst:.3e}"


def _windowed_config(name: str):
    """Windows (16 tokens, passed by the 45-token sequence) in the fused decode prologue:
    Mistral windows every layer (head_dim 64); GPT-OSS every other, with sinks and biases."""
    import transformers as hf

    common = dict(
        vocab_size=2048, hidden_size=512, num_hidden_layers=3, num_attention_heads=8,
        num_key_value_heads=2, max_position_embeddings=1024, sliding_window=16,
    )  # fmt: skip
    if name == "mistral_window":
        return hf.MistralConfig(**common, intermediate_size=1024)
    return hf.GptOssConfig(
        **common, intermediate_size=256, head_dim=64, num_local_experts=4, num_experts_per_tok=4
    )


@pytest.mark.parametrize(
    "name",
    ["llama", "llama_bias", "qwen2", "qwen3", "qwen3_bias", "olmoe", "mistral_window", "gpt_oss"],
)
def test_decode_fast_paths_match_torch_backend(name: str, paged_runner, monkeypatch) -> None:
    """Steps of 1-2 tokens through the skinny linears, the fused gate_up + SiLU and the fused
    qkv + rotary + KV write (qwen2: with the q/k/v bias; qwen3: q/k norms, so the fused norms +
    rotary + KV write after the projection, at every step) against the torch backend. The
    *_bias cases (attention_bias: q/k/v and o_proj; Llama's mlp_bias too) check that every bias
    is added: the skinny linears add theirs, the fused gate_up + SiLU and the fused q/k norms
    step aside for the plain path. OLMoE's whole-row q/k norms and clip_qkv keep the plain
    Attention (its fused rms_norm on the q and k slices of the qkv rows)."""
    import transformers as hf

    from tandem.models.config import ModelConfig
    from tandem.models.layers.attention import Attention
    from tandem.models.layers.cuda_linear import (
        NormRopeAttention,
        SkinnyAttention,
        SkinnyGatedMLP,
        use_cuda_skinny_linear,
    )

    family = name.removesuffix("_bias")
    if name in ("mistral_window", "gpt_oss"):
        hf_cfg = _windowed_config(name)
    elif family == "qwen2":
        hf_cfg = hf.Qwen2Config(
            vocab_size=2048, hidden_size=512, intermediate_size=1024, num_hidden_layers=3,
            num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024,
        )  # fmt: skip
    else:
        hf_cfg = _hf_config(family)
    if name != family:
        hf_cfg.attention_bias = True
        hf_cfg.mlp_bias = family == "llama"
    d = hf_cfg.to_dict()
    d["architectures"] = [type(hf_cfg).__name__.replace("Config", "ForCausalLM")]
    config = ModelConfig.from_hf_dict(d)
    assert config.o_proj_bias is (name != family or name == "gpt_oss")
    assert (config.sliding_window is not None) is (name in ("mistral_window", "gpt_oss"))
    gen = torch.Generator().manual_seed(7)
    tokens = {
        i: torch.randint(0, config.vocab_size, (n,), generator=gen).tolist()
        for i, n in ((0, 45), (1, 10))
    }
    # (seq, token span) per step: a prefill, then steps of one and two decode tokens
    steps = [
        [(0, (0, 40))], [(0, (40, 41))], [(0, (41, 42))], [(0, (42, 43)), (1, (0, 7))],
        [(0, (43, 44)), (1, (7, 8))], [(1, (8, 9))], [(0, (44, 45)), (1, (9, 10))],
    ]  # fmt: skip
    results = {}
    for backend in ("torch", "cupy"):
        model = build_model(config, dtype=torch.bfloat16, device="cuda", attn_backend=backend)
        init_dummy_weights(model, seed=3)
        with torch.no_grad():  # biases at std 0.2 (dummy: 0.02), so a dropped one shows
            for param_name, param in model.named_parameters():
                if param_name.endswith(".bias"):
                    param.mul_(10)
        if backend == "cupy":
            assert use_cuda_skinny_linear(model) > 0
            fused = NormRopeAttention if family == "qwen3" else SkinnyAttention
            # the norms' kernel: no bias, per-head norms only
            attn_cls = Attention if name in ("qwen3_bias", "olmoe") else fused
            assert type(model.layers[0].self_attn) is attn_cls
            assert config.is_moe or isinstance(model.layers[0].mlp, SkinnyGatedMLP)
        runner = CudaPagedRunner(paged_runner, model, config, block_size=16, seed=5)
        rows: dict[int, list[torch.Tensor]] = {0: [], 1: []}
        for work in steps:
            out = runner.step([(i, tokens[i][a:b]) for i, (a, b) in work])
            for seq_id, logits in out.items():
                rows[seq_id].append(logits)
        results[backend] = {i: torch.cat(r) for i, r in rows.items()}
    for seq_id, ref in results["torch"].items():
        assert torch.isfinite(ref).all()
        err = _rel(results["cupy"][seq_id], ref)
        _record(f"model {name} decode fast paths vs torch", err)
        assert err < BF16_TOL, f"{name} seq {seq_id}: {err:.3e}"

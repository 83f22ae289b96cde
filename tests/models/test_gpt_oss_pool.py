"""GPT-OSS through the "cpu_pool" expert backend (biases and the clamped SwiGLU in the pool's
kernels) against HF transformers on tiny random checkpoints, as the other families' pool tests
do (tests/models/test_cpu_pool_models.py): the HF reference gets the pool's own weight rounding
(bf16 / int8 / int4, ext/cpu/reference.quantize), so the scalar ISA matches to fp32 accuracy
and the SIMD ones to a bf16-sized tolerance. Also experts split between the pool and the
"GPU" (here torch on the CPU), and the engine's batched outputs against one request at a time."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers as hf
from safetensors.torch import load_file

from tandem.ext.cpu import supported_isas
from tandem.models.layers.cpu_experts import CpuPoolExpertBackend
from tandem.models.loader import load_model
from tandem.models.mxfp4 import dequantize_mxfp4
from tests.models.test_gpt_oss import (
    GPT_OSS,
    _run_and_check,
    _save_hf_model,
    _to_mxfp4,
    round_experts_as_pool,
)


def _save(path: Path, fmt: str, group: int = 64, **overrides) -> torch.nn.Module:
    """A tiny GPT-OSS checkpoint; the returned HF model's experts rounded as the pool stores
    them."""
    hf_model = _save_hf_model(hf.GptOssConfig(**{**GPT_OSS, **overrides}), path)
    round_experts_as_pool(hf_model, fmt, group)
    return hf_model


def _load(path: Path, **options):
    model, config = load_model(
        path, dtype=torch.float32, device="cpu", expert_backend="cpu_pool",
        expert_options={"num_threads": 2, **options},
    )  # fmt: skip
    backend = model.expert_backend
    assert isinstance(backend, CpuPoolExpertBackend)
    blocks = [m for m in model.modules() if hasattr(m, "w13_bias")]
    assert blocks and all(b.w13.numel() == 0 for b in blocks)  # the pool holds the experts
    return model, config, backend


@pytest.mark.parametrize("fmt,group", [("bf16", 64), ("int8", 64), ("int4", 32), ("int4", 64)])
def test_scalar_pool_matches_hf(fmt: str, group: int, tmp_path: Path, paged_runner) -> None:
    hf_model = _save(tmp_path, fmt, group)
    model, config, backend = _load(tmp_path, fmt=fmt, group_size=group, isa="scalar")
    _run_and_check(hf_model, model, config, paged_runner, 4, seed=3)
    assert sorted(backend._biases) == [0, 1, 2] and backend.stats().layer_calls > 0
    backend.close()


def test_mxfp4_experts_go_to_the_pool_as_int8(tmp_path: Path, paged_runner) -> None:
    """A checkpoint with MXFP4 experts and the format left at "auto": converted once to int8
    rows (docs/gpt-oss.md says why not int4); HF with the same experts, int8-rounded, matches."""
    hf_model = _save_hf_model(hf.GptOssConfig(**GPT_OSS), tmp_path)
    _to_mxfp4(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    with torch.no_grad():  # HF gets the checkpoint's experts: MXFP4 decoded
        for i, layer in enumerate(hf_model.model.layers):
            p = f"model.layers.{i}.mlp.experts."
            for proj in ("gate_up_proj", "down_proj"):
                w = dequantize_mxfp4(tensors[p + proj + "_blocks"], tensors[p + proj + "_scales"])
                getattr(layer.mlp.experts, proj).copy_(w.transpose(1, 2))
    round_experts_as_pool(hf_model, "int8")
    model, config, backend = _load(tmp_path, isa="scalar", fmt="auto")  # the CLI default
    assert [backend.pool.layer_format(i)[0] for i in range(3)] == ["int8"] * 3
    _run_and_check(hf_model, model, config, paged_runner, 4, seed=8)
    backend.close()


@pytest.mark.parametrize("fmt,group", [("bf16", 64), ("int8", 64), ("int4", 32)])
def test_simd_pool_matches_hf_to_bf16(fmt: str, group: int, tmp_path: Path, paged_runner) -> None:
    isa = supported_isas()[-1]
    if isa == "scalar":
        pytest.skip("this CPU has no SIMD path")  # pragma: no cover
    # every expert a token: no top-k flip from the bf16-rounded activations
    hf_model = _save(tmp_path, fmt, group, num_local_experts=4, num_experts_per_tok=4)
    model, config, backend = _load(tmp_path, fmt=fmt, group_size=group, isa=isa)
    _run_and_check(hf_model, model, config, paged_runner, 4, seed=4, tol=2e-2)
    backend.close()


def test_split_placement_and_rebalance_match_hf(tmp_path: Path, paged_runner) -> None:
    """3 of 8 experts a layer "on the GPU" (torch with the placed experts' biases) and 5 on the
    pool, summed; then re-placed by routing counts, in place. Still HF's logits."""
    hf_model = _save(tmp_path, "bf16")
    model, config, backend = _load(tmp_path, isa="scalar", gpu_experts=3, rebalance_after_tokens=0)
    assert all(ids == [0, 1, 2] for ids in backend.stats().gpu_experts.values())
    _run_and_check(hf_model, model, config, paged_runner, 4, seed=5)
    ptrs = {layer: p.bias.b13.data_ptr() for layer, p in backend._placements.items()}
    backend.rebalance()
    assert any(ids != [0, 1, 2] for ids in backend.stats().gpu_experts.values())
    assert {layer: p.bias.b13.data_ptr() for layer, p in backend._placements.items()} == ptrs
    for layer, place in backend._placements.items():  # the placed experts' own bias rows
        block = next(m for m in model.modules() if getattr(m, "layer_idx", None) == layer
                     and hasattr(m, "w13_bias"))  # fmt: skip
        torch.testing.assert_close(place.bias.b13, block.w13_bias[place.expert_ids])
    _run_and_check(hf_model, model, config, paged_runner, 4, seed=6)
    backend.close()


def test_engine_batched_equals_one_by_one(tmp_path: Path, monkeypatch) -> None:
    """`--cpu-experts all` serves GPT-OSS: greedy outputs of a ragged batch (chunked prefill,
    preemption, prefix hits) equal those of each prompt alone. (`--gpu-experts N` needs a
    GPU: test_gpt_oss_hybrid_on_cuda_bf16.)"""
    from tandem.runtime.sampling_params import SamplingParams
    from tests.models.test_deepseek_hybrid import _llm

    monkeypatch.setenv("TANDEM_CPU_ISA", "scalar")
    _save(tmp_path, "bf16")
    gen = torch.Generator().manual_seed(5)
    shared = torch.randint(1, 128, (10,), generator=gen).tolist()
    prompts = [shared + torch.randint(1, 128, (1 + 5 * i % 19,), generator=gen).tolist()
               for i in range(6)]  # fmt: skip
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    spec = {"cpu_experts": "all", "cpu_threads": 1}
    alone = _llm(tmp_path, 64, **spec)
    ref = [alone.generate([p], params)[0].outputs[0].token_ids for p in prompts]
    small = _llm(tmp_path, 14, **spec)
    outs = small.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == ref
    stats = small.engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    for llm in (alone, small):
        backend = llm.engine.model.expert_backend
        assert isinstance(backend, CpuPoolExpertBackend) and backend._biases
        backend.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("spec", [{"cpu_experts": "all"}, {"gpu_experts": 2}])
def test_gpt_oss_hybrid_on_cuda_bf16(spec: dict, tmp_path: Path, paged_runner) -> None:
    """The hybrid path on CUDA (stream-ordered pool calls; with --gpu-experts 2 the placed
    experts' biased grouped GEMMs on the GPU) in bf16 against HF in float32 on the same
    rounded weights; every expert a token, so no routing flip."""
    hf_model = _save(tmp_path, "bf16", num_local_experts=4, num_experts_per_tok=4)
    with torch.no_grad():
        for param in hf_model.parameters():
            param.copy_(param.to(torch.bfloat16).float())
    model, config = load_model(
        tmp_path, dtype=torch.bfloat16, device="cuda", attn_backend="torch",
        expert_backend="cpu_pool", expert_options=spec,
    )  # fmt: skip
    _run_and_check(
        hf_model, model, config, paged_runner, 4, seed=2, device="cuda", dtype=torch.bfloat16,
        tol=3e-2,
    )  # fmt: skip
    assert model.expert_backend.stats().layer_calls > 0
    model.expert_backend.close()

"""GPT-OSS and GLM-4.5 through the engine on CUDA with every expert placement the CLI offers,
each decoding in CUDA graphs: all on the GPU, `--cpu-experts all` (the pool inside the graphs,
long prompts prefilled on the GPU from the pool's weights), `--cpu-experts N` and `--gpu-experts
N` (split layers). Each run's greedy tokens against the all-GPU eager run (bf16: leaving it
where the reference's top two logprobs nearly tie is rounding, a broken path is not). On the
CPU: the placement options are taken or refused by name for both families."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers as hf

from tandem.models.config import ModelConfig
from tests.models.deepseek_cases import save_random_hf
from tests.models.test_glm4_moe import BASE, CASES
from tests.models.test_gpt_oss import GPT_OSS, _save_hf_model

E = 8


def _gpt_oss(path: Path) -> None:
    cfg = {**GPT_OSS, "hidden_size": 128, "head_dim": 64, "intermediate_size": 96,
           "sliding_window": 16, "max_position_embeddings": 1024}  # fmt: skip
    _save_hf_model(hf.GptOssConfig(**cfg), path)


def _glm(path: Path) -> None:
    cfg = {**BASE, **CASES["grouped"], "hidden_size": 128, "head_dim": 64,
           "moe_intermediate_size": 64, "max_position_embeddings": 1024,
           "initializer_range": 0.1}  # fmt: skip
    save_random_hf(hf.Glm4MoeConfig(**cfg), path)


FAMILIES = {"gpt_oss": _gpt_oss, "glm4_moe": _glm}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_placement_options_are_checked(family: str, tmp_path: Path) -> None:
    """--cpu-experts N / --gpu-experts N / --gpu-prefill are taken on CUDA for both families
    and refused by name where they cannot apply (a GPU share without a GPU, more experts than
    a layer has)."""
    from tandem.runtime.config import ModelSpec
    from tandem.runtime.engine_setup import check_expert_options

    FAMILIES[family](tmp_path)
    cfg = ModelConfig.from_hf_dict(json.loads((tmp_path / "config.json").read_text()))
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    for spec in (dict(cpu_experts=6), dict(gpu_experts=2), dict(cpu_experts="all"),
                 dict(cpu_experts="all", gpu_prefill="64")):  # fmt: skip
        check_expert_options(ModelSpec(**spec), cuda, cfg)
    with pytest.raises(ValueError, match="2 experts a layer would stay on the GPU"):
        check_expert_options(ModelSpec(cpu_experts=6), cpu, cfg)
    with pytest.raises(ValueError, match=f"cpu_experts=9 exceeds the {E} experts"):
        check_expert_options(ModelSpec(cpu_experts=9), cuda, cfg)


def _generate(path: Path, graphs: bool, **spec) -> tuple[list[list[int]], object, list]:
    from tandem.runtime.config import CacheConfig, EngineConfig, ModelSpec, SchedulerConfig
    from tandem.runtime.cuda_runner import CudaRunnerOptions
    from tandem.runtime.llm import LLM
    from tandem.runtime.sampling_params import SamplingParams

    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 128, (n,), generator=gen).tolist() for n in (300, 40, 5, 90)]
    ec = EngineConfig(
        model=ModelSpec(model=str(path), device="cuda", dtype="bfloat16", **spec),
        cache=CacheConfig(block_size=16, num_blocks=128),
        scheduler=SchedulerConfig(max_num_seqs=4, max_model_len=512, max_num_batched_tokens=512),
    )
    llm = LLM(engine_config=ec, runner_options=CudaRunnerOptions(cuda_graphs=graphs))
    params = SamplingParams(
        max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=2
    )
    results = llm.generate(prompts, params)
    outs = [list(o.outputs[0].token_ids) for o in results]
    return outs, llm, [o.outputs[0].logprobs for o in results]


TIE = 0.05  # top-2 logprob gap under which a bf16 rounding may pick either token


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_placement_decodes_like_the_gpu(family: str, tmp_path: Path) -> None:
    FAMILIES[family](tmp_path)
    ref, llm, ref_logprobs = _generate(tmp_path, graphs=False)
    llm.engine.close()
    runs = {
        "gpu_graphs": ({}, True),
        "pool_graphs": (dict(cpu_experts="all", cpu_threads=2, gpu_prefill="32"), True),
        "cpu_experts_6": (dict(cpu_experts=6, cpu_threads=2), True),
        "gpu_experts_3": (dict(gpu_experts=3, cpu_threads=2), True),
    }
    placed = {"cpu_experts_6": {2}, "gpu_experts_3": {3}}  # experts a layer on the GPU
    for name, (spec, graphs) in runs.items():
        outs, llm, _ = _generate(tmp_path, graphs, **spec)
        runner, backend = llm.engine.runner, getattr(llm.engine.model, "expert_backend", None)
        # split layers too: their GPU-resident experts run without a host sync at graph sizes
        assert not runner.counters.fallbacks and runner.counters.graph_steps > 0, name
        if spec:
            s = llm.engine.stats().hybrid
            assert s.layer_calls > 0 and s.stream_errors == 0, name
            assert {len(ids) for ids in s.gpu_experts.values()} == placed.get(name, set())
            if name == "pool_graphs":  # the 300-token prompt's MoE layers on the GPU
                assert s.gpu_prefill_calls > 0, name
            backend.close()
        llm.engine.close()
        prefix = [_common_prefix(a, b) for a, b in zip(outs, ref, strict=True)]
        # where a run leaves the reference, the reference's own top two were a near-tie
        for n, lps in zip(prefix, ref_logprobs, strict=True):
            if n < 12:
                (_, first), (_, second) = lps[n].top[:2]
                assert first - second < TIE, (name, prefix, lps[n])
        assert sum(prefix) >= 0.6 * 12 * len(ref), (name, prefix)

"""DeepSeek through the cpu_pool expert backend (routed experts on the pool in bf16/int8/int4,
shared experts and dense layers on the torch side) against HF, the GPU/CPU expert split, and
the engine over the latent cache: batched greedy equals one-by-one with preemption and prefix
cache hits, and the block pool is clean when idle. All float32 on the CPU; the scalar pool
computes in fp32, so quantized references make the comparison exact.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tandem.ext.cpu import quantize
from tandem.models.layers.cpu_experts import CpuPoolExpertBackend
from tandem.models.loader import load_model
from tandem.runtime.sampling_params import SamplingParams
from tests.models.deepseek_cases import save_deepseek
from tests.models.test_deepseek import _run_mixed, max_rel_diff


def _quantize_experts(hf_model: torch.nn.Module, fmt: str) -> None:
    with torch.no_grad():
        for n, p in hf_model.named_parameters():
            if ".experts." in n:
                p.copy_(quantize(p, fmt, 64))


@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4"])
@pytest.mark.parametrize("name", ["v3", "v2_lite"])
def test_pool_matches_hf(name: str, fmt: str, tmp_path: Path, paged_runner) -> None:
    hf_model = save_deepseek(name, tmp_path, bf16_experts=True)
    if fmt != "bf16":
        _quantize_experts(hf_model, fmt)
    model, config = load_model(
        tmp_path, dtype=torch.float32, device="cpu", expert_backend="cpu_pool",
        expert_options={"fmt": fmt, "isa": "scalar", "num_threads": 2},
    )  # fmt: skip
    backend = model.expert_backend
    assert isinstance(backend, CpuPoolExpertBackend)
    blocks = [m for m in model.modules() if hasattr(m, "w13")]
    assert len(blocks) == 2 and all(b.w13.numel() == 0 for b in blocks)  # layer 0 is dense
    assert all(b.shared_experts is not None for b in blocks)  # stays on the torch side
    _, seqs, rows = _run_mixed(model, config, paged_runner, 4)
    assert max_rel_diff(hf_model, seqs, rows) < 1e-4
    routed = sum(r.shape[0] for r in rows.values())  # tokens run (one logits row each)
    for counts in backend.stats().routing_counts.values():
        assert sum(counts) == routed * config.num_experts_per_tok
    backend.close()


def test_split_placement_matches_hf(tmp_path: Path, paged_runner) -> None:
    """--gpu-experts 3: three experts a layer on the model's device (here the CPU), five on the
    pool, summed."""
    hf_model = save_deepseek("v2_grouped", tmp_path, bf16_experts=True)
    model, config = load_model(
        tmp_path, dtype=torch.float32, device="cpu", expert_backend="cpu_pool",
        expert_options={"isa": "scalar", "cpu_experts": 5, "gpu_experts": 3},
    )  # fmt: skip
    backend = model.expert_backend
    assert all(ids == [0, 1, 2] for ids in backend.stats().gpu_experts.values())
    _, seqs, rows = _run_mixed(model, config, paged_runner, 16)
    assert max_rel_diff(hf_model, seqs, rows) < 1e-4
    backend.close()


def _llm(path: Path, num_blocks: int, **spec: object):
    from tandem.runtime.config import CacheConfig, EngineConfig, ModelSpec, SchedulerConfig
    from tandem.runtime.llm import LLM

    ec = EngineConfig(
        model=ModelSpec(**{"model": str(path), "device": "cpu", "dtype": "float32", **spec}),
        cache=CacheConfig(block_size=4, num_blocks=num_blocks),
        scheduler=SchedulerConfig(max_num_seqs=16, max_model_len=48, max_num_batched_tokens=32),
    )
    return LLM(engine_config=ec)


@pytest.mark.parametrize("experts", ["torch", pytest.param("cpu_pool", marks=pytest.mark.slow)])
def test_engine_batched_equals_one_by_one(experts: str, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("TANDEM_CPU_ISA", "scalar")
    save_deepseek("v3", tmp_path, bf16_experts=True)
    gen = torch.Generator().manual_seed(5)
    shared = torch.randint(1, 128, (10,), generator=gen).tolist()  # > 2 full blocks
    prompts = [shared + torch.randint(1, 128, (1 + 5 * i % 19,), generator=gen).tolist()
               for i in range(8)]  # fmt: skip
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    spec = {"cpu_experts": "all", "cpu_threads": 1} if experts == "cpu_pool" else {}
    alone = _llm(tmp_path, 64, **spec)
    ref = [alone.generate([p], params)[0].outputs[0].token_ids for p in prompts]
    # 16 blocks of 4 tokens cannot hold 8 sequences of up to ~40 tokens: preemption
    small = _llm(tmp_path, 16, **spec)
    outs = small.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == ref
    stats = small.engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    sched = small.engine.scheduler
    assert not small.engine.has_unfinished_requests()
    sched.block_pool.check_invariants()
    assert sched.block_pool.usage == 0.0
    assert small.engine.kv_cache.latent and not small.engine.kv_cache.k
    for llm in (alone, small):
        backend = getattr(llm.engine.model, "expert_backend", None)
        if isinstance(backend, CpuPoolExpertBackend):
            backend.close()

"""The CUDA model runner end to end on a small random Llama (bf16, cupy attention):
CUDA-graph decode equals eager decode, launching a step never syncs the host, seeded GPU
sampling does not depend on the batch, and the KV pool is sized from free device memory.

GPU tests: marked `gpu`, skipped without CUDA and CuPy.
"""

from __future__ import annotations

import gc

import pytest
import torch

import tandem.ext.cuda as cuda_ext
from tandem.models.config import ModelConfig
from tandem.models.loader import build_model
from tandem.models.loader.dummy import init_dummy_weights
from tandem.runtime.config import CacheConfig, EngineConfig, ModelSpec, SchedulerConfig
from tandem.runtime.llm import LLM
from tandem.runtime.sampling_params import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not cuda_ext.is_available(), reason="needs CUDA and CuPy"),
]

VOCAB = 512


def small_config() -> ModelConfig:
    return ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=VOCAB, hidden_size=256,
        intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
    )  # fmt: skip


@pytest.fixture(scope="module")
def model():
    cfg = small_config()
    m = build_model(cfg, dtype=torch.bfloat16, device="cuda", attn_backend="cupy")
    init_dummy_weights(m, seed=0, std=0.5)  # large logit margins: greedy is robust to rounding
    return m


def make_llm(model, *, graphs: bool = True, num_blocks: int | None = 512, util: float = 0.9,
             max_num_seqs: int = 32, budget: int = 256, overlap: bool = True,
             options=None) -> LLM:  # fmt: skip
    from tandem.runtime.cuda_runner import CudaRunnerOptions

    ec = EngineConfig(
        model=ModelSpec(model="small", device="cuda", dtype="bfloat16"),
        cache=CacheConfig(block_size=16, num_blocks=num_blocks, gpu_memory_utilization=util),
        scheduler=SchedulerConfig(
            max_num_seqs=max_num_seqs, max_model_len=512, max_num_batched_tokens=budget
        ),
    )
    return LLM(
        engine_config=ec,
        model_module=model,
        model_config=small_config(),
        runner_options=options or CudaRunnerOptions(cuda_graphs=graphs, overlap=overlap),
    )


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(
            1, VOCAB, (int(torch.randint(3, 150, (1,), generator=g)),), generator=g
        ).tolist()
        for _ in range(n)
    ]


def test_graph_decode_equals_eager(model) -> None:
    ps = prompts(24)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    graphed, eager = make_llm(model, graphs=True), make_llm(model, graphs=False)
    out_g = [o.token_ids for o in graphed.generate(ps, params)]
    out_e = [o.token_ids for o in eager.generate(ps, params)]
    rg, re_ = graphed.engine.runner, eager.engine.runner
    assert rg.counters.graph_steps > 0 and re_.counters.graph_steps == 0
    assert not rg.counters.fallbacks, rg.counters.fallbacks
    assert all(len(o) == 20 for o in out_g)
    same = sum(a == b for a, b in zip(out_g, out_e, strict=True))
    # bf16 rounding differs between the graph's split-K plan and eager's; a rare late flip is
    # rounding, a systematic difference is a bug.
    assert same >= 22, f"{same}/24 identical"
    assert all(a[:8] == b[:8] for a, b in zip(out_g, out_e, strict=True))
    pool = graphed.engine.scheduler.block_pool
    pool.check_invariants()
    assert pool.usage == 0.0


def test_launch_never_syncs_the_host(model) -> None:
    # Drives schedule -> runner -> update by hand, the synchronous order: no step in flight.
    llm = make_llm(model, overlap=False)
    eng = llm.engine
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    sampled = SamplingParams(
        max_tokens=8, temperature=0.8, top_p=0.9, top_k=20, min_p=0.05, seed=3, ignore_eos=True
    )
    # every parameter the reference sampler does on the host, here on the device
    penalised = SamplingParams(
        max_tokens=8, temperature=0.0, repetition_penalty=1.3, presence_penalty=0.5,
        frequency_penalty=0.3, min_tokens=6, stop_token_ids=(5,), logprobs=True,
        top_logprobs=4,
    )  # fmt: skip
    kinds = [greedy, sampled, penalised]
    for i, p in enumerate(prompts(6, seed=1)):
        eng.add_request(str(i), p, kinds[i % 3])
    while any(eng.scheduler.get_request(str(i)).num_output_tokens == 0 for i in range(6)):
        eng.step()  # chunked prefills (eager), until every request decodes
    runner = eng.runner
    graph_steps = runner.counters.graph_steps
    for _ in range(3):  # decode steps: graph replay + GPU sampling, launched without a sync
        sched = eng.scheduler.schedule()
        assert not runner.needs_sync(sched)
        torch.cuda.set_sync_debug_mode("error")
        try:
            handle = runner.launch(sched)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        out = runner.finish(handle)
        assert handle.sample is not None and handle.sample.packed is not None
        assert out.logprobs is not None
        sampling = [s for s in sched.seqs if s.sample]
        for s, lp in zip(sampling, out.logprobs, strict=True):
            assert len(lp.top) == (4 if s.request.params.logprobs else 0)
        eng.scheduler.update(sched, out.token_ids)
    assert runner.counters.graph_steps == graph_steps + 3
    assert not runner.counters.fallbacks, runner.counters.fallbacks
    while eng.has_unfinished_requests():
        eng.step()


def test_seeded_sampling_does_not_depend_on_the_batch(model) -> None:
    llm = make_llm(model)
    p = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
    target = prompts(1, seed=5)[0]
    alone = llm.generate([target], p)[0].token_ids
    others = SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True)
    ids = [str(i) for i in range(10)]
    for i, q in zip(ids, prompts(10, seed=6), strict=True):
        llm.engine.add_request("o" + i, q, others)
    llm.engine.add_request("t", target, p)
    got: list[int] = []
    while llm.engine.has_unfinished_requests():
        for d in llm.engine.step():
            if d.request_id == "t":
                got.extend(d.new_token_ids)
    assert got == alone
    assert llm.engine.runner.counters.graph_steps > 0


def test_kv_pool_sized_from_free_memory(model) -> None:
    gc.collect()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    util = (total - free) / total + 0.05  # about 5% of the device for this engine
    llm = make_llm(model, num_blocks=None, util=util)
    eng = llm.engine
    per_block = eng.layout.bytes_per_block
    assert eng.layout.num_blocks > 512 // 16
    assert eng.layout.num_blocks * per_block < 0.05 * total
    out = llm.generate(prompts(4, seed=9), SamplingParams(max_tokens=4, ignore_eos=True))
    assert all(len(o.token_ids) == 4 for o in out)
    free_after, _ = torch.cuda.mem_get_info()
    assert total - free_after <= util * total + (512 << 20)


@pytest.fixture(scope="module")
def small_logit_model():
    # Weights of a usual init scale: logits of a few units, where a bf16 ulp is about 0.01
    # (the std=0.5 model's logits run to ~100, where one ulp is 0.5 and rounding alone
    # moves a logprob by more than any useful tolerance).
    m = build_model(small_config(), dtype=torch.bfloat16, device="cuda", attn_backend="cupy")
    init_dummy_weights(m, seed=3, std=0.05)
    return m


def test_compiled_prefill_equals_eager(small_logit_model) -> None:
    model = small_logit_model
    # TANDEM_COMPILE_PREFILL=1: prefill and mixed steps under torch.compile(dynamic=True);
    # recompiles are counted, a failure falls back to eager counted, never silently.
    from tandem.runtime.cuda_runner import PREFILL_RECOMPILES, CudaRunnerOptions

    opts = CudaRunnerOptions(cuda_graphs=True, compile_mode="default", compile_prefill=True)
    ps = prompts(12, seed=21)
    params = SamplingParams(
        max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=5
    )
    compiled = make_llm(model, max_num_seqs=4, budget=96, options=opts)
    eager = make_llm(model, max_num_seqs=4, budget=96, graphs=False)
    out_c = compiled.generate(ps, params)
    out_e = eager.generate(ps, params)
    runner = compiled.engine.runner
    fb = runner.counters.fallbacks
    assert "prefill_compile_failed" not in fb, fb
    assert runner._eager_model.compiled_steps > 0
    assert fb["prefill_recompile"] <= PREFILL_RECOMPILES, fb
    # Inductor's fusions round differently from eager bf16, so greedy paths of a random model
    # may part where two logits nearly tie; compare the top-5 logprobs up to where they part.
    checked = 0
    for c, e in zip(out_c, out_e, strict=True):
        for lc, le in zip(c.outputs[0].logprobs, e.outputs[0].logprobs, strict=True):
            # a few bf16 ulps of logits of a few units
            assert sorted(v for _, v in lc.top) == pytest.approx(
                sorted(v for _, v in le.top), rel=0.02, abs=0.05
            )
            checked += 1
            if lc.token_id != le.token_id:
                break  # later positions see different inputs
    assert checked >= len(ps)

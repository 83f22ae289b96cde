"""DeepSeek on CUDA: a V3-proportioned model (MLA, grouped sigmoid routing, shared experts,
a dense first layer) in bf16 through each attention backend's `mla` and the gpu / torch expert
backends, against HF transformers in float32 on the same bf16-rounded weights; and the engine
(CUDA runner, overlap scheduler) over the latent cache: batched greedy equals one-by-one with
preemption and prefix-cache hits (float32), and the CUDA runner in bf16 with the cupy MLA kernel,
eagerly and with decode graphs, against a float32 run held to bf16's own noise
(tests/models/greedy_compare.py).

GPU tests: marked `gpu`, skipped without CUDA. TANDEM_GPU_LOG=path records the errors.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tandem.models.loader import load_model
from tests.models.test_cuda_parity import BF16_TOL, _prompts, _rel, _run

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _record(name: str, err: float) -> None:
    path = os.environ.get("TANDEM_GPU_LOG")
    if path:
        with open(path, "a") as f:
            f.write(f"{name}\t{err:.3e}\n")


def _v3_config():
    import transformers as hf

    # every expert a token (top-8 of 8): routing stays continuous under bf16 rounding
    return hf.DeepseekV3Config(
        vocab_size=2048, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256,
        num_hidden_layers=3, num_attention_heads=16, num_key_value_heads=16, q_lora_rank=192,
        kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
        n_routed_experts=8, num_experts_per_tok=8, n_group=4, topk_group=4, n_shared_experts=1,
        first_k_dense_replace=1, max_position_embeddings=1024, initializer_range=0.02,
    )  # fmt: skip


class _CudaRunner:
    """tests/models/conftest.py's paged runner with the latent cache and batch on CUDA."""

    def __init__(self, base_cls, model, config, block_size: int) -> None:
        from tandem.models.batch import KVCache

        self.inner = base_cls(model, config, block_size=block_size, num_blocks=128, seed=3)
        self.inner.kv_cache = KVCache.for_model(config, 128, block_size, torch.bfloat16, "cuda")
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


@pytest.mark.parametrize(
    "attn,experts,gpu_experts",
    [("torch", "gpu", 0), ("cupy", "gpu", 0), ("torch", "torch", 0), ("torch", "cpu_pool", 0),
     ("torch", "cpu_pool", 3)],
)  # fmt: skip
def test_deepseek_cuda_matches_hf(
    attn: str, experts: str, gpu_experts: int, tmp_path: Path, paged_runner
) -> None:
    """gpu_experts 3 (`--gpu-experts 3`): each layer's first three routed experts on the GPU
    (the gpu backend's kernels), the rest on the pool, summed."""
    import transformers as hf

    torch.manual_seed(0)
    hf_model = hf.AutoModelForCausalLM.from_config(_v3_config(), attn_implementation="eager")
    with torch.no_grad():
        for p in hf_model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
        for n, b in hf_model.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1)
    hf_model.save_pretrained(tmp_path)
    hf_model = hf_model.cuda().eval()
    opts = {"gpu_experts": gpu_experts, "rebalance_after_tokens": 0} if gpu_experts else None
    model, config = load_model(tmp_path, dtype=torch.bfloat16, device="cuda", attn_backend=attn,
                               expert_backend=experts, expert_options=opts)  # fmt: skip
    if gpu_experts:
        assert all(len(ids) == 3 for ids in model.expert_backend.stats().gpu_experts.values())
    runner = _CudaRunner(paged_runner, model, config, block_size=16)
    seqs = _prompts(config.vocab_size, seed=13)
    ours = _run(runner, seqs, config.vocab_size, torch.Generator().manual_seed(15))
    worst = 0.0
    for seq_id, rows in ours.items():
        ids = torch.tensor([seqs[seq_id][: rows.shape[0]]], device="cuda")
        with torch.no_grad():
            ref = hf_model(ids).logits[0].float()
        worst = max(worst, _rel(rows, ref))
    _record(f"deepseek-v3 {attn}/{experts}{'+gpu' if gpu_experts else ''} bf16 vs HF fp32", worst)
    assert worst < BF16_TOL, f"{attn}/{experts}: {worst:.3e}"


def test_engine_on_cuda_batched_equals_one_by_one(tmp_path: Path) -> None:
    from tandem.runtime.config import CacheConfig, EngineConfig, ModelSpec, SchedulerConfig
    from tandem.runtime.llm import LLM
    from tandem.runtime.sampling_params import SamplingParams
    from tests.models.deepseek_cases import save_deepseek

    save_deepseek("v3", tmp_path)

    def llm(num_blocks: int) -> LLM:
        ec = EngineConfig(
            model=ModelSpec(model=str(tmp_path), device="cuda", dtype="float32"),
            cache=CacheConfig(block_size=4, num_blocks=num_blocks),
            scheduler=SchedulerConfig(max_num_seqs=16, max_model_len=48,
                                      max_num_batched_tokens=32),
        )  # fmt: skip
        return LLM(engine_config=ec)

    gen = torch.Generator().manual_seed(5)
    shared = torch.randint(1, 128, (10,), generator=gen).tolist()
    prompts = [shared + torch.randint(1, 128, (1 + 5 * i % 19,), generator=gen).tolist()
               for i in range(8)]  # fmt: skip
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    alone = llm(64)
    ref = [alone.generate([p], params)[0].outputs[0].token_ids for p in prompts]
    small = llm(16)
    assert [o.outputs[0].token_ids for o in small.generate(prompts, params)] == ref
    stats = small.engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    small.engine.scheduler.block_pool.check_invariants()
    assert small.engine.scheduler.block_pool.usage == 0.0


def _build(cfg, state, dtype: torch.dtype, attn: str, experts: str):
    from tandem.models.loader import build_model

    opts = {"fmt": "bf16", "expert_cache": False} if experts == "cpu_pool" else None
    model = build_model(cfg, dtype=dtype, device="cuda", attn_backend=attn,
                        expert_backend=experts, expert_options=opts)  # fmt: skip
    model.load_state_dict(state)
    if experts == "cpu_pool":
        model.expert_backend.attach(model)
    return model


@pytest.fixture(scope="module")
def runner_reference():
    """(config, bf16-exact weights, prompts, float32 reference outputs, bf16 noise): the
    reference kernels (torch attention, torch experts) in float32 and in bf16 on the same
    weights, eagerly; their difference is the rounding noise the runs below are held to."""
    from tandem.runtime.cuda_runner import CudaRunnerOptions
    from tests.models.greedy_compare import compare_greedy
    from tests.models.test_greedy_compare import bf16_exact_state, prompts, run_llm, small_v3_config

    cfg = small_v3_config()
    state = bf16_exact_state(cfg)
    ps = prompts(24, cfg.vocab_size, shared=40)  # 2 full blocks in common: prefix-cache hits
    eager = CudaRunnerOptions(cuda_graphs=False, overlap=True)
    outs = {}
    for dtype, name in ((torch.float32, "float32"), (torch.bfloat16, "bfloat16")):
        model = _build(cfg, state, dtype, "torch", "torch")
        outs[name], _ = run_llm(cfg, model, "cuda", name, ps, 16, eager)
        del model
    base = compare_greedy(outs["float32"], outs["bfloat16"])
    _record("deepseek runner: torch bf16 vs float32 (noise), max |dlp|", base.max_abs)
    return cfg, state, ps, outs["float32"], base


@pytest.mark.parametrize("experts", ["gpu", "cpu_pool"])
def test_cuda_runner_graphs_match_eager_and_torch_backend(experts: str, runner_reference) -> None:
    """The CUDA runner (overlap scheduler) with the cupy MLA kernel, eagerly and with decode
    CUDA graphs, against the float32 reference: greedy runs of 24 requests, 16 tokens each,
    compared position by position wherever both runs fed identical tokens (teacher-forced
    logprobs of the top 5 tokens) and at every divergence (a near tie or a failure). Bound:
    3x the noise bf16 shows through the reference kernels. Graphs against eager (the same
    kernels) are held to the same bound; a graph bug (stale inputs, padding rows that leak,
    a wrong split-KV plan) moves logprobs by far more (tests/models/test_greedy_compare.py).
    The graphed run has a small KV pool: it preempts (recomputing through prefill) and hits
    the prefix cache while the graphs and the future-token slots are in use."""
    from tandem.runtime.cuda_runner import CudaRunnerOptions
    from tests.models.greedy_compare import check_within, compare_greedy
    from tests.models.test_greedy_compare import run_llm

    cfg, state, ps, ref, base = runner_reference
    outs, runners = {}, {}
    for graphs in (True, False):
        model = _build(cfg, state, torch.bfloat16, "cupy", experts)
        opts = CudaRunnerOptions(cuda_graphs=graphs, overlap=True)
        blocks = 48 if graphs else 256
        outs[graphs], llm = run_llm(cfg, model, "cuda", "bfloat16", ps, 16, opts, blocks)
        runners[graphs] = llm.engine.runner
        if graphs:
            stats = llm.engine.stats()
            assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0, stats
        if experts == "cpu_pool":
            model.expert_backend.close()
    counters = runners[True].counters
    assert counters.graph_steps > 0 and not counters.fallbacks, counters
    kernels = compare_greedy(ref, outs[False])
    graphs = compare_greedy(outs[False], outs[True])
    _record(f"deepseek runner {experts}: cupy eager vs float32, max |dlp|", kernels.max_abs)
    _record(f"deepseek runner {experts}: graphs vs eager, max |dlp|", graphs.max_abs)
    check_within(kernels, base)
    check_within(graphs, base)

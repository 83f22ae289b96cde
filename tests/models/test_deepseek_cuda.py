"""DeepSeek on CUDA: a V3-proportioned model (MLA, grouped sigmoid routing, shared experts,
a dense first layer) in bf16 through each attention backend's `mla` and the gpu / torch expert
backends, against HF transformers in float32 on the same bf16-rounded weights; and the engine
(CUDA runner, overlap scheduler) over the latent cache: batched greedy equals one-by-one with
preemption and prefix-cache hits.

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


def _small_v3():
    from tandem.models.config import ModelConfig

    return ModelConfig.from_hf_dict({
        "architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 512, "hidden_size": 256,
        "intermediate_size": 512, "moe_intermediate_size": 128, "num_hidden_layers": 3,
        "num_attention_heads": 16, "q_lora_rank": 64, "kv_lora_rank": 128,
        "qk_nope_head_dim": 32, "qk_rope_head_dim": 32, "v_head_dim": 32,
        "n_routed_experts": 8, "num_experts_per_tok": 8, "n_group": 4, "topk_group": 4,
        "n_shared_experts": 1, "first_k_dense_replace": 1, "max_position_embeddings": 512,
    })  # fmt: skip


@pytest.mark.parametrize("experts", ["gpu", "cpu_pool"])
def test_cuda_runner_graphs_match_eager_and_torch_backend(experts: str) -> None:
    """The CUDA runner (overlap scheduler) with the cupy MLA kernel and decode CUDA graphs
    against the same model eager (greedy tokens of 24 requests; bf16: a rare late flip is
    rounding, a systematic difference a bug), and the first token against the torch attention
    backend. Every expert a token (top-8 of 8): no routing flip from bf16 rounding."""
    from tandem.models.loader import build_model
    from tandem.models.loader.dummy import init_dummy_weights
    from tandem.runtime.config import CacheConfig, EngineConfig, ModelSpec, SchedulerConfig
    from tandem.runtime.cuda_runner import CudaRunnerOptions
    from tandem.runtime.llm import LLM
    from tandem.runtime.sampling_params import SamplingParams

    cfg = _small_v3()
    g = torch.Generator().manual_seed(0)
    ps = [torch.randint(1, 512, (int(torch.randint(3, 150, (1,), generator=g)),),
                        generator=g).tolist() for _ in range(24)]  # fmt: skip
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    outs, runners = {}, {}
    for attn, graphs in (("cupy", True), ("cupy", False), ("torch", False)):
        opts = {"fmt": "bf16", "expert_cache": False} if experts == "cpu_pool" else None
        model = build_model(cfg, dtype=torch.bfloat16, device="cuda", attn_backend=attn,
                            expert_backend=experts, expert_options=opts)  # fmt: skip
        init_dummy_weights(model, seed=0, std=0.5)
        if experts == "cpu_pool":
            model.expert_backend.attach(model)
        ec = EngineConfig(
            model=ModelSpec(model="small", device="cuda", dtype="bfloat16"),
            cache=CacheConfig(block_size=16, num_blocks=256),
            scheduler=SchedulerConfig(max_num_seqs=32, max_model_len=512,
                                      max_num_batched_tokens=256),
        )  # fmt: skip
        llm = LLM(engine_config=ec, model_module=model, model_config=cfg,
                  runner_options=CudaRunnerOptions(cuda_graphs=graphs, overlap=True))  # fmt: skip
        key = (attn, graphs)
        outs[key] = [o.token_ids for o in llm.generate(ps, params)]
        runners[key] = llm.engine.runner
        pool = llm.engine.scheduler.block_pool
        pool.check_invariants()
        assert pool.usage == 0.0
        backend = getattr(model, "expert_backend", None)
        if experts == "cpu_pool":
            backend.close()
    assert runners[("cupy", True)].counters.graph_steps > 0
    assert not runners[("cupy", True)].counters.fallbacks, runners[
        ("cupy", True)
    ].counters.fallbacks
    graphed, eager, ref = outs[("cupy", True)], outs[("cupy", False)], outs[("torch", False)]
    same = sum(a == b for a, b in zip(graphed, eager, strict=True))
    first = sum(a[0] == b[0] for a, b in zip(eager, ref, strict=True))
    _record(f"deepseek runner {experts}: graphs == eager (of 24)", same)
    _record(f"deepseek runner {experts}: cupy first token == torch (of 24)", first)
    # the same kernel in and out of the graphs; the first token comes from the (eager) prefill
    assert same >= 20, f"graphs vs eager: {same}/24 identical"
    assert first >= 22, f"cupy vs torch backend, first token: {first}/24"

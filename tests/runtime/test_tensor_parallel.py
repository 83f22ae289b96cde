"""Tensor parallel on the CPU (gloo, 2 processes): TP=2 logits and greedy outputs equal TP=1's
on tiny random HF checkpoints of dense and MoE families; refusals are clear."""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import transformers as hf

from tandem.models.config import ModelConfig, UnsupportedModelError
from tandem.models.layers.parallel import check_tensor_parallel
from tandem.runtime.llm import LLM
from tandem.runtime.sampling_params import SamplingParams
from tests.models.deepseek_cases import CASES as DEEPSEEK_CASES
from tests.models.deepseek_cases import save_random_hf
from tests.models.test_glm4_moe import save_glm
from tests.models.test_gpt_oss import GPT_OSS
from tests.models.test_gpt_oss import _save_hf_model as save_gpt_oss

COMMON = dict(
    vocab_size=127,  # not a multiple of 2: the vocab split pads
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    initializer_range=0.05,
)
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
CASES = {
    # q/k/v and o_proj biases; KV heads split
    "llama_bias": lambda: hf.LlamaConfig(**COMMON, attention_bias=True, mlp_bias=True),
    # one KV head: replicated on both ranks; tied embeddings
    "qwen3_kv1_tied": lambda: hf.Qwen3Config(
        **{**COMMON, "num_key_value_heads": 1}, head_dim=16, tie_word_embeddings=True
    ),
    # shared expert (split) next to expert-parallel routed experts
    "qwen2_moe": lambda: hf.Qwen2MoeConfig(**COMMON, **MOE, shared_expert_intermediate_size=48),
    # q/k norm over the whole row (all-reduced across ranks), clip_qkv
    "olmoe": lambda: hf.OlmoeConfig(
        **{**COMMON, "intermediate_size": 32}, num_experts=8, num_experts_per_tok=2, clip_qkv=1.0
    ),
}
SLOW = {
    "mixtral": lambda: hf.MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2),
    "qwen3_moe": lambda: hf.Qwen3MoeConfig(**COMMON, **MOE, norm_topk_prob=True),
}
PROMPTS = [[5, 9, 11, 3, 70, 2, 8], [100, 4, 4, 6], [7] * 19]
# Families with their own layers: MLA (heads split, latent path whole) with DeepSeek's MoE
# (expert parallel, shared experts split), GLM (DeepSeek's MoE behind grouped-query attention),
# GPT-OSS (sinks split by head, expert biases, windows). Each saves its checkpoint.
DEEPSEEK: dict[str, Callable[[], hf.PretrainedConfig]] = {
    "deepseek_v3": DEEPSEEK_CASES["v3"],  # q_lora, sigmoid routing in groups, a shared expert
    "deepseek_v2_lite": DEEPSEEK_CASES["v2_lite"],  # plain q_proj, softmax routing
}
OWN_SAVE: dict[str, Callable[[Path], object]] = {
    "deepseek_v3": lambda p: save_random_hf(DEEPSEEK["deepseek_v3"](), p),
    "gpt_oss": lambda p: save_gpt_oss(hf.GptOssConfig(**GPT_OSS), p),  # random sinks too
}
OWN_SAVE_SLOW: dict[str, Callable[[Path], object]] = {
    "deepseek_v2_lite": lambda p: save_random_hf(DEEPSEEK["deepseek_v2_lite"](), p),
    "glm4_moe": lambda p: save_glm("grouped", p),
}


def _save(config: hf.PretrainedConfig, path: Path) -> Path:
    torch.manual_seed(0)
    model = hf.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.1)
            elif "norm." in name:
                p.normal_(1.0, 0.2)
    model.save_pretrained(path)
    return path


def _run(path: Path, tp: int) -> tuple[list[list[int]], list[torch.Tensor]]:
    llm = LLM(
        str(path),
        device="cpu",
        dtype="float32",
        num_kv_blocks=64,
        max_model_len=256,
        tensor_parallel_size=tp,
    )
    try:
        return greedy_with_logits(llm, PROMPTS, 6)
    finally:
        llm.engine.close()


def greedy_with_logits(
    llm: LLM, prompts: list[list[int]], max_tokens: int
) -> tuple[list[list[int]], list[torch.Tensor]]:
    """The prompts' greedy ids, and every logits tensor rank 0 computed on the way."""
    model = llm.engine.runner.model
    seen: list[torch.Tensor] = []
    compute = model.compute_logits

    def spy(hidden: torch.Tensor) -> torch.Tensor:
        logits = compute(hidden)
        seen.append(logits.clone())
        return logits

    model.compute_logits = spy
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate(prompts, params)
    return [list(o.token_ids) for o in outs], seen


def _check(name: str, make, tmp_path: Path) -> None:
    _compare(_save(make(), tmp_path / name))


def _compare(path: Path) -> None:
    ids1, logits1 = _run(path, 1)
    ids2, logits2 = _run(path, 2)
    assert multiprocessing.active_children() == []  # close() stopped the worker
    assert ids2 == ids1
    assert len(logits2) == len(logits1)
    for a, b in zip(logits1, logits2, strict=True):
        assert b.shape == a.shape
        assert (b - a).abs().max() / a.abs().max() < 1e-5


@pytest.mark.parametrize("name", list(CASES))
def test_tp2_matches_tp1(name: str, tmp_path: Path) -> None:
    _check(name, CASES[name], tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SLOW))
def test_tp2_matches_tp1_more_families(name: str, tmp_path: Path) -> None:
    _check(name, SLOW[name], tmp_path)


@pytest.mark.parametrize("name", list(OWN_SAVE))
def test_tp2_matches_tp1_mla_and_gpt_oss(name: str, tmp_path: Path) -> None:
    OWN_SAVE[name](tmp_path / name)
    _compare(tmp_path / name)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(OWN_SAVE_SLOW))
def test_tp2_matches_tp1_more_own_families(name: str, tmp_path: Path) -> None:
    OWN_SAVE_SLOW[name](tmp_path / name)
    _compare(tmp_path / name)


@pytest.mark.parametrize("window", [False, True])
def test_step_packing_round_trips(window: bool) -> None:
    """runtime/tp.py: what rank 0 broadcasts a step as is what a worker rebuilds, the window
    pool's tables and slots included where the batch has them (and their size announced)."""
    from tandem.models.batch import ForwardBatch
    from tandem.runtime.tp import pack_step, payload_size, unpack_step

    tables = torch.tensor([[3, 4, 0], [7, 1, 2]], dtype=torch.int32)
    batch = ForwardBatch(
        query_start_loc=torch.tensor([0, 3, 4], dtype=torch.int32),
        seq_lens=torch.tensor([9, 12], dtype=torch.int32),
        block_tables=tables,
        slot_mapping=torch.tensor([30, 31, 32, 45]),
        logits_indices=torch.tensor([2, 3]),
        query_lens_cpu=[3, 1],
        seq_lens_cpu=[9, 12],
        kv_cache=None,
        max_query_len=3,
        max_seq_len=12,
    )
    if window:
        batch.window_block_tables = tables.flip(1).contiguous() + 20
        batch.window_slot_mapping = torch.tensor([5, 6, 7, 90])
    ids, pos = torch.tensor([11, 12, 13, 14]), torch.tensor([6, 7, 8, 11])
    header, payload = pack_step(ids, pos, batch)
    head = header.tolist()
    assert head[5] == int(window) and payload.numel() == payload_size(head)
    ids2, pos2, got = unpack_step(head, payload, None)
    assert torch.equal(ids2, ids) and torch.equal(pos2, pos)
    assert got.query_lens_cpu == [3, 1] and got.seq_lens_cpu == [9, 12]
    assert torch.equal(got.block_tables, tables)
    assert torch.equal(got.slot_mapping, batch.slot_mapping)
    if window:
        assert torch.equal(got.window_block_tables, batch.window_block_tables)
        assert torch.equal(got.window_slot_mapping, batch.window_slot_mapping)
        assert torch.equal(got.kv_tables(8)[0], batch.window_block_tables)
    else:
        assert got.window_block_tables is None and got.window_slot_mapping is None


def _recording(compute: Callable, seen: list[torch.Tensor]) -> Callable:
    def spy(hidden: torch.Tensor) -> torch.Tensor:
        seen.append(compute(hidden).clone())
        return seen[-1]

    return spy


def test_tp2_gpt_oss_window_pool_matches_tp1(tmp_path: Path) -> None:
    """GPT-OSS at TP=2 keeps its windowed layers' own KV pool on both ranks (the worker's
    steps carry the window tables and slots): over sequences several windows long, with
    blocks behind the window released and the window pool's ids unlike the main pool's, every
    logit row and greedy token equals TP=1's."""
    path = tmp_path / "gpt_oss"
    save_gpt_oss(hf.GptOssConfig(**GPT_OSS), path)  # window 8 on layers 0 and 2
    prompts = [[5, 9, 11, 3, 70, 2, 8] * 3, [100, 4, 4, 6], [7] * 30]
    params = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
    results = {}
    for tp in (1, 2):
        # 2 sequences at a time: a window pool of 13 blocks, far fewer than the main pool's
        # ids (a worker that read its windowed layers through the main table would overrun)
        llm = LLM(str(path), device="cpu", dtype="float32", block_size=4, num_kv_blocks=96,
                  max_model_len=96, max_num_seqs=2, max_num_batched_tokens=16,
                  tensor_parallel_size=tp)  # fmt: skip
        try:
            eng = llm.engine
            assert eng.kv_cache.window_layers == (0, 2) and eng.layout.num_window_blocks == 13
            model, seen = eng.runner.model, []
            model.compute_logits = _recording(model.compute_logits, seen)
            outs = llm.generate(prompts, params)
            wp = eng.scheduler.window_pool
            wp.check_invariants()
            assert wp.num_free_blocks == wp.num_usable_blocks
            results[tp] = ([list(o.outputs[0].token_ids) for o in outs], seen)
        finally:
            llm.engine.close()
    assert multiprocessing.active_children() == []
    (ids1, logits1), (ids2, logits2) = results[1], results[2]
    assert ids2 == ids1 and len(logits2) == len(logits1)
    for a, b in zip(logits1, logits2, strict=True):
        assert (b - a).abs().max() / a.abs().max() < 1e-5


def _config(**kw) -> ModelConfig:
    return ModelConfig.from_hf_dict(
        {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **COMMON, **kw}
    )


def test_refusals_name_the_problem() -> None:
    with pytest.raises(UnsupportedModelError, match="num_attention_heads"):
        check_tensor_parallel(_config(), 3, "torch")
    with pytest.raises(UnsupportedModelError, match="FutureForCausalLM"):
        check_tensor_parallel(replace(_config(), architecture="FutureForCausalLM"), 2, "torch")
    mla = ModelConfig.from_hf_dict(DEEPSEEK["deepseek_v3"]().to_dict())
    check_tensor_parallel(mla, 2, "torch")
    with pytest.raises(UnsupportedModelError, match=r"num_attention_heads \(4\).*size 3"):
        check_tensor_parallel(mla, 3, "torch")
    moe = ModelConfig.from_hf_dict(
        {"architectures": ["Qwen3MoeForCausalLM"], **COMMON, **MOE, "model_type": "qwen3_moe"}
    )
    with pytest.raises(ValueError, match="'cpu_pool'"):
        check_tensor_parallel(moe, 2, "cpu_pool")
    six = ModelConfig.from_hf_dict(
        {"architectures": ["Qwen3MoeForCausalLM"], **COMMON, **MOE, "num_experts": 6}
    )
    with pytest.raises(UnsupportedModelError, match=r"num_experts \(6\)"):
        check_tensor_parallel(six, 4, "torch")
    check_tensor_parallel(_config(), 2, "torch")


def test_a_start_up_failure_is_one_error_and_leaves_no_worker(tmp_path: Path) -> None:
    config = hf.LlamaConfig(
        **{**COMMON, "hidden_size": 48, "num_attention_heads": 3, "num_key_value_heads": 1}
    )
    path = _save(config, tmp_path / "three_heads")
    with pytest.raises(UnsupportedModelError, match=r"num_attention_heads \(3\).*size 2"):
        LLM(str(path), device="cpu", dtype="float32", num_kv_blocks=64, tensor_parallel_size=2)
    assert multiprocessing.active_children() == []


_DIES_AT_START = """
import multiprocessing, os, signal, sys, time
from tandem.models.batch import KVCache
from tandem.runtime.llm import LLM

def for_model(*args, **kwargs):  # rank 0 only (the worker is a fresh process)
    for child in multiprocessing.active_children():
        os.kill(child.pid, signal.SIGKILL)
    time.sleep(120)  # as if waiting in a collective with the dead rank

KVCache.for_model = for_model
LLM(sys.argv[1], device="cpu", dtype="float32", num_kv_blocks=64, tensor_parallel_size=2)
"""


def test_a_worker_dying_during_start_up_stops_rank_0(tmp_path: Path) -> None:
    # After the ranks agreed on the KV size, rank 0 could wait forever in a collective with a
    # worker that died; the watch ends it with one error and exit code 1.
    import subprocess
    import sys

    path = _save(CASES["llama_bias"](), tmp_path / "llama")
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", _DIES_AT_START, str(path)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "tensor-parallel start-up failed: tensor-parallel rank 1 exited" in proc.stderr
    assert time.monotonic() - t0 < 60


def test_a_forward_that_fails_between_collectives_stops_every_rank(tmp_path: Path) -> None:
    # Rank 0 raises after layer 0's all-reduces: the worker waits inside layer 1's. A retry
    # (the failure-isolation bisection) would broadcast the next step into that collective;
    # instead the engine fails and the worker is killed.
    from tandem.runtime.engine import EngineStepError

    path = _save(CASES["llama_bias"](), tmp_path / "llama")
    llm = LLM(str(path), device="cpu", dtype="float32", num_kv_blocks=64, tensor_parallel_size=2)
    try:
        procs = list(llm.engine.tp_group.procs)
        layer = llm.engine.runner.model.layers[1]

        def broken(*args, **kwargs):
            raise RuntimeError("fault between collectives")

        layer.forward = layer.forward_residual = broken  # the model calls forward_residual
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        with pytest.raises(EngineStepError, match="tensor-parallel forward failed"):
            llm.generate(PROMPTS, params)
        for p in procs:
            p.join(timeout=10)
            assert not p.is_alive()
    finally:
        llm.engine.close()
    assert multiprocessing.active_children() == []


def test_dequantized_gguf_under_tp_runs(tmp_path: Path) -> None:
    # packed shards: tests/runtime/test_tensor_parallel_quant.py
    from tests.app.tiny_engine import TinyTokenizer
    from tests.models.quant_cases import write_tiny_gguf

    path = write_tiny_gguf(tmp_path / "m.gguf", "Q8_0")
    llm = LLM(
        str(path),
        device="cpu",
        dtype="float32",
        dequantize=True,
        num_kv_blocks=64,
        tensor_parallel_size=2,
        tokenizer=TinyTokenizer(),
    )  # the file has none; fmt: skip
    try:
        params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
        assert len(llm.generate(PROMPTS[:1], params)[0].token_ids) == 3
    finally:
        llm.engine.close()


def test_more_ranks_than_gpus_is_refused_before_any_process_starts(monkeypatch) -> None:
    from tandem.runtime.tp import check_devices

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="needs 2 GPUs.*1 visible"):
        check_devices(torch.device("cuda", 0), 2)
    check_devices(torch.device("cuda", 0), 1)
    check_devices(torch.device("cpu"), 2)  # gloo processes need no GPU


def test_overlapped_steps_under_tp_and_a_launch_failure_stops_every_rank(tmp_path: Path) -> None:
    # The overlap scheduler's path (launch N+1 before applying N) under TP: the same greedy
    # ids; a launch that raises is the engine's failure, never the retry that would broadcast
    # another step into the workers' collectives.
    from tandem.runtime.engine import EngineStepError

    path = _save(CASES["llama_bias"](), tmp_path / "llama")
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    want, _ = _run(path, 1)
    llm = LLM(str(path), device="cpu", dtype="float32", num_kv_blocks=64, max_model_len=256,
              tensor_parallel_size=2, overlap=True)  # fmt: skip
    try:
        assert llm.engine.overlap
        assert [list(o.token_ids) for o in llm.generate(PROMPTS, params)] == want
        procs = list(llm.engine.tp_group.procs)
        layer = llm.engine.runner.model.layers[1]

        def broken(*args, **kwargs):
            raise RuntimeError("fault between collectives")

        layer.forward = layer.forward_residual = broken  # the model calls forward_residual
        with pytest.raises(EngineStepError, match="tensor-parallel forward failed"):
            llm.generate(PROMPTS, params)
        for p in procs:
            p.join(timeout=10)
            assert not p.is_alive()
    finally:
        llm.engine.close()
    assert multiprocessing.active_children() == []

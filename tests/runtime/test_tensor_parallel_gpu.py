"""Tensor parallel on one GPU: a group of one over NCCL, whose all-reduces and logits gather
run (live, not skipped), captured inside the decode CUDA graphs, with rank 0's step mirror
sending every step and the overlap scheduler on. Greedy outputs equal the plain model's."""

from __future__ import annotations

import gc
import os
import socket
from collections import Counter

import pytest
import torch
import torch.distributed as dist

import tandem.ext.cuda as cuda_ext
from tandem.models.layers.parallel import TensorParallel, set_tp
from tandem.models.loader import build_model
from tandem.models.loader.dummy import init_dummy_weights
from tandem.runtime.cuda_runner import CudaModelRunner
from tandem.runtime.sampling_params import SamplingParams
from tandem.runtime.step_mirror import StepMirror
from tandem.runtime.tp import init_group, set_process_env
from tests.runtime.test_cuda_runner import make_llm, prompts, small_config

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not cuda_ext.is_available(), reason="needs CUDA and CuPy"),
]


def _generate(llm) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    return [list(o.token_ids) for o in llm.generate(prompts(6), params)]


def test_decode_graphs_capture_the_nccl_collectives(monkeypatch) -> None:
    cfg = small_config()
    ref_model = build_model(cfg, dtype=torch.bfloat16, device="cuda", attn_backend="cupy")
    init_dummy_weights(ref_model, seed=0, std=0.5)
    ref = make_llm(ref_model, max_num_seqs=8)
    want = _generate(ref)
    assert ref.engine.runner.counters.graph_steps > 0
    del ref
    gc.collect()

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        monkeypatch.setenv("MASTER_PORT", str(s.getsockname()[1]))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    set_process_env()
    calls: Counter = Counter()
    for name in ("all_reduce", "all_gather_into_tensor", "broadcast"):
        real = getattr(dist, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(dist, name, counted)
    device = torch.device("cuda", 0)
    tp, steps = init_group(0, 1, device)
    try:
        assert tp.live and dist.get_backend(steps) == "nccl"
        model = build_model(cfg, dtype=torch.bfloat16, device="cuda", attn_backend="cupy")
        model.load_state_dict(ref_model.state_dict())
        llm = make_llm(model, max_num_seqs=8)
        engine = llm.engine
        calls.clear()
        runner = CudaModelRunner(
            model, engine.model_config, engine.kv_cache, device, model.attn_backend,
            max_num_seqs=8, max_num_batched_tokens=256, max_model_len=engine.max_model_len,
            options=engine.runner.options,
            tp_mirror=lambda seqs, block: StepMirror(steps, 0, seqs, block, device),
        )  # fmt: skip
        assert runner.graphs.graphs, runner.counters.fallbacks
        # warm-up and capture of every bucket went through the live collectives
        assert calls["all_reduce"] >= 2 * cfg.num_hidden_layers * len(runner.graphs.graphs)
        assert calls["all_gather_into_tensor"] >= len(runner.graphs.graphs)
        engine.runner = runner
        assert engine.overlap
        calls.clear()
        got = _generate(llm)
        assert got == want
        c = runner.counters
        assert c.graph_steps > 0 and not c.fallbacks
        assert runner.tp_mirror.num_sent == c.graph_steps + c.eager_steps
        assert calls["broadcast"] == 2 * runner.tp_mirror.num_sent  # header and payload
        # graph replays issue no Python collectives: only the eager steps call them
        assert calls["all_reduce"] == 2 * cfg.num_hidden_layers * c.eager_steps
        assert os.environ["NCCL_NVLS_ENABLE"] == "0"
    finally:
        set_tp(TensorParallel())
        dist.destroy_process_group()

"""Tensor parallel on one GPU: a group of one over NCCL, whose all-reduces and logits gather
run (live, not skipped), captured inside the decode CUDA graphs, with rank 0's step mirror
sending every step and the overlap scheduler on (greedy outputs equal the plain model's); and
a follower runner fed rank 0's mirrored steps in the same process, as a rank past 0 is."""

from __future__ import annotations

import gc
import os
import socket
from collections import Counter

import pytest
import torch
import torch.distributed as dist

import tandem.ext.cuda as cuda_ext
from tandem.models.batch import KVCache
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


def test_a_follower_runs_every_step_rank_0_mirrors(monkeypatch) -> None:
    # Rank 0's engine (overlap on) and a follower runner in one process: the follower's
    # broadcasts read what rank 0's sent, in order. It must replay the same buckets and run
    # the same eager steps on its own KV cache, producing rank 0's logits at every step.
    cfg = small_config()
    models = []
    for _ in range(2):
        m = build_model(cfg, dtype=torch.bfloat16, device="cuda", attn_backend="cupy")
        init_dummy_weights(m, seed=0, std=0.5)
        models.append(m)
    device = torch.device("cuda", 0)
    sent: list[torch.Tensor] = []
    receiving = [False]

    def broadcast(tensor, src, group=None):
        if receiving[0]:
            torch.cuda.synchronize()
            tensor.copy_(sent.pop(0))
        else:
            sent.append(tensor.clone())

    monkeypatch.setattr(dist, "broadcast", broadcast)
    llm = make_llm(models[0], max_num_seqs=8)
    engine = llm.engine
    runners = []
    for rank, model in enumerate(models):
        kv = KVCache.for_model(cfg, engine.layout.num_blocks, 16, torch.bfloat16, device)
        runners.append(
            CudaModelRunner(
                model,
                engine.model_config,
                engine.kv_cache if rank == 0 else kv,
                device,
                model.attn_backend,
                max_num_seqs=8,
                max_num_batched_tokens=256,
                max_model_len=engine.max_model_len,
                options=engine.runner.options,
                tp_mirror=lambda seqs, block, r=rank: StepMirror(None, r, seqs, block, device),
            )  # fmt: skip
        )
    leader, follower = runners
    logits: list[list[torch.Tensor]] = [[], []]
    for i, runner in enumerate(runners):
        forward = runner._forward

        def recorded(p, _forward=forward, _out=logits[i]):
            out = _forward(p)
            if p.num_logits:
                _out.append(out.float().clone())
            return out

        runner._forward = recorded
    engine.runner = leader
    assert engine.overlap
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for i, ids in enumerate(prompts(6)):
        engine.add_request(f"r{i}", ids, params)
    while engine.has_unfinished_requests():
        engine.step()
        receiving[0] = True
        while sent:
            assert follower.follow()
        receiving[0] = False
    torch.cuda.synchronize()
    assert leader.counters.graph_steps > 0 and leader.counters.eager_steps > 0
    assert follower.counters.graph_steps == leader.counters.graph_steps
    assert follower.counters.eager_steps == leader.counters.eager_steps
    assert len(logits[1]) == len(logits[0])
    for a, b in zip(*logits, strict=True):
        assert torch.equal(a.argmax(-1), b.argmax(-1))
        assert (a - b).abs().max() <= 1e-3 * a.abs().max()
    sent.append(leader.tp_mirror.stop_header())
    receiving[0] = True
    assert not follower.follow()  # STOP ends the follower's loop

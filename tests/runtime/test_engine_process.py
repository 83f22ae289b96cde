"""The engine in a child process (runtime/engine_process.py): the same results as the engine in
this process, errors that still fail their request, and a child that dies or fails to start."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path

import pytest

from tandem.models.config import ModelConfig
from tandem.models.hf_export import to_hf_config_dict
from tandem.runtime.config import EngineConfig, ModelSpec, SchedulerConfig
from tandem.runtime.engine import Engine
from tandem.runtime.engine_process import EngineProcess, EngineProcessError, pack_delta
from tandem.runtime.loop import EngineLoop
from tandem.runtime.sampling_params import SamplingParams, SamplingParamsError
from tandem.runtime.types import RequestDelta, TokenLogprob

GREEDY = SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True)


def _config(model_dir: Path) -> EngineConfig:
    return EngineConfig(
        model=ModelSpec(model=str(model_dir), load_format="dummy", device="cpu", dtype="float32"),
        scheduler=SchedulerConfig(max_num_seqs=8, max_model_len=128),
    )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cfg = ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=512, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=512,
    )  # fmt: skip
    path = tmp_path_factory.mktemp("tiny")
    (path / "config.json").write_text(json.dumps(to_hf_config_dict(cfg)))
    return path


@pytest.fixture(scope="module")
def remote(model_dir: Path):
    engine = EngineProcess(_config(model_dir), start_timeout_s=120)
    yield engine
    engine.close()


def _run(engine, prompts: dict[str, list[int]]) -> dict[str, RequestDelta]:
    """Add the prompts, step until done -> each request's deltas merged (ids, text)."""
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, GREEDY)
    ids: dict[str, list[int]] = {r: [] for r in prompts}
    text = dict.fromkeys(prompts, "")
    finish: dict[str, str | None] = {}
    while engine.has_unfinished_requests():
        for d in engine.step():
            ids[d.request_id] += d.new_token_ids
            text[d.request_id] += d.new_text
            if d.finished:
                finish[d.request_id] = d.finish_reason
    return {
        r: RequestDelta(r, tuple(ids[r]), text[r], finish.get(r), num_output_tokens=len(ids[r]))
        for r in prompts
    }


def test_pack_delta_round_trips() -> None:
    d = RequestDelta(
        "r-0", (5, 6), " t5 t6", "stop", "\n", (TokenLogprob(5, -0.5, ((5, -0.5),)),), 3, 2, 1
    )
    assert RequestDelta(*pack_delta(d)) == d


def test_child_engine_gives_what_the_local_engine_gives(remote, model_dir: Path) -> None:
    prompts = {"a": [1, 2, 3, 4], "b": [9, 8, 7], "c": [100, 200, 300, 400, 500]}
    got = _run(remote, prompts)
    want = _run(Engine(_config(model_dir)), prompts)
    assert got == want
    assert all(d.finish_reason == "length" and len(d.new_token_ids) == 7 for d in got.values())
    assert remote.model_name == model_dir.name and remote.tokenizer is not None
    assert remote.stats().num_running == 0 and not remote.has_unfinished_requests()


def test_steps_read_while_adding_do_not_end_the_newer_work(remote) -> None:
    # "a" finishes in the child before "b" is added; its steps, read while waiting for b's
    # "added" answer, said "nothing unfinished" then: b's own steps must still come.
    import time

    remote.add_request("early", [1, 2, 3], GREEDY)
    time.sleep(1.0)
    remote.add_request("late", [4, 5, 6], GREEDY)
    ids: dict[str, list[int]] = {"early": [], "late": []}
    while remote.has_unfinished_requests():
        for d in remote.step():
            ids[d.request_id] += d.new_token_ids
    assert len(ids["early"]) == 7 and len(ids["late"]) == 7


def test_bad_requests_fail_at_add_with_their_error(remote) -> None:
    with pytest.raises(SamplingParamsError) as err:
        remote.add_request("bad-vocab", [1, 9999], GREEDY)
    assert err.value.param == "prompt" and "9999" in str(err.value)
    errors = remote.add_requests(
        [("too-long", list(range(1, 200)), GREEDY, 0, None), ("ok", [1, 2], GREEDY, 0, None)]
    )
    assert isinstance(errors[0], ValueError) and errors[1] is None
    done = {}
    while remote.has_unfinished_requests():
        done |= {d.request_id: d for d in remote.step() if d.finished}
    assert set(done) == {"ok"}


def test_abort_reaches_the_child(remote) -> None:
    remote.add_request("long", [1, 2, 3], SamplingParams(max_tokens=100, ignore_eos=True))
    remote.step()
    remote.abort_request("long")
    finish = None
    while remote.has_unfinished_requests():
        finish = next((d.finish_reason for d in remote.step() if d.finished), finish)
    assert finish == "abort"


def test_an_engine_loop_serves_from_the_child(remote) -> None:
    async def main() -> list[int]:
        loop = EngineLoop(remote, max_queue=8, max_running=8)
        await loop.start()
        stream = await loop.submit("s", [[1, 2, 3], [4, 5]], GREEDY)
        ids: dict[int, list[int]] = {0: [], 1: []}
        async for batch in stream:
            for c in batch:
                ids[c.index] += c.delta.new_token_ids
        with pytest.raises(SamplingParamsError):
            await loop.submit("bad", [[1, 2], [1, 9999]], GREEDY)
        await loop.wait_idle()
        await loop.stop()
        return [len(v) for v in ids.values()]

    assert asyncio.run(main()) == [7, 7]
    assert not remote.has_unfinished_requests()


def test_a_child_that_dies_fails_the_next_step(model_dir: Path) -> None:
    engine = EngineProcess(_config(model_dir), start_timeout_s=120)
    try:
        engine.add_request("x", [1, 2], SamplingParams(max_tokens=100, ignore_eos=True))
        os.kill(engine._proc.pid, signal.SIGKILL)
        with pytest.raises(EngineProcessError, match="exited"):
            while True:
                engine.step()
    finally:
        engine.close()


def test_a_child_that_dies_while_idle_kills_the_loop(model_dir: Path) -> None:
    engine = EngineProcess(_config(model_dir), start_timeout_s=120)

    async def main() -> bool:
        loop = EngineLoop(engine, max_queue=8, max_running=8)
        await loop.start()
        os.kill(engine._proc.pid, signal.SIGKILL)
        await asyncio.wait_for(loop.wait_dead(), 30)
        return loop.healthy

    try:
        assert asyncio.run(main()) is False
    finally:
        engine.close()


def test_a_child_that_cannot_load_the_model_raises_what_the_engine_raises(
    tmp_path: Path,
) -> None:
    with pytest.raises((ValueError, OSError)) as want:
        Engine(_config(tmp_path / "missing"))
    with pytest.raises(type(want.value)) as got:
        EngineProcess(_config(tmp_path / "missing"), start_timeout_s=120)
    assert str(got.value) == str(want.value)


def test_the_default_is_a_child_process_only_for_one_cuda_device(model_dir: Path) -> None:
    from dataclasses import replace

    from tandem.runtime.engine_process import use_engine_process

    cfg = _config(model_dir)  # device cpu
    assert not use_engine_process(cfg, None)
    assert use_engine_process(cfg, True) and not use_engine_process(cfg, False)
    cuda_tp = replace(cfg, model=replace(cfg.model, device="cuda", tensor_parallel_size=2))
    assert not use_engine_process(cuda_tp, None)
    pool = replace(cfg, model=replace(cfg.model, device="cuda", cpu_experts="all"))
    assert not use_engine_process(pool, None) and use_engine_process(pool, True)

"""The CUDA runner's tensor-parallel step link (runtime/step_mirror.py), run over gloo with
CPU buffers: what rank 1 receives into its own buffers is exactly what rank 0 staged, for
decode-graph steps (padded rows, no logits indices), eager steps and windowed caches."""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tandem.runtime.cuda_inputs import PreparedStep, StepBuffers
from tandem.runtime.step_mirror import StepMirror

MAX_TOKENS, MAX_SEQS, MAX_BLOCKS, BLOCK = 64, 8, 6, 16
STEPS = [
    # a decode batch of 3 padded to the graph bucket 4
    PreparedStep(4, 3, 3, 4, 1, 40, [1, 1, 1], [40, 17, 3]),
    # a mixed eager step: a prefill chunk of 9 and two decodes, one of which does not sample
    PreparedStep(11, 3, 2, None, 9, 80, [9, 1, 1], [9, 80, 33]),
]


def _filled(seed: int, windowed: bool) -> StepBuffers:
    d = StepBuffers.allocate(MAX_TOKENS, MAX_SEQS, MAX_BLOCKS, torch.device("cpu"), windowed)
    g = torch.Generator().manual_seed(seed)
    for name in vars(d):
        t = getattr(d, name)
        if t is not None:
            t.copy_(torch.randint(-1, 1000, t.shape, generator=g))
    return d


def _parts(mirror: StepMirror, p: PreparedStep, d: StepBuffers) -> list[torch.Tensor]:
    return mirror._parts(mirror.header(p), d)


def _worker(rank: int, port: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        mirror = StepMirror(None, rank, MAX_SEQS, BLOCK, torch.device("cpu"))
        for windowed in (False, True):
            if rank == 0:
                for i, p in enumerate(STEPS):
                    mirror.send(p, _filled(i, windowed))
                dist.broadcast(mirror.stop_header(), 0)
                continue
            got = []
            d = _filled(99, windowed)  # stale values where a step writes nothing
            while (p := mirror.receive(d)) is not None:
                got.append((p, [t.tolist() for t in _parts(mirror, p, d)]))  # no shared memory
            queue.put(got)
    finally:
        dist.destroy_process_group()


def _run() -> list:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    procs = [ctx.Process(target=_worker, args=(r, port, queue)) for r in (0, 1)]
    for p in procs:
        p.start()
    got = [queue.get(), queue.get()]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    return got


def test_the_other_rank_receives_exactly_what_rank_0_staged() -> None:
    for windowed, got in zip((False, True), _run(), strict=True):
        assert [p for p, _ in got] == STEPS
        mirror = StepMirror(None, 0, MAX_SEQS, BLOCK, torch.device("cpu"))
        for i, (p, parts) in enumerate(got):
            sent = _parts(mirror, p, _filled(i, windowed))
            assert len(parts) == len(sent) == (6 + (p.graph_bs is None) + 2 * windowed)
            for a, b in zip(parts, sent, strict=True):
                assert a == b.tolist()
        graph, eager = got[0][1], got[1][1]
        assert len(graph[3]) == 4 + 1  # query_start_loc over the whole bucket
        assert len(eager[5]) == 3 and len(eager[5][0]) == 5  # tables cut to the widest's blocks

"""CUDA graphs of the decode forward, one per batch-size bucket, and the torch.compile setup
the runner's forwards share.

Owns the captured graphs, their memory pool and static logits, and bucket lookup. The graphs
read the runner's static device input buffers; a replay computes logits for rows 0..bs-1 of
the bucket. Knows nothing of scheduling or sampling.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tandem.models.batch import ForwardBatch

log = logging.getLogger(__name__)

GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)

ForwardFn = Callable[[torch.Tensor, torch.Tensor, ForwardBatch], torch.Tensor]


def pow2_ceil(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(n, 1))))


def compile_forward(fn: ForwardFn, mode: str, *, dynamic: bool | None, recompiles: int):
    """torch.compile `fn` so that more than `recompiles` recompiles raise instead of silently
    running eagerly: the caller catches it, logs it and counts it."""
    import torch._dynamo

    cfg = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(cfg, name):
            setattr(cfg, name, max(getattr(cfg, name), recompiles))
    if hasattr(cfg, "fail_on_recompile_limit_hit"):
        cfg.fail_on_recompile_limit_hit = True
    return torch.compile(fn, mode=mode, dynamic=dynamic)


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor | None  # [bs, vocab] float32, the graph's static output (rank 0)


class DecodeGraphs:
    def __init__(self, sizes: tuple[int, ...]) -> None:
        self.sizes = tuple(sorted(sizes))
        self.graphs: dict[int, _Graph] = {}
        self._pool = None

    def bucket(self, num_seqs: int) -> int | None:
        """The captured bucket a decode batch of `num_seqs` pads to, or None."""
        for bs in self.sizes:
            if bs >= num_seqs:
                return bs if bs in self.graphs else None
        return None

    def replay(self, bs: int, num_logits: int) -> torch.Tensor | None:
        """Enqueue bucket `bs` on the current stream -> its logits `[num_logits, vocab]`
        (None on a tensor-parallel rank past 0, whose forward returns none)."""
        g = self.graphs[bs]
        g.graph.replay()
        return None if g.logits is None else g.logits[:num_logits]

    @torch.inference_mode()
    def capture(
        self,
        stream: torch.cuda.Stream,
        batch_for: Callable[[int], ForwardBatch],
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        forward: ForwardFn,
        eager: ForwardFn,
        before_forward: Callable[[torch.Tensor], None],
        on_fallback: Callable[[str, str], None],
    ) -> None:
        """Capture every bucket, largest first (the pool then fits all). `input_ids` and
        `positions` are the static `[max_tokens]` device buffers, already inert (no KV is
        written or read); `before_forward(ids)` runs inside each graph before the forward. A
        bucket whose (compiled) `forward` fails is captured with `eager`, counted."""
        t0 = time.perf_counter()
        self._pool = torch.cuda.graph_pool_handle()
        for bs in sorted(self.sizes, reverse=True):
            batch = batch_for(bs)
            ids, pos = input_ids[:bs], positions[:bs]
            fn = forward
            with torch.cuda.stream(stream):
                try:
                    for _ in range(2):  # warm-up: kernel compiles, lazy caches, autotuning
                        fn(ids, pos, batch)
                except Exception as e:  # a compile failure must not take the engine down
                    if fn is eager:
                        raise
                    on_fallback("compile_failed", f"bucket {bs}: {type(e).__name__}: {e}")
                    fn = eager
                    fn(ids, pos, batch)
                before_forward(ids)
            stream.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool, stream=stream):
                before_forward(ids)
                logits = fn(ids, pos, batch)
            self.graphs[bs] = _Graph(graph, logits)
        stream.synchronize()
        log.info(
            "captured %d decode CUDA graphs (batch sizes %s) in %.1fs",
            len(self.graphs),
            ",".join(map(str, sorted(self.graphs))),
            time.perf_counter() - t0,
        )


class CompiledEagerForward:
    """The forward of steps that run without a graph (prefill chunks, mixed batches), under
    torch.compile with dynamic shapes. A recompile after the first compile is logged and
    counted (`on_fallback("prefill_recompile")`); past `recompiles` dynamo raises, and so does
    any compile failure: that is logged and counted once (`prefill_compile_failed`) and the
    eager forward serves every later step."""

    def __init__(
        self,
        model: torch.nn.Module,
        mode: str,
        recompiles: int,
        on_fallback: Callable[[str, str], None],
    ) -> None:
        def prefill_forward(ids: torch.Tensor, pos: torch.Tensor, batch: ForwardBatch):
            return model(ids, pos, batch)

        self._model = model
        self._fn = compile_forward(prefill_forward, mode, dynamic=True, recompiles=recompiles)
        self._on_fallback = on_fallback
        self._compiled_once = False
        self.compiled_steps = 0

    def __call__(self, ids: torch.Tensor, pos: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """ids/pos `[T]` int64, device -> the model's hidden states of the sampling tokens."""
        if self._fn is None:
            return self._model(ids, pos, batch)
        from torch._dynamo.utils import counters

        before = counters["stats"]["unique_graphs"]
        try:
            out = self._fn(ids, pos, batch)
        except Exception as e:  # rerunning eagerly rewrites the same KV slots: idempotent
            log.exception("compiled prefill forward failed; prefill/mixed steps run eagerly")
            self._on_fallback("prefill_compile_failed", f"{type(e).__name__}: {e}")
            self._fn = None
            return self._model(ids, pos, batch)
        new_graphs = counters["stats"]["unique_graphs"] - before
        if new_graphs and self._compiled_once:
            self._on_fallback(
                "prefill_recompile", f"{len(batch.query_lens_cpu)} seqs, {ids.shape[0]} tokens"
            )
        self._compiled_once = self._compiled_once or bool(new_graphs)
        self.compiled_steps += 1
        return out

"""The engine: one `step()` = schedule → execute → update, plus request bookkeeping.

Synchronous and single-threaded by contract: the async `EngineLoop` calls `step()` from one
worker thread and applies `add_request` / `abort_request` only between steps.

Overlap (on CUDA by default, `CudaRunnerOptions.overlap`): one `step()` schedules and
launches step N+1, then waits for step N and applies it, so the GPU always has the next step
queued while the host applies the last. The scheduler runs in async mode (see its module);
tokens step N+1 consumes before step N is applied are resolved on the device by the runner.
A step whose sampling reads the output history (penalties, min_tokens, logprobs) waits for
the step in flight first. `has_unfinished_requests` stays true while a step is in flight.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from models.batch import KVCache
from models.config import ModelConfig
from runtime.config import EngineConfig
from runtime.detokenizer import IncrementalDetokenizer
from runtime.engine_setup import (
    load_engine_model,
    load_tokenizer,
    resolve_device,
    resolve_dtype,
    size_kv_cache,
)
from runtime.model_runner import ModelRunner
from runtime.request import Request, RequestStatus
from runtime.sampling_params import SamplingParams, SamplingParamsError
from runtime.scheduler import Scheduler
from runtime.types import EngineStats, RequestDelta, SamplerOutput, SchedulerOutput, TokenLogprob

if TYPE_CHECKING:
    from runtime.grammar import GrammarCompiler

log = logging.getLogger(__name__)


@dataclass
class _Tracked:
    request: Request
    detok: IncrementalDetokenizer | None
    sent_tokens: int = 0
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass
class _InFlight:
    """A launched step whose results the scheduler has not applied yet."""

    sched: SchedulerOutput
    handle: object  # the runner's launch handle


def _abort_delta(req: Request) -> RequestDelta:
    """The last delta of an aborted request: no new tokens, finish_reason "abort"."""
    return RequestDelta(
        request_id=req.request_id,
        new_token_ids=(),
        new_text="",
        finish_reason="abort",
        num_prompt_tokens=req.num_prompt_tokens,
        num_output_tokens=req.num_output_tokens,
        num_cached_tokens=req.num_cached_tokens,
    )


class Engine:
    def __init__(
        self,
        config: EngineConfig,
        *,
        model_module=None,
        model_config=None,
        tokenizer=None,
        runner_options=None,
        overlap: bool | None = None,
    ) -> None:
        """Loads the model named by `config.model`, or takes a prebuilt `model_module` (tests,
        tools) with its `model_config` and optional `tokenizer`. `runner_options`
        (runtime.cuda_runner.CudaRunnerOptions) tune the CUDA runner; default: from the env.
        `overlap`: overlap scheduling; None takes `runner_options.overlap` on CUDA, off on CPU."""
        self.config = config
        spec = config.model
        self.device = resolve_device(spec.device)
        self.dtype = resolve_dtype(spec.dtype, self.device)
        t0 = time.perf_counter()
        model_path: Path | None = None
        model = model_module
        if model is None:
            model, model_config, model_path = load_engine_model(
                spec, self.device, self.dtype, model_config
            )
        assert model_config is not None
        self.model = model
        self.model_config = model_config
        if tokenizer is None and model_path is not None:
            tokenizer = load_tokenizer(model_path, spec.load_format, model_config.vocab_size)
        self.tokenizer = tokenizer
        self.model_name = spec.model or "smollm2-135m-instruct"
        if model_path is not None and spec.model:
            self.model_name = Path(spec.model).name if Path(spec.model).exists() else spec.model
        log.info(
            "model loaded in %.2fs on %s (%s)", time.perf_counter() - t0, self.device, self.dtype
        )

        sched_cfg = config.scheduler
        self.max_model_len = min(sched_cfg.max_model_len, model_config.max_context)
        self.layout = size_kv_cache(
            config, model, model_config, self.dtype, self.device, self.max_model_len
        )
        self.kv_cache = KVCache.for_model(
            model_config, self.layout.num_blocks, self.layout.block_size, self.dtype, self.device
        )
        from dataclasses import replace

        if self.device.type == "cuda":
            from runtime.cuda_runner import CudaRunnerOptions

            runner_options = runner_options or CudaRunnerOptions.from_env()
            if overlap is None:
                overlap = runner_options.overlap
        self.overlap = bool(overlap)
        self.scheduler = Scheduler(
            replace(sched_cfg, max_model_len=self.max_model_len), config.cache,
            self.layout.num_blocks, async_mode=self.overlap,
            window=_all_layers_window(model_config),
        )  # fmt: skip
        attn_backend = getattr(model, "attn_backend", None)
        if self.device.type == "cuda":
            from runtime.cuda_runner import CudaModelRunner

            self.runner = CudaModelRunner(
                model, model_config, self.kv_cache, self.device, attn_backend,
                max_num_seqs=sched_cfg.max_num_seqs,
                max_num_batched_tokens=sched_cfg.max_num_batched_tokens,
                max_model_len=self.max_model_len,
                options=runner_options,
            )  # fmt: skip
        else:
            self.runner = ModelRunner(model, model_config, self.kv_cache, self.device, attn_backend)
        self.eos_token_ids: tuple[int, ...] = tuple(
            dict.fromkeys(
                (tokenizer.eos_token_ids if tokenizer is not None else ())
                + tuple(model_config.eos_token_ids)
            )
        )
        self._tracked: dict[str, _Tracked] = {}
        self._aborted: list[RequestDelta] = []
        self._prompt_tokens_total = 0
        self._generation_tokens_total = 0
        self._num_steps = 0
        self._in_flight: _InFlight | None = None
        self._grammar_compiler: GrammarCompiler | None = None
        self._grammar_lock = threading.Lock()

    @property
    def grammar_compiler(self) -> GrammarCompiler:
        """Compiles structured-output grammars for this engine's tokenizer (thread-safe; the
        server compiles in a worker thread, so `add_request` finds the grammar cached)."""
        with self._grammar_lock:
            if self._grammar_compiler is None:
                from runtime.grammar import grammar_compiler_for

                self._grammar_compiler = grammar_compiler_for(
                    self.tokenizer, self.model_config.vocab_size, self.eos_token_ids
                )
            return self._grammar_compiler

    # -- requests -----------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        arrival_time: float | None = None,
    ) -> None:
        if params.n != 1:
            raise SamplingParamsError("n", "Engine.add_request takes n=1; expand n with expand_n")
        if request_id in self._tracked:
            raise ValueError(f"duplicate request id {request_id!r}")
        if not prompt_token_ids:
            raise SamplingParamsError("prompt", "the prompt is empty")
        vocab = self.model_config.vocab_size
        bad = next((t for t in prompt_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise SamplingParamsError(
                "prompt", f"token id {bad} is outside the vocabulary [0, {vocab})"
            )
        bad = next((t for t, _ in params.logit_bias if t >= vocab), None)
        if bad is not None:
            raise SamplingParamsError(
                "logit_bias", f"token id {bad} is outside the vocabulary [0, {vocab})"
            )
        grammar = None
        if params.grammar is not None:
            from runtime.grammar import GrammarError

            try:
                grammar = self.grammar_compiler.compile(params.grammar).new_matcher()
            except GrammarError as exc:
                raise SamplingParamsError("response_format", str(exc)) from None
        req = Request(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            params=params,
            arrival_time=time.monotonic() if arrival_time is None else arrival_time,
            priority=priority,
            eos_token_ids=self.eos_token_ids,
            grammar=grammar,
        )
        self.scheduler.add_request(req)  # raises RequestTooLongError
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(
                self.tokenizer, prompt_token_ids, params.stop, params.skip_special_tokens
            )
        self._tracked[request_id] = _Tracked(req, detok)
        self._prompt_tokens_total += len(prompt_token_ids)

    def abort_request(self, request_id: str) -> None:
        tracked = self._tracked.pop(request_id, None)
        if tracked is None:
            return
        self.scheduler.abort_request(request_id)
        self.runner.release(request_id)
        self._aborted.append(_abort_delta(tracked.request))

    def has_unfinished_requests(self) -> bool:
        return bool(self._tracked) or bool(self._aborted) or self._in_flight is not None

    # -- the step -----------------------------------------------------------------------------

    def step(self) -> list[RequestDelta]:
        deltas, self._aborted = self._aborted, []
        if self.overlap:
            return deltas + self._step_overlapped()
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return deltas
        out = self.runner.execute(sched)
        self.scheduler.update(sched, out.token_ids)
        self._num_steps += 1
        self._generation_tokens_total += len(out.token_ids)
        sampled = [s.request for s in sched.seqs if s.sample]
        if out.logprobs is not None:
            for req, lp in zip(sampled, out.logprobs, strict=True):
                tracked = self._tracked.get(req.request_id)
                if tracked is not None and req.params.logprobs:
                    tracked.pending_logprobs.append(lp)
        for req in sampled:
            delta = self._safe_delta(req)
            if delta is not None:
                deltas.append(delta)
        return deltas

    def _step_overlapped(self) -> list[RequestDelta]:
        """schedule N+1 → launch N+1 → finish N → update N; drains when nothing is scheduled."""
        deltas: list[RequestDelta] = []
        sched = self.scheduler.schedule()
        prev, self._in_flight = self._in_flight, None
        if prev is not None and (sched.is_empty or self.runner.needs_sync(sched)):
            deltas += self._apply(prev)
            prev = None
            # Requests that step finished are no longer run: their blocks are gone.
            live = tuple(s for s in sched.seqs if not s.request.is_finished)
            if len(live) != len(sched.seqs):
                sched = SchedulerOutput(
                    seqs=live,
                    num_batched_tokens=sum(s.num_tokens for s in live),
                    preempted_ids=sched.preempted_ids,
                )
        if not sched.is_empty:
            self._in_flight = _InFlight(sched, self.runner.launch(sched))
        if prev is not None:
            deltas += self._apply(prev)
        return deltas

    def _apply(self, step: _InFlight) -> list[RequestDelta]:
        out: SamplerOutput = self.runner.finish(step.handle)
        sampled = [s.request for s in step.sched.seqs if s.sample]
        before = [r.num_output_tokens for r in sampled]
        self.scheduler.update(step.sched, out.token_ids)
        self._num_steps += 1
        # A token is taken only where update() appended it: a late finish's extra token, or
        # one of a request preempted or ended while its step ran, is dropped.
        taken = [r.num_output_tokens > n for r, n in zip(sampled, before, strict=True)]
        self._generation_tokens_total += sum(taken)
        if out.logprobs is not None:
            for req, ok, lp in zip(sampled, taken, out.logprobs, strict=True):
                tracked = self._tracked.get(req.request_id)
                if ok and tracked is not None and req.params.logprobs:
                    tracked.pending_logprobs.append(lp)
        deltas = []
        for req, ok in zip(sampled, taken, strict=True):
            if not ok and not req.is_finished:
                continue
            delta = self._safe_delta(req)
            if delta is not None:
                deltas.append(delta)
        return deltas

    def _safe_delta(self, req: Request) -> RequestDelta | None:
        """`_make_delta`, but a failure of one request's own post-processing (detokenizer, stop
        strings) ends that request with "abort" instead of raising out of step(), which the
        loop treats as a dead engine: every later request would get 503."""
        try:
            return self._make_delta(req)
        except Exception:
            rid = req.request_id
            log.exception("request %s failed after its step; aborting it", rid)
            tracked = self._tracked.pop(rid, None)
            if not req.is_finished:
                self.scheduler.finish_request(rid, RequestStatus.FINISHED_ABORTED)
            self.runner.release(rid)
            return None if tracked is None else _abort_delta(req)

    def _make_delta(self, req: Request) -> RequestDelta | None:
        tracked = self._tracked.get(req.request_id)
        if tracked is None:
            return None
        num_output = req.num_output_tokens
        # Only the new ids: slicing output_token_ids would copy the whole output every step.
        new_ids = tuple(req.token_ids[len(req.token_ids) - (num_output - tracked.sent_tokens) :])
        text = ""
        detok = tracked.detok
        if detok is not None:
            text = detok.add_tokens(new_ids)
            if detok.stop_matched is not None:
                if not req.is_finished:
                    req.stop_reason = detok.stop_matched
                    self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_STOPPED)
                elif req.status == RequestStatus.FINISHED_LENGTH:
                    # the token that completed the stop string was also the last one allowed:
                    # the text ends at the stop string, so the reason is "stop" (as vLLM says)
                    req.stop_reason = detok.stop_matched
                    req.status = RequestStatus.FINISHED_STOPPED
            if req.is_finished:
                text += detok.flush()
        tracked.sent_tokens = num_output
        logprobs: tuple[TokenLogprob, ...] = ()
        if tracked.pending_logprobs:
            logprobs, tracked.pending_logprobs = tuple(tracked.pending_logprobs), []
        finish = req.status.finish_reason
        if finish is not None:
            del self._tracked[req.request_id]
            self.runner.release(req.request_id)
        return RequestDelta(
            req.request_id,
            new_ids,
            text,
            finish,
            req.stop_reason,
            logprobs,
            req.num_prompt_tokens,
            num_output,
            req.num_cached_tokens,
        )

    def stats(self) -> EngineStats:
        pool = self.scheduler.block_pool
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            num_blocks=self.layout.num_blocks,
            num_free_blocks=pool.num_free_blocks,
            kv_cache_usage=pool.usage,
            prefix_cache_hits=pool.prefix_cache_hits,
            prefix_cache_queries=pool.prefix_cache_queries,
            num_preemptions=self.scheduler.num_preemptions_total,
            prompt_tokens_total=self._prompt_tokens_total,
            generation_tokens_total=self._generation_tokens_total,
            num_steps=self._num_steps,
            hybrid=self._hybrid_stats(),
            **self._runner_stats(),
        )

    def _runner_stats(self) -> dict:
        # Only the CUDA runner keeps graph/eager/fallback counters (runtime/cuda_runner.py).
        c = getattr(self.runner, "counters", None)
        if c is None:
            return {}
        return {
            "graph_steps": c.graph_steps,
            "eager_steps": c.eager_steps,
            "runner_fallbacks": dict(c.fallbacks),
        }

    def _hybrid_stats(self):
        # Only the CPU-pool expert backend keeps hybrid counters (models/layers/cpu_experts.py).
        stats = getattr(getattr(self.model, "expert_backend", None), "stats", None)
        return stats() if callable(stats) else None


def _all_layers_window(model_config: ModelConfig) -> int | None:
    """The sliding window when every layer has it (Mistral, Mixtral, Qwen3-MoE with windows):
    blocks behind it are released. GPT-OSS's full layers read every block, so none is."""
    layers = model_config.num_hidden_layers
    if model_config.sliding_window and len(model_config.sliding_layers) == layers:
        return model_config.sliding_window
    return None

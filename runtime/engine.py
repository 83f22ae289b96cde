"""The engine: one `step()` = schedule → execute → update, plus request bookkeeping.

Synchronous and single-threaded by contract: the async `EngineLoop` calls `step()` from one
worker thread and applies `add_request` / `abort_request` only between steps.

Overlap (on CUDA by default, `CudaRunnerOptions.overlap`): one `step()` schedules and
launches step N+1, then waits for step N and applies it, so the GPU always has the next step
queued while the host applies the last. The scheduler runs in async mode (see its module);
tokens step N+1 consumes before step N is applied are resolved on the device by the runner.
A step whose sampling reads the output history (penalties, min_tokens, logprobs) waits for
the step in flight first. `has_unfinished_requests` stays true while a step is in flight.

Failure isolation: what one request can cause inside a step fails that request alone, with
finish_reason "error" and a message (`Request.error`). A forward that raises is retried on
halves of the batch until the sequences that fail alone are found; a row the sampler could
not sample (`FAILED_ROW`: NaN logits, a per-row error) and a detokenizer error fail their
request. Only a failure no request can be blamed for (every part of the batch fails, for
`MAX_FAILED_STEPS` steps in a row, or a launched step fails when collected) leaves `step()`:
the loop treats that as a dead engine.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tandem.models.batch import KVCache
from tandem.models.config import ModelConfig
from tandem.runtime.config import EngineConfig
from tandem.runtime.detokenizer import IncrementalDetokenizer
from tandem.runtime.engine_setup import (
    load_engine_model,
    resolve_device,
    resolve_dtype,
    resolve_max_model_len,
    resolve_tokenizer,
    served_model_len,
    size_kv_cache,
)
from tandem.runtime.isolation import execute_isolated, sub_step
from tandem.runtime.model_runner import ModelRunner
from tandem.runtime.request import Request, RequestStatus
from tandem.runtime.sampling_params import SamplingParams, SamplingParamsError
from tandem.runtime.scheduler import Scheduler
from tandem.runtime.startup import release_free_heap, startup_phase
from tandem.runtime.types import (
    EngineStats,
    RequestDelta,
    SamplerOutput,
    SchedulerOutput,
    TokenLogprob,
)

if TYPE_CHECKING:
    from tandem.runtime.grammar import GrammarCompiler

log = logging.getLogger(__name__)

# Steps in a row whose forward failed for every sequence before the engine counts as broken.
MAX_FAILED_STEPS = 3


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
    result: SamplerOutput | None = None  # run synchronously instead (a failed launch's retry)


def _abort_delta(req: Request, error: str | None = None) -> RequestDelta:
    """The last delta of an aborted request (finish_reason "abort"), or of one that failed
    alone (finish_reason "error", with `error`): no new tokens."""
    return RequestDelta(
        request_id=req.request_id,
        new_token_ids=(),
        new_text="",
        finish_reason="abort" if error is None else "error",
        num_prompt_tokens=req.num_prompt_tokens,
        num_output_tokens=req.num_output_tokens,
        num_cached_tokens=req.num_cached_tokens,
        error=error,
    )


class EngineStepError(RuntimeError):
    """A failure inside a step that no request can be blamed for: the engine is broken."""


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
        if config.seed is not None:
            torch.manual_seed(config.seed)
        spec = config.model
        self.device = resolve_device(spec.device)
        self.dtype = resolve_dtype(spec.dtype, self.device)
        t0 = time.perf_counter()
        model_path: Path | None = None
        model = model_module
        self.tp_group = None
        self.fatal_error: str | None = None
        self.on_fatal: Callable[[str], None] | None = None
        if spec.tensor_parallel_size != 1:
            if model_module is not None or spec.tensor_parallel_size < 1:
                raise ValueError(
                    "tensor_parallel_size must be a positive integer and loads its own model"
                )
            from tandem.runtime.tp import TensorParallelGroup

            if self.device.type == "cuda":  # every rank runs rank 0's options
                from tandem.runtime.cuda_runner import CudaRunnerOptions

                if self.device.index is None:  # rank r drives cuda:r (runtime/tp_worker.py)
                    self.device = torch.device("cuda", 0)

                runner_options = runner_options or CudaRunnerOptions.from_env()
            self.tp_group = TensorParallelGroup(config, model_config, self.device, runner_options)
        try:
            if model is None:
                with startup_phase("model weights"):
                    model, model_config, model_path = load_engine_model(
                        spec, self.device, self.dtype, model_config
                    )
            assert model_config is not None
            self._init_after_load(config, model, model_config, model_path, tokenizer, t0,
                                  runner_options, overlap)  # fmt: skip
        except BaseException:
            if self.tp_group is not None:
                self.tp_group.abort()  # tells the workers; they exit
            raise

    def _init_after_load(
        self, config, model, model_config, model_path, tokenizer, t0, runner_options, overlap
    ) -> None:
        spec = config.model
        self.model = model
        self.model_config = model_config
        with startup_phase("tokenizer"):
            tokenizer = resolve_tokenizer(spec, model_path, model_config.vocab_size, tokenizer)
        self.tokenizer = tokenizer
        self.model_name = spec.model or "smollm2-135m-instruct"
        if model_path is not None and spec.model:
            self.model_name = Path(spec.model).name if Path(spec.model).exists() else spec.model
        log.info(
            "model loaded in %.2fs on %s (%s)", time.perf_counter() - t0, self.device, self.dtype
        )

        sched_cfg = config.scheduler
        self.max_model_len = resolve_max_model_len(sched_cfg.max_model_len, model_config)
        # The model's own length (none asked for) is capped by the KV cache instead of failing.
        fit = sched_cfg.max_model_len is None
        with startup_phase("KV cache sizing"):
            self.layout = size_kv_cache(
                config, model, model_config, self.dtype, self.device,
                config.cache.block_size if fit else self.max_model_len,
            )  # fmt: skip
        from dataclasses import replace

        if self.tp_group is not None:  # one scheduler over N caches: the smallest count
            blocks = self.tp_group.agree(True, self.layout.num_blocks)
            self.layout = replace(self.layout, num_blocks=blocks)
            self.tp_group.watch(self._on_worker_death)  # from here a worker's exit is a failure
        served = served_model_len(
            sched_cfg.max_model_len, self.max_model_len, self.layout.num_blocks,
            self.layout.block_size,
        )  # fmt: skip
        if served < self.max_model_len:
            log.warning(
                "max_model_len %d (the model's) capped at %d tokens, what the KV cache holds; "
                "give --max-model-len or more KV memory to change it",
                self.max_model_len,
                served,
            )
            self.max_model_len = served
        with startup_phase("KV cache"):
            self.kv_cache = KVCache.for_model(
                model_config, self.layout.num_blocks, self.layout.block_size, self.dtype,
                self.device, spec.tensor_parallel_size,
                num_window_blocks=self.layout.num_window_blocks,
            )  # fmt: skip
        if self.device.type == "cuda":
            from tandem.runtime.cuda_runner import CudaRunnerOptions

            runner_options = runner_options or CudaRunnerOptions.from_env()
            if overlap is None:
                overlap = runner_options.overlap
        self.overlap = bool(overlap)
        self.scheduler = Scheduler(
            replace(sched_cfg, max_model_len=self.max_model_len), config.cache,
            self.layout.num_blocks, async_mode=self.overlap,
            window=_all_layers_window(model_config),
            window_group=(
                (model_config.sliding_window, self.layout.num_window_blocks)
                if self.layout.num_window_blocks
                else None
            ),
        )  # fmt: skip
        attn_backend = getattr(model, "attn_backend", None)
        if self.device.type == "cuda":
            from tandem.runtime.cuda_runner import CudaModelRunner

            with startup_phase("CUDA runner"):
                self.runner = CudaModelRunner(
                    model, model_config, self.kv_cache, self.device, attn_backend,
                    max_num_seqs=sched_cfg.max_num_seqs,
                    max_num_batched_tokens=sched_cfg.max_num_batched_tokens,
                    max_model_len=self.max_model_len,
                    options=runner_options,
                    tp_mirror=None if self.tp_group is None else self.tp_group.mirror,
                )  # fmt: skip
        else:
            self.runner = ModelRunner(model, model_config, self.kv_cache, self.device, attn_backend)
            if self.tp_group is not None:
                self.runner.before_forward = self.tp_group.broadcast_step
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
        self._step_errors: dict[str, str] = {}  # request id -> why it failed in this step
        self._num_failed_steps = 0  # in a row, whose forward failed for every sequence
        release_free_heap()  # the loaders' freed temporaries back to the OS

    def _on_worker_death(self, reason: str) -> None:
        """A tensor-parallel worker died: this engine cannot step any more. A serving loop
        (`on_fatal`, set by runtime/loop.py) dies as on a failed step: /health 503, streams
        fail, the server exits non-zero; without one the process gets SIGTERM. During start-up
        this rank may wait in a collective with the dead one: every rank stops, exit code 1."""
        if not hasattr(self, "runner"):
            log.error("tensor-parallel start-up failed: %s; stopping every rank", reason)
            self.tp_group.close(broken=True)
            os._exit(1)
        log.error("%s; stopping", reason)
        self.fatal_error = reason
        if self.on_fatal is not None:
            self.on_fatal(reason)
        else:  # no loop to tell (offline use): end the process rather than hang in a step
            os.kill(os.getpid(), signal.SIGTERM)

    def close(self) -> None:
        """Stop the tensor-parallel workers (also done at exit)."""
        if self.tp_group is not None:
            self.tp_group.close()

    @property
    def grammar_compiler(self) -> GrammarCompiler:
        """Compiles structured-output grammars for this engine's tokenizer (thread-safe; the
        server compiles in a worker thread, so `add_request` finds the grammar cached)."""
        with self._grammar_lock:
            if self._grammar_compiler is None:
                from tandem.runtime.grammar import grammar_compiler_for

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
        group: str | None = None,
    ) -> None:
        """`group`: the client request this sequence is one of (its prompts x n), which the
        scheduler's fair share of running slots counts as one; None: a group of its own."""
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
            from tandem.runtime.grammar import GrammarError

            try:
                grammar = self.grammar_compiler.compile(params.grammar).new_matcher()
            except GrammarError as exc:
                raise SamplingParamsError("response_format", str(exc)) from None
        bad = next((t for t in params.stop_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise SamplingParamsError(
                "stop_token_ids", f"stop token id {bad} is outside the vocabulary [0, {vocab})"
            )
        if params.num_logprobs > vocab:
            raise SamplingParamsError(
                "top_logprobs", f"top_logprobs ({params.num_logprobs}) exceeds the vocabulary "
                f"size ({vocab})"
            )  # fmt: skip
        req = Request(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            params=params,
            arrival_time=time.monotonic() if arrival_time is None else arrival_time,
            priority=priority,
            eos_token_ids=self.eos_token_ids,
            grammar=grammar,
            group=group,
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
        out = self._execute(sched)
        deltas += self._fail_bad_rows(sched, out)
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
            try:
                self._in_flight = _InFlight(sched, self.runner.launch(sched))
            except Exception as exc:
                if self.tp_group is not None:  # the other ranks may be inside its collectives
                    self.tp_group.close(broken=True)
                    raise EngineStepError(
                        f"a tensor-parallel forward failed ({type(exc).__name__}); all ranks "
                        "stopped"
                    ) from exc
                # Collect the step in flight, then run this one synchronously, isolating
                # whichever of its sequences fail.
                log.warning("launching a step failed; retrying it without overlap", exc_info=True)
                if prev is not None:
                    deltas += self._apply(prev)
                    prev = None
                live = tuple(s for s in sched.seqs if not s.request.is_finished)
                if live:
                    sched = sub_step(live)
                    self._in_flight = _InFlight(sched, None, self._execute(sched))
        if prev is not None:
            deltas += self._apply(prev)
        return deltas

    # -- failure isolation ----------------------------------------------------------------------

    def _execute(self, sched: SchedulerOutput) -> SamplerOutput:
        """`runner.execute`, isolating the sequences that fail alone (runtime/isolation.py);
        raises once every sequence has failed on MAX_FAILED_STEPS steps in a row. Under tensor
        parallel a failed forward is the engine's failure: the other ranks may be waiting in
        one of its collectives, where a retry's broadcast would desynchronise them."""
        if self.tp_group is not None:
            try:
                return self.runner.execute(sched)
            except Exception as exc:
                self.tp_group.close(broken=True)
                raise EngineStepError(
                    f"a tensor-parallel forward failed ({type(exc).__name__}); all ranks stopped"
                ) from exc
        out, num_ok = execute_isolated(self.runner.execute, sched, self._step_errors)
        if num_ok:
            self._num_failed_steps = 0
            return out
        self._num_failed_steps += 1
        if self._num_failed_steps >= MAX_FAILED_STEPS:
            raise EngineStepError(
                f"the forward failed for every sequence on {MAX_FAILED_STEPS} steps in a row"
            )
        return out

    def _fail_bad_rows(self, sched: SchedulerOutput, out: SamplerOutput) -> list[RequestDelta]:
        """Fail, before `scheduler.update`, each request of `sched` that failed alone in it:
        its forward raised (`_step_errors`) or its row could not be sampled."""
        deltas: list[RequestDelta] = []
        errors, self._step_errors = self._step_errors, {}
        vocab = self.model_config.vocab_size
        token_ids = iter(out.token_ids)
        for s in sched.seqs:
            rid = s.request.request_id
            token_id = next(token_ids) if s.sample else 0
            if rid in errors:
                error = errors[rid]
            elif not 0 <= token_id < vocab:
                error = "the model produced non-finite logits for this request"
                log.error("request %s: sampled token %d (non-finite logits?)", rid, token_id)
            else:
                continue
            delta = self._fail_request(s.request, error)
            if delta is not None:
                deltas.append(delta)
        return deltas

    def _fail_request(self, req: Request, error: str) -> RequestDelta | None:
        """End one request with finish_reason "error"; the others carry on."""
        rid = req.request_id
        tracked = self._tracked.pop(rid, None)
        if not req.is_finished:
            self.scheduler.finish_request(rid, RequestStatus.FINISHED_ERROR)
        req.error = error
        self.runner.release(rid)
        return None if tracked is None else _abort_delta(req, error)

    def _apply(self, step: _InFlight) -> list[RequestDelta]:
        out = step.result if step.result is not None else self.runner.finish(step.handle)
        failed = self._fail_bad_rows(step.sched, out)
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
        deltas = failed
        for req, ok in zip(sampled, taken, strict=True):
            if not ok and not req.is_finished:
                continue
            delta = self._safe_delta(req)
            if delta is not None:
                deltas.append(delta)
        return deltas

    def _safe_delta(self, req: Request) -> RequestDelta | None:
        """`_make_delta`, but a failure of one request's own post-processing (detokenizer, stop
        strings) fails that request alone instead of raising out of step(), which the loop
        treats as a dead engine."""
        try:
            return self._make_delta(req)
        except Exception as exc:
            log.exception("request %s failed after its step", req.request_id)
            return self._fail_request(
                req, f"this request failed while detokenizing its output ({type(exc).__name__})"
            )

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
    blocks behind it are released. GPT-OSS's windowed layers have a pool of their own instead
    (`window_group`), released the same way; its full layers read every block."""
    layers = model_config.num_hidden_layers
    if model_config.sliding_window and len(model_config.sliding_layers) == layers:
        return model_config.sliding_window
    return None

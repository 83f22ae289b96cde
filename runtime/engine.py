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
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from models.batch import KVCache
from runtime.config import CacheLayout, EngineConfig
from runtime.detokenizer import IncrementalDetokenizer
from runtime.model_runner import ModelRunner
from runtime.request import Request, RequestStatus
from runtime.sampling_params import SamplingParams, SamplingParamsError
from runtime.scheduler import Scheduler
from runtime.types import EngineStats, RequestDelta, SamplerOutput, SchedulerOutput, TokenLogprob

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DEFAULT_CPU_KV_BYTES = 1 << 30


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def cpu_has_fast_bf16() -> bool:
    """AVX-512 BF16 or AMX: bf16 matmuls run at least as fast as fp32 on half the bytes."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " avx512_bf16" in flags or " amx_bf16" in flags


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        # Decode is memory-bound: bf16 halves the bytes read per token. On a CPU without
        # native bf16 dot products the conversions cost more than they save, so keep fp32.
        if device.type == "cuda" or cpu_has_fast_bf16():
            return torch.bfloat16
        return torch.float32
    if name not in _DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; choose one of {', '.join(_DTYPES)}")
    return _DTYPES[name]


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
        from models.loader import load_model

        self.config = config
        spec = config.model
        self.device = resolve_device(spec.device)
        self.dtype = resolve_dtype(spec.dtype, self.device)
        t0 = time.perf_counter()
        model_path: Path | None = None
        model = model_module
        if model is None:
            from models.hub import resolve_model

            if spec.load_format == "dummy" and model_config is not None:
                model_path = None
            else:
                model_path = resolve_model(spec.model)
            attn = spec.attention_backend
            if attn == "auto":
                attn = _auto_attention_backend(self.device, self.dtype, model_config, model_path)
            experts = spec.expert_backend if spec.expert_backend != "auto" else "torch"
            if spec.expert_backend == "auto" and spec.cpu_experts is not None:
                experts = "cpu_pool"
            expert_options = None
            if experts == "cpu_pool":
                expert_options = {"fmt": spec.cpu_expert_format, "num_threads": spec.cpu_threads,
                                  "cpu_experts": spec.cpu_experts or "all",
                                  "gpu_experts": spec.gpu_experts}
            model, model_config = load_model(
                model_path,
                dtype=self.dtype,
                device=self.device,
                load_format=spec.load_format,
                attn_backend=attn,
                expert_backend=experts,
                seed=spec.seed,
                config=model_config,
                expert_options=expert_options,
            )
        assert model_config is not None
        self.model = model
        self.model_config = model_config
        if tokenizer is None and model_path is not None:
            tokenizer = _load_tokenizer(model_path)
        self.tokenizer = tokenizer
        self.model_name = spec.model or "smollm2-135m-instruct"
        if model_path is not None and spec.model:
            self.model_name = Path(spec.model).name if Path(spec.model).exists() else spec.model
        log.info("model loaded in %.2fs on %s (%s)", time.perf_counter() - t0, self.device, self.dtype)

        sched_cfg = config.scheduler
        self.max_model_len = min(sched_cfg.max_model_len, model_config.max_position_embeddings)
        self.layout = self._size_kv_cache()
        self.kv_cache = KVCache.allocate(
            model_config.num_hidden_layers,
            self.layout.num_blocks,
            self.layout.block_size,
            model_config.num_key_value_heads,
            model_config.head_dim,
            self.dtype,
            self.device,
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

    # -- sizing -------------------------------------------------------------------------------

    def _size_kv_cache(self) -> CacheLayout:
        cfg, mc = self.config.cache, self.model_config
        per_block = KVCache.bytes_per_block(
            mc.num_hidden_layers, cfg.block_size, mc.num_key_value_heads, mc.head_dim, self.dtype
        )
        min_blocks = -(-self.max_model_len // cfg.block_size) + 1
        if cfg.num_blocks is not None:
            num_blocks = cfg.num_blocks
        elif self.device.type == "cuda":
            reserve = self._profile_activation_bytes()
            free, total = torch.cuda.mem_get_info(self.device)
            used = total - free
            budget = int(total * cfg.gpu_memory_utilization) - used - reserve
            num_blocks = max(budget // per_block, 0)
        else:
            budget = cfg.cpu_kv_bytes or _DEFAULT_CPU_KV_BYTES
            num_blocks = max(budget // per_block, 2 * min_blocks)
        if num_blocks < min_blocks:
            raise ValueError(
                f"KV cache too small: {num_blocks} blocks of {cfg.block_size} tokens cannot hold "
                f"one sequence of max_model_len={self.max_model_len}; lower --max-model-len or "
                f"raise the KV budget"
            )
        log.info("KV cache: %d blocks x %d tokens (%.1f MiB)", num_blocks, cfg.block_size,
                 num_blocks * per_block / 2**20)
        return CacheLayout(num_blocks=int(num_blocks), block_size=cfg.block_size, bytes_per_block=per_block)

    def _profile_activation_bytes(self) -> int:
        from runtime.cuda_runner import profile_activation_bytes

        sc = self.config.scheduler
        try:
            reserve = profile_activation_bytes(
                self.model, self.model_config, self.dtype, self.device,
                sc.max_num_batched_tokens, sc.max_num_seqs, self.config.cache.block_size,
            )  # fmt: skip
        except torch.OutOfMemoryError:
            raise
        except Exception:  # a model the profile cannot drive: keep the coarse bound, loudly
            log.exception("activation profiling failed; reserving a coarse bound instead")
            return _activation_reserve(self.model_config)
        log.info("profiled peak activation + graph reserve: %.0f MiB", reserve / 2**20)
        return reserve

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
            raise SamplingParamsError("prompt", f"token id {bad} is outside the vocabulary [0, {vocab})")
        req = Request(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            params=params,
            arrival_time=time.monotonic() if arrival_time is None else arrival_time,
            priority=priority,
            eos_token_ids=self.eos_token_ids,
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
        req = tracked.request
        self._aborted.append(
            RequestDelta(
                request_id=request_id,
                new_token_ids=(),
                new_text="",
                finish_reason="abort",
                num_prompt_tokens=req.num_prompt_tokens,
                num_output_tokens=req.num_output_tokens,
                num_cached_tokens=req.num_cached_tokens,
            )
        )

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
            delta = self._make_delta(req)
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
            delta = self._make_delta(req)
            if delta is not None:
                deltas.append(delta)
        return deltas

    def _make_delta(self, req: Request) -> RequestDelta | None:
        tracked = self._tracked.get(req.request_id)
        if tracked is None:
            return None
        new_ids = req.output_token_ids[tracked.sent_tokens :]
        text = ""
        if tracked.detok is not None:
            text = tracked.detok.add_tokens(new_ids)
            if tracked.detok.stop_matched is not None and not req.is_finished:
                req.stop_reason = tracked.detok.stop_matched
                self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_STOPPED)
            if req.is_finished:
                text += tracked.detok.flush()
        tracked.sent_tokens = req.num_output_tokens
        logprobs, tracked.pending_logprobs = tuple(tracked.pending_logprobs), []
        finish = req.status.finish_reason
        if finish is not None:
            del self._tracked[req.request_id]
            self.runner.release(req.request_id)
        return RequestDelta(
            request_id=req.request_id,
            new_token_ids=tuple(new_ids),
            new_text=text,
            finish_reason=finish,
            stop_reason=req.stop_reason,
            logprobs=logprobs,
            num_prompt_tokens=req.num_prompt_tokens,
            num_output_tokens=req.num_output_tokens,
            num_cached_tokens=req.num_cached_tokens,
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
        )

    def _hybrid_stats(self):
        # Only the CPU-pool expert backend keeps hybrid counters (models/layers/cpu_experts.py).
        stats = getattr(getattr(self.model, "expert_backend", None), "stats", None)
        return stats() if callable(stats) else None


def _activation_reserve(mc) -> int:
    # A coarse bound until the runner profiles a real peak: logits of a full token budget plus
    # a few hidden-sized buffers per token.
    return 2 * 1024**3


def _auto_attention_backend(device, dtype, model_config, model_path) -> str:
    """"cupy" on CUDA where its kernels serve this head_dim and dtype, else "torch"."""
    if device.type != "cuda":
        return "torch"
    from models.cupy_backend import cupy_backend_supports

    mc = model_config
    if mc is None and model_path is not None and Path(model_path).is_dir():
        from models.config import ModelConfig

        try:
            mc = ModelConfig.from_pretrained(model_path)
        except Exception:  # the loader reports a bad config with a better error
            mc = None
    head_dim = mc.head_dim if mc is not None else 128
    return "cupy" if cupy_backend_supports(head_dim, dtype, device) else "torch"


def _load_tokenizer(model_path: Path):
    from models.tokenizer import Tokenizer

    if model_path.suffix == ".gguf":
        return Tokenizer.from_gguf(model_path)
    if (model_path / "tokenizer.json").exists() or (model_path / "tokenizer_config.json").exists():
        return Tokenizer.from_pretrained(model_path)
    log.warning("no tokenizer found in %s: token ids only", model_path)
    return None

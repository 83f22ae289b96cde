"""The offline API: `LLM(model).generate(prompts, params)` and `LLM.chat(messages, params)`.

Runs the engine to completion in the calling thread; no event loop involved.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence

from tandem.runtime.config import CacheConfig, EngineConfig, ModelSpec, SchedulerConfig
from tandem.runtime.engine import Engine
from tandem.runtime.sampling_params import SamplingParams, expand_n
from tandem.runtime.types import CompletionOutput, RequestDelta, RequestOutput

Messages = list[dict]
_SPEC_FIELDS = frozenset(f.name for f in dataclasses.fields(ModelSpec))


class LLM:
    def __init__(
        self,
        model: str | None = None,
        *,
        dtype: str = "auto",
        device: str = "auto",
        load_format: str = "auto",
        max_model_len: int | None = None,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        block_size: int = 16,
        num_kv_blocks: int | None = None,
        enable_prefix_caching: bool = True,
        engine_config: EngineConfig | None = None,
        **engine_kwargs,
    ) -> None:
        """Keyword arguments that name a `ModelSpec` field (cpu_experts="all", gpu_experts,
        cpu_threads, cpu_expert_format, cpu_expert_group_size, gpu_prefill, seed, ...) go to
        the model spec, as the CLI's options do; the rest to `Engine`. `max_model_len`
        None: the model's own, capped by what the KV cache holds."""
        spec_kwargs = {k: engine_kwargs.pop(k) for k in list(engine_kwargs) if k in _SPEC_FIELDS}
        if engine_config is None:
            engine_config = EngineConfig(
                model=ModelSpec(
                    model=model,
                    dtype=dtype,
                    device=device,
                    load_format=load_format,
                    **spec_kwargs,
                ),
                cache=CacheConfig(
                    block_size=block_size,
                    num_blocks=num_kv_blocks,
                    enable_prefix_caching=enable_prefix_caching,
                ),
                scheduler=SchedulerConfig(
                    max_num_seqs=max_num_seqs,
                    max_model_len=max_model_len,
                    max_num_batched_tokens=max_num_batched_tokens,
                ),
            )
        elif spec_kwargs:
            raise ValueError(f"{sorted(spec_kwargs)}: pass them in engine_config.model instead")
        self.engine = Engine(engine_config, **engine_kwargs)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[Sequence[int]],
        params: SamplingParams | None = None,
        on_delta: Callable[[RequestDelta], None] | None = None,
    ) -> list[RequestOutput]:
        """Complete every prompt (strings, or lists of token ids); outputs keep the input order."""
        params = params or SamplingParams()
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        outputs: list[RequestOutput] = []
        children: dict[str, tuple[RequestOutput, CompletionOutput]] = {}
        for prompt in prompts:
            if isinstance(prompt, str):
                if self.tokenizer is None:
                    raise ValueError("this model has no tokenizer: pass token ids")
                ids = self.tokenizer.encode(prompt, add_special_tokens=True)
                text = prompt
            else:
                ids, text = list(prompt), None
            ro = RequestOutput(request_id=str(next(self._ids)), prompt=text, prompt_token_ids=ids)
            for i, child in enumerate(expand_n(params)):
                co = CompletionOutput(
                    index=i,
                    text="",
                    token_ids=[],
                    finish_reason=None,
                    logprobs=[] if child.logprobs else None,
                )
                ro.outputs.append(co)
                child_id = f"{ro.request_id}-{i}"
                children[child_id] = (ro, co)
                self.engine.add_request(child_id, ids, child)
            outputs.append(ro)
        try:
            while self.engine.has_unfinished_requests():
                for d in self.engine.step():
                    _, co = children[d.request_id]
                    co.text += d.new_text
                    co.token_ids.extend(d.new_token_ids)
                    if co.logprobs is not None:
                        co.logprobs.extend(d.logprobs)
                    if d.finished:
                        co.finish_reason, co.stop_reason = d.finish_reason, d.stop_reason
                    if on_delta is not None:
                        on_delta(d)
        except BaseException:
            for child_id in children:
                self.engine.abort_request(child_id)
            self.engine.step()
            raise
        return outputs

    def chat(
        self,
        messages: Messages | Sequence[Messages],
        params: SamplingParams | None = None,
        on_delta: Callable[[RequestDelta], None] | None = None,
    ) -> list[RequestOutput]:
        """One conversation (a list of {role, content}) or several; the chat template applies."""
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: chat needs one")
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [
            self.tokenizer.encode(
                self.tokenizer.apply_chat_template(conv, add_generation_prompt=True),
                add_special_tokens=False,
            )
            for conv in convs
        ]
        return self.generate(prompts, params, on_delta=on_delta)


__all__ = ["LLM", "SamplingParams"]

"""One chat or completions request from body to OpenAI chunks, shared by REST, SSE and WebSocket.

`start_generation` validates, tokenizes and submits (mapping loop refusals to HTTP errors);
`Generation.chunks()` turns the request's stream into OpenAI chunk dicts; `collect()` builds
the non-streamed response. `close()` must run when the reader stops: it aborts an unfinished
request.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

from tandem.app.chat_output import ChatOutput
from tandem.app.errors import APIError
from tandem.app.protocol import GenerationRequest, Kind, parse_generation
from tandem.app.responses import (
    ChoiceState,
    ResponseMeta,
    chat_logprobs,
    chunk,
    completion_logprobs,
    full_response,
    usage_chunk,
    usage_dict,
)
from tandem.app.state import PARSE_OFF_LOOP_BYTES, ServerState
from tandem.runtime.grammar import GrammarError
from tandem.runtime.loop import EngineDeadError, LoopClosedError, QueueFullError
from tandem.runtime.sampling_params import SamplingParamsError
from tandem.runtime.stream import ChoiceDelta, RequestStream
from tandem.runtime.types import RequestDelta

logger = logging.getLogger(__name__)
RETRY_AFTER_S = 1  # what a 429 (queue full) tells the client to wait before retrying


def check_admitting(state: ServerState) -> None:
    loop = state.engine_loop
    if loop.dead:
        raise APIError(503, "The engine has failed; the server cannot generate", code="engine_dead")
    if loop.draining:
        raise APIError(503, "The server is shutting down", code="server_draining")


async def start_generation(
    state: ServerState, kind: Kind, body: dict[str, Any], body_bytes: int = 0
) -> Generation:
    """`body_bytes`: the size of the raw body; a large one is validated and tokenized (chat
    template included) on one of PARSE_THREADS worker threads, so the event loop
    keeps serving the streams in flight meanwhile."""
    check_admitting(state)
    loop = state.engine_loop
    args = (
        kind,
        body,
        loop.tokenizer,
        loop.max_model_len,
        state.model_names,
        state.config.max_tokens_default,
    )
    if body_bytes < PARSE_OFF_LOOP_BYTES:
        req = parse_generation(*args)
    else:
        req = await asyncio.get_running_loop().run_in_executor(
            state.parse_pool, parse_generation, *args
        )
        check_admitting(state)
    request_id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
    if req.params.grammar is not None:
        try:
            await loop.compile_grammar(req.params.grammar)
        except GrammarError as exc:
            raise APIError(
                400, f"unsupported or invalid output constraint: {exc}", param=req.grammar_param,
                code="invalid_value",
            ) from None  # fmt: skip
    try:
        stream = await loop.submit(request_id, req.prompts, req.params, req.priority)
    except QueueFullError as exc:
        raise APIError(
            429, str(exc), code="queue_full", headers={"Retry-After": str(RETRY_AFTER_S)}
        ) from None
    except (LoopClosedError, EngineDeadError):
        check_admitting(state)
        raise
    except SamplingParamsError as exc:
        raise APIError(400, str(exc), param=exc.param, code="invalid_value") from None
    except ValueError as exc:  # e.g. the engine's RequestTooLongError
        raise APIError(400, str(exc), code="invalid_request") from None
    meta = ResponseMeta(request_id, int(time.time()), state.model_name, kind)
    return Generation(state, req, stream, meta)


class Generation:
    """A submitted request: iterate `chunks()` (streaming) or await `collect()`."""

    def __init__(
        self,
        state: ServerState,
        request: GenerationRequest,
        stream: RequestStream,
        meta: ResponseMeta,
    ) -> None:
        self.request = request
        self.stream = stream
        self.meta = meta
        self._token_text = state.token_text
        self.choices = [ChoiceState(i) for i in range(stream.num_choices)]
        opts = request.chat_output
        self.shapers = (
            [ChatOutput(opts) for _ in self.choices]
            if request.kind == "chat" and opts.active
            else None
        )

    @property
    def id(self) -> str:
        return self.meta.id

    def usage(self) -> dict[str, Any]:
        return usage_dict(
            sum(self.stream.prompt_lens),
            sum(len(c.token_ids) for c in self.choices),
            self.cached_tokens(),
        )

    def cached_tokens(self) -> int:
        """Prompt tokens served from the prefix cache: per prompt, the most any of its n
        samples reused (each prompt is counted once in prompt_tokens, so is its cache hit)."""
        n = self.stream.n
        return sum(
            min(length, max(c.cached_tokens for c in self.choices[p * n : (p + 1) * n]))
            for p, length in enumerate(self.stream.prompt_lens)
        )

    def usage_chunk(self) -> dict[str, Any]:
        return usage_chunk(self.meta, self.usage())

    def close(self) -> None:
        if not self.stream.finished:
            logger.info("request %s: its reader is gone before the end; aborting it", self.id)
        self.stream.close()

    def _absorb(self, c: ChoiceState, d: RequestDelta) -> None:
        if d.finish_reason == "error":  # this request alone failed in the engine
            raise APIError(
                500, d.error or "this request failed in the engine", code="request_failed"
            )
        c.text += d.new_text
        c.token_ids.extend(d.new_token_ids)
        c.logprobs.extend(d.logprobs)
        c.cached_tokens = max(c.cached_tokens, d.num_cached_tokens)
        if d.finish_reason:
            c.finish_reason = d.finish_reason

    async def collect(self) -> dict[str, Any]:
        async for batch in self.stream:
            for cd in batch:
                c = self.choices[cd.index]
                self._absorb(c, cd.delta)
                if self.shapers is not None:
                    shaper = self.shapers[cd.index]
                    shaper.feed(cd.delta.new_text, last=cd.delta.finished)
                    if cd.delta.finished:
                        _, c.finish_reason = shaper.finish(c.finish_reason)
                        c.message = shaper.message()
        return full_response(
            self.meta, self.choices, self.usage(), self._token_text, self.request.params.logprobs
        )

    async def chunks(self) -> AsyncIterator[dict[str, Any]]:
        """OpenAI stream chunks, one choice per chunk, in engine order. Not the usage chunk."""
        async for batch in self.chunk_batches():
            for c in batch:
                yield c

    async def chunk_batches(self) -> AsyncIterator[list[dict[str, Any]]]:
        """`chunks()` grouped by what the stream delivered at once, so that a writer sends
        them in one write; empty batches are skipped."""
        async for batch in self.stream:
            out: list[dict[str, Any]] = []
            try:
                out.extend(self._batch_chunks(batch))
            except Exception:  # what came before a failing choice still goes out first
                if out:
                    yield out
                raise
            if out:
                yield out

    def _batch_chunks(self, batch: list[ChoiceDelta]) -> Iterator[dict[str, Any]]:
        usage = self.request.include_usage
        want_lp = self.request.params.logprobs
        for cd in batch:
            c, d = self.choices[cd.index], cd.delta
            self._absorb(c, d)
            if self.meta.kind == "chat":
                if not c.role_sent:
                    c.role_sent = True
                    yield chunk(
                        self.meta,
                        {
                            "index": c.index,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        },
                        usage,
                    )
                if self.shapers is not None:
                    shaper = self.shapers[c.index]
                    deltas = shaper.feed(d.new_text, last=d.finished)
                    finish = d.finish_reason
                    if d.finished:
                        more, finish = shaper.finish(d.finish_reason)
                        deltas += more
                        c.finish_reason = finish
                    lp = chat_logprobs(d.logprobs, self._token_text) if want_lp else None
                    if lp is not None and not deltas:
                        deltas = [{"content": ""}]
                    for delta in deltas:
                        yield chunk(
                            self.meta,
                            {"index": c.index, "delta": delta, "logprobs": lp,
                             "finish_reason": None},
                            usage,
                        )  # fmt: skip
                        lp = None
                    if d.finished:
                        yield chunk(
                            self.meta,
                            {"index": c.index, "delta": {}, "logprobs": None,
                             "finish_reason": finish},
                            usage,
                        )  # fmt: skip
                    continue
                if d.new_text or (want_lp and d.logprobs):
                    lp = chat_logprobs(d.logprobs, self._token_text) if want_lp else None
                    yield chunk(
                        self.meta,
                        {
                            "index": c.index,
                            "delta": {"content": d.new_text},
                            "logprobs": lp,
                            "finish_reason": None,
                        },
                        usage,
                    )
                if d.finished:
                    yield chunk(
                        self.meta,
                        {
                            "index": c.index,
                            "delta": {},
                            "logprobs": None,
                            "finish_reason": d.finish_reason,
                        },
                        usage,
                    )
            elif d.new_text or d.finished or (want_lp and d.logprobs):
                lp = None
                if want_lp:
                    lp, c.text_offset = completion_logprobs(
                        d.logprobs, self._token_text, c.text_offset
                    )
                yield chunk(
                    self.meta,
                    {
                        "index": c.index,
                        "text": d.new_text,
                        "logprobs": lp,
                        "finish_reason": d.finish_reason,
                    },
                    usage,
                )

"""A deterministic fake of `runtime.engine.Engine` for server and loop tests.

Implements exactly the engine contract the loop drives: a character-level tokenizer over
printable ASCII, one token per running request per step, stop strings removed from the text,
finish reasons stop/length, and a record of every abort. It asserts the loop's threading rule:
`add_request`/`abort_request` are never called while `step()` is in flight.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field

from tandem.runtime.sampling_params import SamplingParams, SamplingParamsError
from tandem.runtime.types import EngineStats, RequestDelta, TokenLogprob

EOS_ID = 0
BOS_ID = 1
SPECIAL = {EOS_ID: "<|eos|>", BOS_ID: "<|bos|>"}
REPLY = "hello world, this is tandem speaking. "


class FakeTokenizer:
    """Token id == ord(char) for printable ASCII; 0 and 1 are special."""

    vocab_size = 128
    eos_token_ids = (EOS_ID,)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids = [ord(c) if 32 <= ord(c) < 127 else ord("?") for c in text]
        return ([BOS_ID] if add_special_tokens else []) + ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        out = []
        for i in ids:
            if i in SPECIAL:
                if not skip_special_tokens:
                    out.append(SPECIAL[i])
            else:
                out.append(chr(i))
        return "".join(out)

    def id_to_token(self, i: int) -> str:
        return SPECIAL.get(i, chr(i))

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


class RequestTooLongError(ValueError):
    pass


@dataclass
class _Req:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    output: list[int] = field(default_factory=list)
    text: str = ""
    emitted_len: int = 0


class FakeEngine:
    """One token per running request per step; the reply text cycles REPLY from an offset.

    The offset is the seed (if any) so n>1 choices with a seed differ. `eos_after` makes a
    request emit EOS after that many tokens (finish 'stop'), unless ignore_eos.
    """

    def __init__(
        self,
        *,
        max_model_len: int = 256,
        max_num_seqs: int = 8,
        step_delay: float = 0.0,
        eos_after: int | None = None,
        num_blocks: int = 64,
    ) -> None:
        self.tokenizer = FakeTokenizer()
        self.model_name = "fake-model"
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.step_delay = step_delay
        self.eos_after = eos_after
        self.num_blocks = num_blocks
        self.fail_next_step: Exception | None = None
        self.gate: threading.Event | None = None  # when set by a test, step() waits on it
        self.waiting: list[_Req] = []
        self.running: list[_Req] = []
        self.added: list[str] = []
        self.aborted: list[str] = []
        self.num_steps = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self._in_step = False

    # ---- contract -----------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        *,
        group: str | None = None,
    ) -> None:
        assert not self._in_step, "add_request called during step()"
        if params.n != 1:
            raise SamplingParamsError("n", "the engine takes n == 1; expand_n first")
        if not prompt_token_ids:
            raise ValueError("prompt is empty")
        need = len(prompt_token_ids) + (params.max_tokens or 0)
        if need > self.max_model_len or len(prompt_token_ids) >= self.max_model_len:
            raise RequestTooLongError(
                f"prompt ({len(prompt_token_ids)} tokens) + max_tokens ({params.max_tokens}) "
                f"exceeds max_model_len ({self.max_model_len})"
            )
        self.added.append(request_id)
        self.waiting.append(_Req(request_id, list(prompt_token_ids), params))

    def abort_request(self, request_id: str) -> None:
        assert not self._in_step, "abort_request called during step()"
        for queue in (self.waiting, self.running):
            for r in queue:
                if r.request_id == request_id:
                    queue.remove(r)
                    self.aborted.append(request_id)
                    return

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def stats(self) -> EngineStats:
        used = sum(1 + (len(r.prompt) + len(r.output)) // 16 for r in self.running)
        return EngineStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_blocks=self.num_blocks,
            num_free_blocks=max(0, self.num_blocks - used),
            kv_cache_usage=min(1.0, used / self.num_blocks),
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
            num_steps=self.num_steps,
        )

    def step(self) -> list[RequestDelta]:
        self._in_step = True
        try:
            if self.gate is not None:
                self.gate.wait(timeout=10)
            if self.step_delay:
                time.sleep(self.step_delay)
            if self.fail_next_step is not None:
                exc, self.fail_next_step = self.fail_next_step, None
                raise exc
            while self.waiting and len(self.running) < self.max_num_seqs:
                r = self.waiting.pop(0)
                self.prompt_tokens_total += len(r.prompt)
                self.running.append(r)
            self.num_steps += 1
            return [self._advance(r) for r in list(self.running)]
        finally:
            self._in_step = False

    # ---- generation ---------------------------------------------------------------------
    def _advance(self, r: _Req) -> RequestDelta:
        p = r.params
        k = len(r.output)
        offset = (p.seed or 0) % len(REPLY)
        if (
            self.eos_after is not None
            and k >= self.eos_after
            and not p.ignore_eos
            and k >= p.min_tokens
        ):
            token = EOS_ID
        else:
            token = ord(REPLY[(offset + k) % len(REPLY)])
        r.output.append(token)
        self.generation_tokens_total += 1
        finish: str | None = None
        stop_reason: int | str | None = None
        if token == EOS_ID:
            finish, stop_reason = "stop", EOS_ID
        else:
            r.text += chr(token)
        for s in p.stop:
            pos = r.text.find(s, max(0, r.emitted_len - len(s)))
            if pos >= 0 and len(r.output) >= p.min_tokens:
                r.text = r.text[:pos]
                finish, stop_reason = "stop", s
                break
        if finish is None and p.max_tokens is not None and len(r.output) >= p.max_tokens:
            finish = "length"
        # Hold back text that could be the start of a stop string, like a real detokenizer.
        hold = 0 if finish else max((len(s) - 1 for s in p.stop), default=0)
        visible = max(r.emitted_len, len(r.text) - hold)
        new_text = r.text[r.emitted_len : visible]
        r.emitted_len = visible
        logprobs: tuple[TokenLogprob, ...] = ()
        if p.logprobs:
            others = [t for t in range(97, 97 + 26) if t != token]
            top = tuple((t, math.log(0.5) - i) for i, t in enumerate([token] + others))
            logprobs = (TokenLogprob(token, math.log(0.5), top[: p.top_logprobs]),)
        if finish is not None:
            self.running.remove(r)
        return RequestDelta(
            r.request_id,
            (token,),
            new_text,
            finish,
            stop_reason,
            logprobs,
            num_prompt_tokens=len(r.prompt),
            num_output_tokens=len(r.output),
        )

"""Per-request sampling parameters and their validation.

Invalid values raise `SamplingParamsError` naming the parameter; the server maps that to an
OpenAI-shaped 400 with `param` set.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.runtime.limits import (
    MAX_LOGIT_BIAS,
    MAX_N,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TOP_LOGPROBS,
)

GRAMMAR_KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")


@dataclass(frozen=True)
class GrammarSpec:
    """A constraint on the output: `kind` one of GRAMMAR_KINDS; `text` the JSON schema (JSON),
    the regex, the JSON list of choices or the EBNF/Lark grammar ("" for json_object)."""

    kind: str
    text: str = ""

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise SamplingParamsError("structured", f"unknown grammar kind {self.kind!r}")
        if not isinstance(self.text, str):
            raise SamplingParamsError("structured", "a grammar's text must be a string")


class SamplingParamsError(ValueError):
    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    n: int = 1
    logprobs: bool = False
    top_logprobs: int = 0
    skip_special_tokens: bool = True
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100])
    grammar: GrammarSpec | None = None
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        # Normalise containers so params are hashable and a lone string is one stop string.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif self.stop is None:
            object.__setattr__(self, "stop", ())
        elif isinstance(self.stop, (list, tuple)):
            object.__setattr__(self, "stop", tuple(self.stop))
        else:
            raise SamplingParamsError("stop", "stop must be a string or a list of strings")
        if self.stop_token_ids is None:
            object.__setattr__(self, "stop_token_ids", ())
        elif isinstance(self.stop_token_ids, (list, tuple)):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        else:
            raise SamplingParamsError(
                "stop_token_ids", "stop_token_ids must be a list of token ids"
            )
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        if isinstance(self.logit_bias, dict):
            object.__setattr__(self, "logit_bias", tuple(self.logit_bias.items()))
        elif isinstance(self.logit_bias, list):
            object.__setattr__(self, "logit_bias", tuple(tuple(x) for x in self.logit_bias))
        self.validate()

    def validate(self) -> None:
        def need(ok: bool, param: str, message: str) -> None:
            if not ok:
                raise SamplingParamsError(param, message)

        def is_int(x: object) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

        def is_num(x: object) -> bool:
            return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x  # not NaN

        need(
            self.max_tokens is None or (is_int(self.max_tokens) and self.max_tokens >= 1),
            "max_tokens",
            f"max_tokens must be an integer >= 1, got {self.max_tokens!r}",
        )
        need(
            is_int(self.min_tokens) and self.min_tokens >= 0,
            "min_tokens",
            f"min_tokens must be an integer >= 0, got {self.min_tokens!r}",
        )
        if self.max_tokens is not None and is_int(self.min_tokens):
            need(
                self.min_tokens <= self.max_tokens,
                "min_tokens",
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
            )
        need(
            is_num(self.temperature) and 0.0 <= self.temperature <= 100.0,
            "temperature",
            f"temperature must be in [0, 100], got {self.temperature!r}",
        )
        need(
            is_num(self.top_p) and 0.0 < self.top_p <= 1.0,
            "top_p",
            f"top_p must be in (0, 1], got {self.top_p!r}",
        )
        need(
            is_int(self.top_k) and self.top_k >= 0,
            "top_k",
            f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}",
        )
        need(
            is_num(self.min_p) and 0.0 <= self.min_p <= 1.0,
            "min_p",
            f"min_p must be in [0, 1], got {self.min_p!r}",
        )
        need(
            is_num(self.presence_penalty) and -2.0 <= self.presence_penalty <= 2.0,
            "presence_penalty",
            f"presence_penalty must be in [-2, 2], got {self.presence_penalty!r}",
        )
        need(
            is_num(self.frequency_penalty) and -2.0 <= self.frequency_penalty <= 2.0,
            "frequency_penalty",
            f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty!r}",
        )
        need(
            # from 1e-6: smaller ones become 0 in float32 and divide the logits by zero
            is_num(self.repetition_penalty) and 1e-6 <= self.repetition_penalty <= 10.0,
            "repetition_penalty",
            f"repetition_penalty must be in [1e-6, 10], got {self.repetition_penalty!r}",
        )
        need(
            self.seed is None or (is_int(self.seed) and -(2**63) <= self.seed < 2**64),
            "seed",
            f"seed must be an integer, got {self.seed!r}",
        )
        need(
            all(isinstance(s, str) and s != "" for s in self.stop),
            "stop",
            "stop must be a non-empty string or a list of non-empty strings",
        )
        need(
            len(self.stop) <= MAX_STOP_STRINGS,
            "stop",
            f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(self.stop)}",
        )
        need(
            sum(len(s) for s in self.stop) <= MAX_STOP_CHARS,
            "stop",
            f"the stop strings may hold at most {MAX_STOP_CHARS} characters in all, got "
            f"{sum(len(s) for s in self.stop)}",
        )
        need(
            len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS,
            "stop_token_ids",
            f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids are allowed, got "
            f"{len(self.stop_token_ids)}",
        )
        need(
            all(is_int(t) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            "stop_token_ids must be non-negative integers",
        )
        need(isinstance(self.ignore_eos, bool), "ignore_eos", "ignore_eos must be a boolean")
        need(
            isinstance(self.skip_special_tokens, bool),
            "skip_special_tokens",
            "skip_special_tokens must be a boolean",
        )
        need(
            is_int(self.n) and 1 <= self.n <= MAX_N,
            "n",
            f"n must be an integer in [1, {MAX_N}], got {self.n!r}",
        )
        need(isinstance(self.logprobs, bool), "logprobs", "logprobs must be a boolean")
        need(
            is_int(self.top_logprobs) and 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS,
            "top_logprobs",
            f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs!r}",
        )

        need(
            isinstance(self.logit_bias, tuple) and len(self.logit_bias) <= MAX_LOGIT_BIAS,
            "logit_bias",
            f"logit_bias takes at most {MAX_LOGIT_BIAS} entries, got {len(self.logit_bias)}",
        )
        for entry in self.logit_bias:
            tid, bias = entry if isinstance(entry, tuple) and len(entry) == 2 else (None, None)
            need(
                is_int(tid) and tid >= 0,
                "logit_bias",
                f"logit_bias keys must be token ids (integers >= 0), got {tid!r}",
            )
            need(
                is_num(bias) and -100.0 <= bias <= 100.0,
                "logit_bias",
                f"logit_bias values must be in [-100, 100], got {bias!r} for token {tid}",
            )
        need(
            self.grammar is None or isinstance(self.grammar, GrammarSpec),
            "grammar",
            "grammar must be a GrammarSpec",
        )

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    @property
    def num_logprobs(self) -> int:
        """Top-logprob entries to return per token (0 with logprobs off)."""
        return self.top_logprobs if self.logprobs else 0


def expand_n(params: SamplingParams) -> list[SamplingParams]:
    """Split a request with n > 1 into n single-choice parameter sets.

    With a seed, choice i uses seed + i (wrapping past 2**64 - 1, the largest seed accepted) so
    the choices differ but the whole set reproduces.
    """
    from dataclasses import replace

    if params.n == 1:
        return [params]

    def seed(i: int) -> int | None:
        if params.seed is None:
            return None
        s = params.seed + i
        return s - 2**64 if s >= 2**64 else s

    return [replace(params, n=1, seed=seed(i)) for i in range(params.n)]

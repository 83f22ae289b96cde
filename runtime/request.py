"""A request's live state inside the engine: tokens so far, KV blocks held, progress.

Owned by the scheduler; the engine and runner read it. Not a message type: messages that
cross layers are the frozen dataclasses of `runtime/types.py`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tandem.runtime.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tandem.runtime.grammar import GrammarMatcher


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again after its blocks were taken; recomputed on resume
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # this request alone failed inside a step (Request.error says why)

    @property
    def finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        return self.value if self in _FINISHED else None


_FINISHED = frozenset(
    (
        RequestStatus.FINISHED_STOPPED,
        RequestStatus.FINISHED_LENGTH,
        RequestStatus.FINISHED_ABORTED,
        RequestStatus.FINISHED_ERROR,
    )
)


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = 0.0
    priority: int = 0  # lower value is served first; FCFS within a class
    group: str | None = None  # the client request this sequence belongs to (None: itself)
    eos_token_ids: tuple[int, ...] = ()
    # Mutable state
    token_ids: list[int] = field(default_factory=list)  # prompt + output, grows by one per decode
    num_computed_tokens: int = 0  # tokens whose KV is in `block_ids`' blocks
    block_ids: list[int] = field(default_factory=list)
    # A model with windowed and full layers: the windowed layers' own blocks (kv_cache.py)
    window_block_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first schedule
    num_preemptions: int = 0
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    grammar: GrammarMatcher | None = None  # advanced by every token appended
    error: str | None = None  # FINISHED_ERROR: what failed, safe to show the client

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        self._num_prompt = len(self.prompt_token_ids)  # the prompt never changes
        if self.group is None:
            self.group = self.request_id

    @property
    def num_prompt_tokens(self) -> int:
        return self._num_prompt

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self._num_prompt

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self._num_prompt :]

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        if self.grammar is not None:
            self.grammar.accept(token_id)

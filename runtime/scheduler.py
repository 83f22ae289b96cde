"""Continuous-batching scheduler: one token budget per step, chunked prefill, preemption.

Owns the waiting and running queues and each request's progress and KV blocks (through its
`BlockPool`). It decides what runs each step and applies sampled tokens and stop conditions
by token id; it knows nothing of tensors, text, stop strings or the runner (the engine ends a
request on a stop string through `finish_request`).

Step contract (vLLM v1 style): `schedule()` gives running requests their next tokens first
(1 for a decode, the next chunk for an unfinished prefill), preempting the newest running
request when KV blocks run out, then admits waiting requests by policy while the budget,
`max_num_seqs` and blocks last. `update()` applies that step's results. A request finished or
aborted between the two has its results ignored.

Fair share: sequences of one client request (its prompts x n) form a `group`. While a group
waits below its share of the running slots (`max_num_seqs` // groups running or waiting), no
group holds more than its share: admission skips the waiting sequences of groups at their
share, and where slots are short the newest sequences of the groups most over theirs are
preempted to make room.

Async (overlap) mode, opt-in with `async_mode=True`: the engine schedules step N+1 before it
has applied step N. `schedule()` then advances `num_computed_tokens` at once, and a request
whose step-N token is still in flight is scheduled to decode it as a placeholder (position
`num_tokens`, whose id only the device knows; KV is allocated for it as for any token).
`update()` fills in the real tokens. Stop tokens are therefore seen one step late: the extra
token of a request that finished in step N is discarded when step N+1 is applied. Length
limits (max_tokens, max_model_len) are known ahead, so no request is scheduled past them.
A request preempted or ended with a step in flight has that step's results ignored; its KV
writes land in blocks that later steps overwrite before they read (one stream orders them).
"""

from __future__ import annotations

import bisect
import heapq
import itertools

from tandem.runtime.config import CacheConfig, SchedulerConfig
from tandem.runtime.kv_cache import BlockPool
from tandem.runtime.kv_pools import KVPools
from tandem.runtime.request import Request, RequestStatus
from tandem.runtime.types import ScheduledSeq, SchedulerOutput


class RequestTooLongError(ValueError):
    """The request can never be served within max_model_len or the KV pool."""


class Scheduler:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_blocks: int,
        *,
        async_mode: bool = False,
        window: int | None = None,
        window_group: tuple[int, int] | None = None,
    ):
        """`window`: the sliding window of a model whose every layer has one; a running
        request then releases its blocks that every window has passed (kv_cache.py).
        `window_group` (window, num_blocks): a model with windowed and full layers; the
        windowed layers take their blocks from a pool of `num_blocks` of their own
        (`window_pool`), released the same way."""
        if scheduler_config.policy not in ("fcfs", "priority"):
            raise ValueError(f"unknown scheduling policy {scheduler_config.policy!r}")
        if scheduler_config.max_model_len is None:  # the engine resolves it from the model
            raise ValueError("the scheduler needs a resolved max_model_len, got None")
        self.config = scheduler_config
        self.cache_config = cache_config
        self.block_pool = BlockPool(
            num_blocks, cache_config.block_size, cache_config.enable_prefix_caching
        )
        self.window_pool: BlockPool | None = None
        if window_group is not None:
            self.window_pool = BlockPool(
                window_group[1], cache_config.block_size, cache_config.enable_prefix_caching,
                table="window_block_ids",
            )  # fmt: skip
        self.kv = KVPools(self.block_pool, self.window_pool, window_group[0] if window_group else 0)
        self._requests: dict[str, Request] = {}  # unfinished: waiting or running
        self._waiting: list[tuple[tuple, str]] = []  # heap of (order key, request_id)
        self._keys: dict[str, tuple] = {}  # request_id -> its order key
        self.running: list[Request] = []  # in scheduling order; the last is preempted first
        self._arrivals = itertools.count()  # add order, FCFS tiebreak
        self._fronts = itertools.count(1)  # FCFS: each re-queued preemptee goes before all
        self.num_preemptions_total = 0
        self.async_mode = async_mode
        self.window = window
        # Async mode only, per running request: tokens whose results update() has applied
        # (the start of its next seq to apply) and sampled tokens still in flight (0 or 1).
        self._num_applied: dict[str, int] = {}
        self._num_in_flight: dict[str, int] = {}

    # ------------------------------------------------------------- queries
    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def get_request(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    @property
    def prefix_cache_queries(self) -> int:
        return self.block_pool.prefix_cache_queries

    @property
    def prefix_cache_hits(self) -> int:
        return self.block_pool.prefix_cache_hits

    # ------------------------------------------------------------- requests
    def add_request(self, request: Request) -> None:
        """Queue a new request; raise RequestTooLongError if it could never be served."""
        if request.request_id in self._requests:
            raise ValueError(f"request id {request.request_id!r} is already scheduled")
        num_prompt = request.num_prompt_tokens
        max_len = self.config.max_model_len
        max_tokens = request.params.max_tokens
        if num_prompt == 0:
            raise ValueError("the prompt must contain at least one token")
        if num_prompt >= max_len:
            raise RequestTooLongError(
                f"prompt has {num_prompt} tokens, but max_model_len is {max_len} "
                f"(the prompt must leave room for at least one output token)"
            )
        if num_prompt + (max_tokens or 0) > max_len:
            raise RequestTooLongError(
                f"prompt ({num_prompt} tokens) + max_tokens ({max_tokens}) = "
                f"{num_prompt + max_tokens} exceeds max_model_len ({max_len})"
            )
        # The last sampled token is never fed back, so its KV slot is never needed.
        max_total = num_prompt + max_tokens if max_tokens is not None else max_len
        blocks = self.block_pool.blocks_needed(max_total - 1)
        if self.window is not None:  # held at once: a chunk's queries and the window behind
            span = self.window - 1 + self.config.max_num_batched_tokens
            blocks = min(blocks, self.block_pool.blocks_needed(span) + 1)
        if not self.kv.window_pool_fits(self.config.max_num_batched_tokens):
            raise RequestTooLongError(
                "the windowed layers' KV pool cannot hold one chunk of "
                f"{self.config.max_num_batched_tokens} tokens and its window"
            )
        if blocks > self.block_pool.num_usable_blocks:
            limit = (
                f"max_tokens {max_tokens}" if max_tokens is not None else f"max_model_len {max_len}"
            )
            raise RequestTooLongError(
                f"request needs up to {max_total} tokens (prompt {num_prompt}, {limit}): "
                f"{blocks} KV blocks of {self.block_pool.block_size}, but the KV cache has only "
                f"{self.block_pool.num_usable_blocks} blocks"
            )
        request.status = RequestStatus.WAITING
        if self.config.policy == "priority":
            key: tuple = (request.priority, request.arrival_time, next(self._arrivals))
        else:
            key = (0, next(self._arrivals))
        self._keys[request.request_id] = key
        self._requests[request.request_id] = request
        heapq.heappush(self._waiting, (key, request.request_id))

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """End a waiting or running request with a finished `status`; free its blocks once."""
        if not status.finished:
            raise ValueError(f"{status} is not a finished status")
        request = self._requests.pop(request_id, None)
        if request is None:
            return None
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self._waiting = [e for e in self._waiting if e[1] != request_id]
            heapq.heapify(self._waiting)
        del self._keys[request_id]
        self._num_applied.pop(request_id, None)
        self._num_in_flight.pop(request_id, None)
        request.status = status
        self.kv.free(request)
        return request

    def abort_request(self, request_id: str) -> Request | None:
        return self.finish_request(request_id, RequestStatus.FINISHED_ABORTED)

    # ------------------------------------------------------------- schedule
    def _chunk(self, request: Request, budget: int) -> int:
        num_known = request.num_tokens
        if self.async_mode:
            in_flight = self._num_in_flight.get(request.request_id, 0)
            if in_flight and self._reaches_length_limit(request, in_flight):
                return 0  # its last token is in flight: nothing more to compute
            num_known += in_flight
        num = min(num_known - request.num_computed_tokens, budget)
        threshold = self.config.long_prefill_token_threshold
        if threshold > 0 and num > 1:
            num = min(num, threshold)
        return num

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv.free(request)
        request.num_computed_tokens = 0
        self._num_applied.pop(request.request_id, None)
        self._num_in_flight.pop(request.request_id, None)  # its in-flight token is discarded
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        key = self._keys[request.request_id]
        if self.config.policy == "fcfs":  # back to the front of the queue
            key = (-next(self._fronts), key[1])
            self._keys[request.request_id] = key
        heapq.heappush(self._waiting, (key, request.request_id))

    def _start_running(self, request: Request) -> None:
        request.status = RequestStatus.RUNNING
        if self.config.policy == "priority":  # keep the lowest-priority request last
            keys = [self._keys[r.request_id] for r in self.running]
            self.running.insert(bisect.bisect(keys, self._keys[request.request_id]), request)
        else:
            self.running.append(request)

    def _fair_share(self) -> tuple[int, dict[str, int], int] | None:
        """-> (running slots per group, running sequences per group, slots that waiting groups
        below their share could still take), or None when no group waits below its share."""
        if not self._waiting:
            return None
        running: dict[str, int] = {}
        for r in self.running:
            running[r.group] = running.get(r.group, 0) + 1
        waiting: dict[str, int] = {}
        for _, rid in self._waiting:
            g = self._requests[rid].group
            waiting[g] = waiting.get(g, 0) + 1
        num_groups = len(running.keys() | waiting.keys())
        if num_groups < 2:
            return None
        share = max(1, self.config.max_num_seqs // num_groups)
        wanted = sum(min(share - running.get(g, 0), n) for g, n in waiting.items()
                     if running.get(g, 0) < share)  # fmt: skip
        return (share, running, wanted) if wanted else None

    def _make_room(self, fair: tuple[int, dict[str, int], int]) -> list[str]:
        """Slots are short for the groups below their share: preempt the newest sequences of
        the groups most over theirs."""
        share, running, wanted = fair
        room = len(self.running) + wanted - self.config.max_num_seqs
        preempted: list[str] = []
        while room > 0 and running:
            group, held = max(running.items(), key=lambda kv: kv[1])
            if held <= share:
                break
            victim = next(r for r in reversed(self.running) if r.group == group)
            self._preempt(victim)
            preempted.append(victim.request_id)
            running[group] -= 1
            room -= 1
        return preempted

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        seqs: list[ScheduledSeq] = []
        pool = self.block_pool
        fair = self._fair_share()
        made_room = self._make_room(fair) if fair is not None else []
        preempted: list[str] = []

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = self._chunk(request, budget)
            if num_new <= 0:  # nothing left to compute until its last token is sampled
                i += 1
                continue
            if self.window is not None:  # its next query (and every later one) sees no further
                pool.release_before(request, request.num_computed_tokens - self.window + 1)
            while not self.kv.allocate(request, num_new):
                victim = self.running[-1]  # never one scheduled this step: those precede i
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is request:
                    break
            else:
                seqs.append(self._scheduled(request, num_new))
                budget -= num_new
                i += 1

        # Admitting while preempting would only thrash: wait until blocks come back.
        over_share: list[tuple[tuple, str]] = []  # waiting, skipped for the fair share
        while self._waiting and budget > 0 and not preempted:
            if len(self.running) >= self.config.max_num_seqs:
                break
            request = self._requests[self._waiting[0][1]]
            if fair is not None and fair[1].get(request.group, 0) >= fair[0]:
                over_share.append(heapq.heappop(self._waiting))
                continue
            prefix = self.kv.cached_prefix(request)
            request.num_computed_tokens = len(prefix.blocks) * pool.block_size
            num_new = self._chunk(request, budget)
            if not self.kv.allocate(request, num_new, prefix):
                request.num_computed_tokens = 0
                break  # no skipping ahead: the head of the queue would starve
            heapq.heappop(self._waiting)
            if self.window is not None:  # a long cached prefix: only its window is read
                pool.release_before(request, request.num_computed_tokens - self.window + 1)
            if request.num_preemptions == 0:
                request.num_cached_tokens = request.num_computed_tokens
            self._start_running(request)
            if fair is not None:
                fair[1][request.group] = fair[1].get(request.group, 0) + 1
            seqs.append(self._scheduled(request, num_new))
            budget -= num_new
        for entry in over_share:
            heapq.heappush(self._waiting, entry)

        return SchedulerOutput(
            seqs=tuple(seqs),
            num_batched_tokens=self.config.max_num_batched_tokens - budget,
            preempted_ids=tuple(made_room + preempted),
        )

    def _scheduled(self, request: Request, num_new: int) -> ScheduledSeq:
        start = request.num_computed_tokens
        if not self.async_mode:
            return ScheduledSeq(
                request=request,
                start_pos=start,
                num_tokens=num_new,
                sample=start + num_new == request.num_tokens,
            )
        rid = request.request_id
        in_flight = self._num_in_flight.get(rid, 0)
        sample = start + num_new == request.num_tokens + in_flight
        self._num_applied.setdefault(rid, start)
        request.num_computed_tokens = start + num_new
        if sample:
            self._num_in_flight[rid] = in_flight + 1
        return ScheduledSeq(request=request, start_pos=start, num_tokens=num_new, sample=sample)

    def _reaches_length_limit(self, request: Request, num_in_flight: int) -> bool:
        """Whether `num_in_flight` more tokens end the request by max_tokens/max_model_len."""
        max_tokens = request.params.max_tokens
        if max_tokens is not None and request.num_output_tokens + num_in_flight >= max_tokens:
            return True
        return request.num_tokens + num_in_flight >= self.config.max_model_len

    # ------------------------------------------------------------- update
    def update(self, output: SchedulerOutput, sampled_token_ids: list[int]) -> list[Request]:
        """Apply one step's results; return the requests that finished in it.

        `sampled_token_ids` align with the seqs of `output` that have sample=True, in order.
        Seqs whose request finished, was aborted or was preempted since are skipped.
        """
        num_samples = sum(1 for s in output.seqs if s.sample)
        if num_samples != len(sampled_token_ids):
            raise ValueError(
                f"{len(sampled_token_ids)} sampled ids for {num_samples} sampling seqs"
            )
        if self.async_mode:
            return self._update_async(output, sampled_token_ids)
        finished: list[Request] = []
        samples = iter(sampled_token_ids)
        for seq in output.seqs:
            token_id = next(samples) if seq.sample else None
            request = seq.request
            if (
                self._requests.get(request.request_id) is not request
                or request.status != RequestStatus.RUNNING
                or request.num_computed_tokens != seq.start_pos
            ):
                continue
            request.num_computed_tokens = seq.start_pos + seq.num_tokens
            if token_id is not None:
                request.append_token(token_id)
            self.kv.cache_full_blocks(request)
            if token_id is None:
                continue
            status = self._check_stop(request, token_id)
            if status is not None:
                self.finish_request(request.request_id, status)
                finished.append(request)
        return finished

    def _update_async(self, output: SchedulerOutput, sampled_token_ids: list[int]) -> list[Request]:
        finished: list[Request] = []
        samples = iter(sampled_token_ids)
        for seq in output.seqs:
            token_id = next(samples) if seq.sample else None
            request = seq.request
            rid = request.request_id
            if (
                self._requests.get(rid) is not request
                or request.status != RequestStatus.RUNNING
                or self._num_applied.get(rid) != seq.start_pos
            ):
                continue  # ended or preempted since: a late finish's extra token is dropped
            end = seq.start_pos + seq.num_tokens
            if end == request.num_computed_tokens:
                del self._num_applied[rid]  # nothing of it in flight any more
            else:
                self._num_applied[rid] = end
            if token_id is not None:
                self._num_in_flight[rid] -= 1
                if not self._num_in_flight[rid]:
                    del self._num_in_flight[rid]
                request.append_token(token_id)
            self.kv.cache_full_blocks(request)
            if token_id is None:
                continue
            status = self._check_stop(request, token_id)
            if status is not None:
                self.finish_request(rid, status)
                finished.append(request)
        return finished

    def _check_stop(self, request: Request, token_id: int) -> RequestStatus | None:
        params = request.params
        num_output = request.num_output_tokens
        if num_output >= params.min_tokens:
            if not params.ignore_eos and token_id in request.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token_id in params.stop_token_ids:
                request.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
        if request.grammar is not None and request.grammar.is_done:
            return RequestStatus.FINISHED_STOPPED  # the grammar is complete: nothing may follow
        if params.max_tokens is not None and num_output >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if request.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

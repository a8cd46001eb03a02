"""Continuous batching with chunked prefill, prefix caching and preemption by recompute.

Every request is just "tokens known" vs "tokens computed": a step gives each
scheduled request some new tokens to compute (a prefill chunk, or the one
token of a decode), within the step's token budget. Running requests go
first, oldest first; waiting requests are admitted while the budget, the
sequence limit and the KV cache allow. When the cache runs out, the
lowest-priority running request is preempted: its blocks are freed and it
re-enters the waiting queue, to recompute its tokens later (prefix caching
usually makes that cheap) and continue exactly where it stopped.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from fw.config import FwConfig
from fw.kv_cache import KVCacheManager
from fw.request import Request, Status


@dataclass
class StepInputs:
    """What every model worker needs for one step; plain data, so it can be sent to TP ranks."""

    token_ids: list[int]  # the new tokens of every scheduled request, concatenated
    num_computed: list[int]  # per request: tokens already in the KV cache
    num_new: list[int]  # per request: tokens computed this step
    block_tables: list[list[int]]
    sample_rows: list[int]  # requests whose last new token ends their known tokens: they sample
    # Token positions whose logits come back: each sampling request's last token, then the prompt
    # tokens of requests that asked for prompt logprobs.
    logit_positions: list[int]
    copies: list[tuple[int, int]]  # copy-on-write block copies to run before the forward


@dataclass
class ScheduledBatch:
    requests: list[Request] = field(default_factory=list)
    num_new: list[int] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    prefix_hit_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new)

    def __bool__(self) -> bool:
        return bool(self.requests)


class Scheduler:
    def __init__(self, config: FwConfig, kv: KVCacheManager, is_ready: Callable[[str], bool] = lambda _: True) -> None:
        self.kv = kv
        # Requests whose per-request preparation (e.g. grammar compilation) is still running wait, others pass.
        self.is_ready = is_ready
        self.max_num_seqs = config.scheduler.max_num_seqs
        self.token_budget = config.scheduler.max_num_batched_tokens
        self.chunked_prefill = config.scheduler.enable_chunked_prefill
        self.by_priority = config.scheduler.scheduling_policy == "priority"
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # What the latest schedule() moved from waiting to running: the suspects when a step fails as a whole.
        self.last_admitted: list[Request] = []

    def add(self, request: Request) -> None:
        self.waiting.append(request)
        if self.by_priority:
            self.waiting = deque(sorted(self.waiting, key=self._rank))

    def _rank(self, request: Request) -> tuple[int, int]:
        """Lower is more important: priority value first (if enabled), then arrival."""
        return (request.priority if self.by_priority else 0, request.arrival)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.token_budget
        self.last_admitted = []
        for request in list(self.running):
            if budget == 0:
                break
            if request not in self.running:  # preempted earlier in this loop
                continue
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if self._allocate_or_preempt(request, num_new, batch):
                batch.requests.append(request)
                batch.num_new.append(num_new)
                budget -= num_new
        while budget > 0 and len(self.running) < self.max_num_seqs and not batch.preempted:
            request = next((r for r in self.waiting if self.is_ready(r.request_id)), None)
            if request is None:
                break
            # Prompt logprobs need every prompt position computed, so such requests skip the cache (as in vLLM).
            cached = 0 if request.params.prompt_logprobs is not None else self.kv.get_computed_blocks(
                request.request_id, request.all_token_ids, request.cache_keys
            )
            num_new = request.num_tokens - cached
            if num_new > budget and not self.chunked_prefill:
                self.kv.free(request.request_id)
                break
            num_new = min(num_new, budget)
            if not self.kv.allocate_slots(request.request_id, cached + num_new):
                self.kv.free(request.request_id)
                break
            self.waiting.remove(request)
            request.num_computed_tokens = cached
            request.status = Status.RUNNING
            request.scheduled(cached)
            self.running.append(request)
            self.last_admitted.append(request)
            batch.requests.append(request)
            batch.num_new.append(num_new)
            batch.prefix_hit_tokens += cached
            budget -= num_new
        return batch

    def _allocate_or_preempt(self, request: Request, num_new: int, batch: ScheduledBatch) -> bool:
        """Make room for the request's new tokens, preempting less important requests; False if it was preempted."""
        while not self.kv.allocate_slots(request.request_id, request.num_computed_tokens + num_new):
            victim = max(self.running, key=self._rank)
            self._preempt(victim)
            batch.preempted.append(victim)
            if victim in batch.requests:  # only possible under priority; undo its slot in this step
                i = batch.requests.index(victim)
                del batch.requests[i], batch.num_new[i]
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv.free(request.request_id)
        request.num_computed_tokens = 0
        request.status = Status.WAITING
        request.num_preemptions += 1
        self.waiting.appendleft(request)
        if self.by_priority:
            self.waiting = deque(sorted(self.waiting, key=self._rank))

    def step_inputs(self, batch: ScheduledBatch) -> StepInputs:
        token_ids: list[int] = []
        sample_rows, sample_positions, prompt_positions = [], [], []
        for i, (request, n) in enumerate(zip(batch.requests, batch.num_new, strict=True)):
            start, first = request.num_computed_tokens, len(token_ids)
            token_ids.extend(request.all_token_ids[start : start + n])
            if start + n == request.num_tokens:
                sample_rows.append(i)
                sample_positions.append(len(token_ids) - 1)
            if request.params.prompt_logprobs is not None and start < len(request.prompt_token_ids):
                prompt_positions.extend(range(first, first + min(n, len(request.prompt_token_ids) - start)))
        return StepInputs(
            token_ids=token_ids,
            num_computed=[r.num_computed_tokens for r in batch.requests],
            num_new=list(batch.num_new),
            block_tables=[self.kv.block_ids(r.request_id) for r in batch.requests],
            sample_rows=sample_rows,
            logit_positions=sample_positions + prompt_positions,
            copies=self.kv.take_pending_copies(),
        )

    def update(self, batch: ScheduledBatch, inputs: StepInputs, tokens: list[int], logprobs: list[float] | None) -> list[Request]:
        """Account the computed tokens, append sampled ones; returns the requests that finished."""
        finished = []
        sampled = dict(zip(inputs.sample_rows, range(len(tokens)), strict=True))
        for i, (request, n) in enumerate(zip(batch.requests, batch.num_new, strict=True)):
            request.num_computed_tokens += n
            self.kv.cache_blocks(
                request.request_id, request.all_token_ids, request.num_computed_tokens, request.cache_keys
            )
            if i in sampled:
                j = sampled[i]
                request.append_token(tokens[j], logprobs[j] if logprobs is not None else None)
                if request.finished:
                    self._finish(request)
                    finished.append(request)
        return finished

    def _finish(self, request: Request) -> None:
        self.running.remove(request)
        self.kv.free(request.request_id)

    def abort(self, request_id: str) -> Request | None:
        for request in [*self.running, *self.waiting]:
            if request.request_id == request_id:
                if request in self.running:
                    self.running.remove(request)
                else:
                    self.waiting.remove(request)
                self.kv.free(request.request_id)
                request.status = Status.FINISHED
                request.finish_reason = "abort"
                return request
        return None

"""Continuous batching with chunked prefill, prefix caching and preemption by recompute.

Every request is just "tokens known" vs "tokens computed": a step gives each
scheduled request some new tokens to compute (a prefill chunk, or the one
token of a decode), within the step's token budget. Running requests go
first, oldest first; waiting requests are admitted while the budget, the
sequence limit and the KV cache allow. When the cache runs out, the
lowest-priority running request is preempted: its blocks are freed and it
re-enters the waiting queue, to recompute its tokens later (prefix caching
usually makes that cheap) and continue exactly where it stopped.

With a KV connector, admission asks it how many prompt tokens past the local
prefix cache can be loaded instead of computed. A synchronous connector loads
them in the step that admits the request; an asynchronous one parks the
request (holding its blocks) until the worker reports the load, then it is
admitted again with those tokens computed. A failed load sends the request
back to the queue to compute everything itself. A finished request whose
blocks the connector is still sending keeps them until the send is reported.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fw.config import FwConfig
from fw.interfaces.kvconnector import KVConnectorScheduler, KVTransferReport
from fw.kv_cache import KVCacheManager
from fw.request import Request, Status

log = logging.getLogger("fw")


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
    kv_connector_meta: Any = None  # the KV connector's transfers for this step (build_connector_meta)


@dataclass
class KVConnectorStats:
    """Running totals of the KV connector's work, for /metrics."""

    queries: int = 0  # prompt tokens looked up through the connector
    hits: int = 0  # of those, tokens it offered to load
    failed_loads: int = 0  # requests whose load failed and which were recomputed
    bytes_loaded: int = 0
    bytes_saved: int = 0
    seconds: float = 0.0


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


# The step's token budget when none is set. A GPU step costs about the same from one token to thousands (the
# weights are read once); a CPU step costs in proportion to its tokens from a few hundred up, so there a smaller
# budget loses no throughput and lets a burst's later requests start sooner.
DEFAULT_TOKEN_BUDGET = {"cpu": 512, "cuda": 2048}


class Scheduler:
    def __init__(
        self, config: FwConfig, kv: KVCacheManager, is_ready: Callable[[str], bool] = lambda _: True,
        connector: KVConnectorScheduler | None = None, device: str = "cpu", max_model_len: int = 0,
    ) -> None:
        self.kv = kv
        self.connector = connector
        # Asynchronous loads in flight: request id -> (request, tokens it will have computed once loaded).
        self.waiting_for_kv: dict[str, tuple[Request, int]] = {}
        # Requests whose blocks only the worker's report frees: finished ones the connector still sends,
        # and aborted ones with a load in flight (it may still write their blocks). Request id -> its group id.
        self.held: dict[str, str] = {}
        self.recompute: set[str] = set()  # requests whose load failed: they skip the connector from now on
        self.connector_stats = KVConnectorStats()
        # Requests whose per-request preparation (e.g. grammar compilation) is still running wait, others pass.
        self.is_ready = is_ready
        self.max_num_seqs = config.scheduler.max_num_seqs
        self.chunked_prefill = config.scheduler.enable_chunked_prefill
        # Without chunked prefill a prompt runs in one step, so the default budget holds the longest (as in vLLM).
        default = DEFAULT_TOKEN_BUDGET[device] if self.chunked_prefill else max(DEFAULT_TOKEN_BUDGET[device], max_model_len)
        self.token_budget = config.scheduler.max_num_batched_tokens or default
        # A request's prompt tokens per step: a long prompt admitted first would otherwise take whole steps while
        # the requests behind it, which the budget could start, wait. Only chunked prefill can split a prompt.
        threshold = config.scheduler.long_prefill_token_threshold
        if threshold is None:
            threshold = max(1, self.token_budget // 4)
        self.prefill_chunk = threshold if threshold and self.chunked_prefill else self.token_budget
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
        return bool(self.waiting or self.running or self.kv_pending)

    @property
    def kv_pending(self) -> bool:
        """Transfers in flight that only the worker's reports complete: the engine steps until they do."""
        return bool(self.waiting_for_kv or self.held)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.token_budget
        self.last_admitted = []
        for request in list(self.running):
            if budget == 0:
                break
            if request not in self.running:  # preempted earlier in this loop
                continue
            num_new = min(request.num_tokens - request.num_computed_tokens, budget, self.prefill_chunk)
            if self._allocate_or_preempt(request, num_new, batch):
                batch.requests.append(request)
                batch.num_new.append(num_new)
                budget -= num_new
        while (budget > 0 and len(self.running) + len(self.waiting_for_kv) < self.max_num_seqs
               and not batch.preempted):
            request = next((r for r in self.waiting if self.is_ready(r.request_id)), None)
            if request is None:
                break
            rid = request.request_id
            loaded = bool(self.kv.block_ids(rid))  # its asynchronous load arrived: those blocks are computed
            if loaded:
                cached, external = request.num_computed_tokens, 0
            else:
                # Prompt logprobs need every prompt position computed, so such requests skip the cache (as in vLLM).
                cached = 0 if request.params.prompt_logprobs is not None else self.kv.get_computed_blocks(
                    rid, request.all_token_ids, request.cache_keys
                )
                external = self._external_tokens(request, cached)
            if external and self.connector.load_async:
                if not self.kv.allocate_slots(rid, cached + external):
                    self._unadmit(request)
                    break
                self.connector.update_state_after_alloc(rid, self.kv.block_ids(rid), external)
                self.waiting.remove(request)
                request.num_computed_tokens = cached
                self.waiting_for_kv[rid] = (request, cached + external)
                continue
            num_new = request.num_tokens - cached - external
            if num_new > budget and not self.chunked_prefill:
                self._unadmit(request)
                break
            num_new = min(num_new, budget, self.prefill_chunk)
            if not self.kv.allocate_slots(rid, cached + external + num_new):
                self._unadmit(request)
                break
            if self.connector is not None and not loaded:
                self.connector.update_state_after_alloc(rid, self.kv.block_ids(rid), external)
            self.waiting.remove(request)
            cached += external
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

    def _external_tokens(self, request: Request, cached: int) -> int:
        """Prompt tokens the connector offers to load after the ``cached`` local ones (0 without a connector)."""
        if self.connector is None or request.params.prompt_logprobs is not None or request.request_id in self.recompute:
            return 0
        offered = self.connector.get_num_new_matched_tokens(
            request.request_id, request.all_token_ids, cached, request.cache_keys
        )
        # The last token is computed here: its logits give the next token.
        limit = request.num_tokens - 1 - cached
        if not 0 <= offered <= limit:
            # A connector bug must not fail the step every other request shares: this one computes its tokens.
            log.error("KV connector offered %d tokens for request %s, at most %d can be loaded; computing them",
                      offered, request.request_id, limit)
            return 0
        self.connector_stats.queries += request.num_tokens - cached
        self.connector_stats.hits += offered
        return offered

    def _unadmit(self, request: Request) -> None:
        """Admission stopped for lack of budget or blocks: the request waits with nothing held."""
        self.kv.free(request.request_id)
        request.num_computed_tokens = 0

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
        request.num_preemptions += 1
        self._requeue(request)

    def _requeue(self, request: Request) -> None:
        request.status = Status.WAITING
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
            kv_connector_meta=self._connector_meta(batch),
        )

    def _connector_meta(self, batch: ScheduledBatch) -> Any:
        if self.connector is None:
            return None
        for request, n in zip(batch.requests, batch.num_new, strict=True):
            rid = request.request_id
            self.connector.request_computed(
                rid, request.all_token_ids, self.kv.block_ids(rid), request.num_computed_tokens + n, request.cache_keys
            )
        return self.connector.build_connector_meta()

    def finish_transfers(self, report: KVTransferReport) -> list[Request]:
        """Apply the worker's report; returns the running requests whose load in this step failed.

        Those go back to the queue to compute every token themselves; whatever the step computed on
        top of their missing KV must not be used.
        """
        stats = self.connector_stats
        stats.bytes_loaded += report.bytes_loaded
        stats.bytes_saved += report.bytes_saved
        stats.seconds += report.seconds
        for rid in (report.sent | report.loaded | report.failed) & self.held.keys():
            del self.held[rid]
            self.kv.free(rid)
        for rid in report.loaded & self.waiting_for_kv.keys():
            request, computed = self.waiting_for_kv.pop(rid)
            request.num_computed_tokens = computed
            self.kv.cache_blocks(rid, request.all_token_ids, computed, request.cache_keys)
            self._requeue(request)
        failed = []
        for request in [*self.running, *(r for r, _ in self.waiting_for_kv.values())]:
            if request.request_id in report.failed:
                stats.failed_loads += 1
                self.recompute.add(request.request_id)
                if request in self.running:
                    self.running.remove(request)
                    failed.append(request)
                else:
                    del self.waiting_for_kv[request.request_id]
                # Its blocks hold no usable KV and the worker is done with them: the connector forgets the
                # request and they are freed now, whatever it answers.
                self.connector.request_finished(request.request_id, self.kv.block_ids(request.request_id))
                self.kv.free(request.request_id)
                request.num_computed_tokens = 0
                request.num_cached_tokens = None  # what it really finds cached is recorded when it runs
                self._requeue(request)
        return failed

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
        self._release(request)
        self.recompute.discard(request.request_id)

    def _release(self, request: Request) -> None:
        """The request's blocks go back to the pool, once the connector no longer needs them."""
        rid = request.request_id
        if self.connector is not None and self.connector.request_finished(rid, self.kv.block_ids(rid)):
            self.held[rid] = request.group_id
        else:
            self.kv.free(rid)

    def abort(self, request_id: str) -> Request | None:
        loading = [r for r, _ in self.waiting_for_kv.values()]
        for request in [*self.running, *self.waiting, *loading]:
            if request.request_id == request_id:
                if request in self.running:
                    self.running.remove(request)
                elif request in loading:
                    del self.waiting_for_kv[request_id]
                    self.connector.request_finished(request_id, self.kv.block_ids(request_id))
                    self.held[request_id] = request.group_id  # the load may still write its blocks
                else:
                    self.waiting.remove(request)
                if request_id not in self.held:
                    self._release(request)
                self.recompute.discard(request_id)
                request.status = Status.FINISHED
                request.finish_reason = "abort"
                return request
        return None

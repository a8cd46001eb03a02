"""Continuous batching with chunked prefill, prefix caching and preemption by recompute.

Every request is just "tokens known" vs "tokens computed": a step gives each
scheduled request some new tokens to compute (a prefill chunk, or the one
token of a decode), within the step's token budget. Running requests go
first, oldest first; waiting requests are admitted while the budget, the
sequence limit and the KV cache allow. When the cache runs out, the
lowest-priority running request is preempted: its blocks are freed and it
re-enters the waiting queue, to recompute its tokens later (prefix caching
usually makes that cheap) and continue exactly where it stopped.

With a KV connector, admission asks ``KVTransfers`` (fw.kv_transfers) how
many prompt tokens past the local prefix cache can be loaded instead of
computed. A synchronous connector loads them in the step that admits the
request; an asynchronous one parks the request until the worker reports the
load, then it is admitted again with those tokens computed.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from fw.config import FwConfig
from fw.interfaces.kvconnector import KVConnectorScheduler, KVTransferReport
from fw.kv_cache import KVCacheManager
from fw.kv_transfers import KVTransfers
from fw.request import Request, Status
from fw.step_inputs import StepInputs


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
        self.transfers = KVTransfers(connector, kv)
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
        self.num_preemptions = 0  # ever: vLLM's vllm:num_preemptions_total

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
        """KV transfers in flight that only the worker's reports complete: the engine steps until they do."""
        return self.transfers.pending

    @property
    def num_waiting(self) -> int:
        """Requests not running: queued, or parked until their KV load arrives."""
        return len(self.waiting) + len(self.transfers.loading)

    def id_in_use(self, group_id: str, seq_ids: Iterable[str]) -> bool:
        """Whether a request id may not be reused yet: a finished one's blocks may still be held for the KV
        connector's send, under its sequence ids."""
        return self.transfers.holds(group_id, seq_ids)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.token_budget
        self.last_admitted = []
        for request in list(self.running):
            if budget == 0:
                break
            if request not in self.running:  # preempted earlier in this loop
                continue
            num_new = self._num_new(request, budget)
            if self._allocate_or_preempt(request, num_new, batch):
                batch.requests.append(request)
                batch.num_new.append(num_new)
                budget -= num_new
        transfers = self.transfers
        while (budget > 0 and len(self.running) + len(transfers.loading) < self.max_num_seqs
               and not batch.preempted):
            request = next((r for r in self.waiting if self.is_ready(r.request_id)), None)
            if request is None:
                break
            rid = request.request_id
            loaded = bool(self.kv.block_ids(rid))  # its asynchronous load arrived: those blocks are computed
            if loaded:
                cached, external = request.num_computed_tokens, 0
            else:
                # Prompt logprobs, and pooling other than the last token's, need every prompt position computed,
                # so such requests skip the cache and the connector's loads (as in vLLM).
                every_position = request.params.prompt_logprobs is not None or (
                    request.pooling is not None and request.pooling.needs_every_position)
                cached = 0 if every_position else self.kv.get_computed_blocks(
                    rid, request.all_token_ids, request.cache_keys
                )
                external = 0 if every_position else transfers.external_tokens(request, cached)
            if transfers.loads_later(external):
                if not self.kv.allocate_slots(rid, cached + external):
                    self._unadmit(request)
                    break
                transfers.allocated(rid, external)
                self.waiting.remove(request)
                request.num_computed_tokens = cached
                transfers.park(request, cached + external)
                continue
            num_new = request.num_tokens - cached - external
            if num_new > budget and not self.chunked_prefill:
                self._unadmit(request)
                break
            num_new = min(num_new, budget, self.prefill_chunk)
            if not self.kv.allocate_slots(rid, cached + external + num_new):
                self._unadmit(request)
                break
            if not loaded:
                transfers.allocated(rid, external)
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

    def _num_new(self, request: Request, budget: int) -> int:
        """A running request's tokens this step: its known ones left, and its drafts (speculative decoding) as far
        as the budget and the free KV blocks allow; drafts that do not fit are dropped, never worth a preemption."""
        remaining = request.num_tokens - request.num_computed_tokens
        num_new = min(remaining + len(request.draft_token_ids), budget, self.prefill_chunk)
        if num_new > remaining and not self.kv.can_allocate(request.request_id, request.num_computed_tokens + num_new):
            num_new = min(remaining, num_new)
        del request.draft_token_ids[max(num_new - remaining, 0) :]
        return num_new

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
        request.draft_token_ids.clear()
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._requeue(request)

    def _requeue(self, request: Request) -> None:
        request.status = Status.WAITING
        self.waiting.appendleft(request)
        if self.by_priority:
            self.waiting = deque(sorted(self.waiting, key=self._rank))

    def step_inputs(self, batch: ScheduledBatch) -> StepInputs:
        token_ids: list[int] = []
        sample_rows, sample_positions, prompt_positions, hidden_positions = [], [], [], []
        for i, (request, n) in enumerate(zip(batch.requests, batch.num_new, strict=True)):
            start, first = request.num_computed_tokens, len(token_ids)
            drafts = request.draft_token_ids
            token_ids.extend((request.all_token_ids + drafts)[start : start + n])
            if request.pooling is not None:  # samples nothing: its hidden states come back instead
                hidden_positions.extend(first + k for k in request.pooling.positions(start, n, request.num_tokens))
            elif start + n == request.num_tokens + len(drafts):
                sample_rows.append(i)
                # A request with drafts is scored at its last known token and at each draft.
                sample_positions.extend(range(len(token_ids) - 1 - len(drafts), len(token_ids)))
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
            kv_connector_meta=self.transfers.step_meta(batch.requests, batch.num_new),
            hidden_positions=hidden_positions,
        )

    def finish_transfers(self, report: KVTransferReport) -> list[Request]:
        """Apply the worker's KV-transfer report; returns the running requests whose load in this step failed.

        Those went back to the queue to compute every token themselves; whatever the step computed on
        top of their missing KV must not be used.
        """
        return self.transfers.finish(report, self.running, self._requeue)

    def update(
        self, batch: ScheduledBatch, inputs: StepInputs, tokens: list[list[int]], logprobs: list[list[float]] | None
    ) -> list[Request]:
        """Account the computed tokens, append each sampling request's new ones (one, or with speculative decoding
        its accepted drafts and one more); returns the requests that finished."""
        finished = []
        sampled = dict(zip(inputs.sample_rows, range(len(tokens)), strict=True))
        for i, (request, n) in enumerate(zip(batch.requests, batch.num_new, strict=True)):
            j = sampled.get(i)
            new = tokens[j] if j is not None else []
            # Drafts past the accepted ones were computed but are not the request's: their KV is dropped.
            rejected = len(request.draft_token_ids) - max(len(new) - 1, 0)
            request.draft_token_ids = []
            request.num_computed_tokens += n - rejected
            for t, token in enumerate(new):
                request.append_token(token, logprobs[j][t] if logprobs is not None else None)
                if request.finished:  # stop conditions hold token by token: what follows is dropped
                    break
            request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens)
            if request.pooling is not None and request.num_computed_tokens == request.num_tokens:
                request.finish_pooling()
            if rejected and not request.finished:
                self.kv.trim(request.request_id, request.num_computed_tokens)
            self.kv.cache_blocks(
                request.request_id, request.all_token_ids, request.num_computed_tokens, request.cache_keys
            )
            if request.finished:
                self._finish(request)
                finished.append(request)
        return finished

    def _finish(self, request: Request) -> None:
        self.running.remove(request)
        self.transfers.release(request)

    def abort(self, request_id: str) -> Request | None:
        request = self.transfers.abort_load(request_id)
        if request is None:
            request = next((r for r in [*self.running, *self.waiting] if r.request_id == request_id), None)
            if request is None:
                return None
            (self.running if request in self.running else self.waiting).remove(request)
            self.transfers.release(request)
        request.status = Status.FINISHED
        request.finish_reason = "abort"
        return request

"""The scheduler's side of a KV connector: which requests load, which hold their blocks, what failed.

The scheduler consults one ``KVTransfers`` through a few named calls and never
talks to the connector itself. Without a connector every call is a no-op
(``external_tokens`` offers nothing, ``release`` frees at once), so the
scheduler has no connector branches of its own.

Two kinds of state live here:

- *Loading*: with an asynchronous connector (``load_async``), an admitted
  request whose prompt can be loaded is parked, holding its blocks, until the
  worker reports the load; then it goes back to the queue with those tokens
  computed. A failed load sends it back to compute everything itself, and it
  never asks the connector again (``recompute``).
- *Held*: a finished request whose blocks the connector is still sending, or an
  aborted one whose load may still write them, keeps its blocks until the
  worker's report says the transfer is over.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from fw.interfaces.kvconnector import KVConnectorScheduler, KVTransferReport
from fw.kv_cache import KVCacheManager
from fw.request import Request

log = logging.getLogger("fw")


@dataclass
class KVConnectorStats:
    """Running totals of the KV connector's work, for /metrics."""

    queries: int = 0  # prompt tokens looked up through the connector
    hits: int = 0  # of those, tokens it offered to load
    failed_loads: int = 0  # requests whose load failed and which were recomputed
    bytes_loaded: int = 0
    bytes_saved: int = 0
    seconds: float = 0.0


class KVTransfers:
    def __init__(self, connector: KVConnectorScheduler | None, kv: KVCacheManager) -> None:
        self.connector = connector
        self.kv = kv
        # Asynchronous loads in flight: request id -> (request, tokens it will have computed once loaded).
        self.loading: dict[str, tuple[Request, int]] = {}
        # Requests whose blocks only the worker's report frees. Request id -> its group id.
        self.held: dict[str, str] = {}
        self.recompute: set[str] = set()  # requests whose load failed: they skip the connector from now on
        self.stats = KVConnectorStats()

    @property
    def pending(self) -> bool:
        """Transfers in flight that only the worker's reports complete: the engine steps until they do."""
        return bool(self.loading or self.held)

    def holds(self, group_id: str, seq_ids: Iterable[str]) -> bool:
        """Whether a finished request of this group id, or one of these sequence ids, still holds blocks."""
        return group_id in self.held.values() or any(s in self.held for s in seq_ids)

    # --- admission ------------------------------------------------------------

    def external_tokens(self, request: Request, cached: int) -> int:
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
        self.stats.queries += request.num_tokens - cached
        self.stats.hits += offered
        return offered

    def loads_later(self, external: int) -> bool:
        """Whether ``external`` offered tokens arrive after the step (the request parks) rather than in it."""
        return bool(external) and self.connector.load_async

    def allocated(self, request_id: str, external: int) -> None:
        """The request's blocks were allocated; ``external`` of its tokens are to be loaded into them."""
        if self.connector is not None:
            self.connector.update_state_after_alloc(request_id, self.kv.block_ids(request_id), external)

    def park(self, request: Request, computed_once_loaded: int) -> None:
        self.loading[request.request_id] = (request, computed_once_loaded)

    def step_meta(self, requests: list[Request], num_new: list[int]) -> Any:
        """Tell the connector what each scheduled request will have computed; its transfers for the step."""
        if self.connector is None:
            return None
        for request, n in zip(requests, num_new, strict=True):
            rid = request.request_id
            self.connector.request_computed(
                rid, request.all_token_ids, self.kv.block_ids(rid), request.num_computed_tokens + n, request.cache_keys
            )
        return self.connector.build_connector_meta()

    # --- the worker's report -----------------------------------------------------

    def finish(self, report: KVTransferReport, running: list[Request],
               requeue: Callable[[Request], None]) -> list[Request]:
        """Apply the worker's report: free held blocks, requeue loaded requests; returns the running requests
        whose load in this step failed (removed from ``running`` and requeued to compute every token)."""
        if self.connector is None:
            return []
        stats = self.stats
        stats.bytes_loaded += report.bytes_loaded
        stats.bytes_saved += report.bytes_saved
        stats.seconds += report.seconds
        for rid in (report.sent | report.loaded | report.failed) & self.held.keys():
            del self.held[rid]
            self.kv.free(rid)
        for rid in report.loaded & self.loading.keys():
            request, computed = self.loading.pop(rid)
            request.num_computed_tokens = computed
            self.kv.cache_blocks(rid, request.all_token_ids, computed, request.cache_keys)
            requeue(request)
        failed = []
        for request in [*running, *(r for r, _ in self.loading.values())]:
            if request.request_id in report.failed:
                stats.failed_loads += 1
                self.recompute.add(request.request_id)
                if request in running:
                    running.remove(request)
                    failed.append(request)
                else:
                    del self.loading[request.request_id]
                # Its blocks hold no usable KV and the worker is done with them: the connector forgets the
                # request and they are freed now, whatever it answers.
                self.connector.request_finished(request.request_id, self.kv.block_ids(request.request_id))
                self.kv.free(request.request_id)
                request.num_computed_tokens = 0
                request.num_cached_tokens = None  # what it really finds cached is recorded when it runs
                requeue(request)
        return failed

    # --- the end of a request ----------------------------------------------------

    def release(self, request: Request) -> None:
        """The request's blocks go back to the pool, once the connector no longer needs them."""
        rid = request.request_id
        self.recompute.discard(rid)
        if self.connector is not None and self.connector.request_finished(rid, self.kv.block_ids(rid)):
            self.held[rid] = request.group_id
        else:
            self.kv.free(rid)

    def abort_load(self, request_id: str) -> Request | None:
        """Stop waiting for a request's load; its blocks stay held, since the load may still write them."""
        if request_id not in self.loading:
            return None
        request, _ = self.loading.pop(request_id)
        self.recompute.discard(request_id)
        self.connector.request_finished(request_id, self.kv.block_ids(request_id))
        self.held[request_id] = request.group_id
        return request

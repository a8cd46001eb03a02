"""Prometheus metrics with vLLM's names, under the `fw:` prefix."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from fw.engine.client import EngineClient, ReplicaStats
from fw.kv_transfers import KVConnectorStats
from fw.outputs import PoolingRequestOutput, RequestOutput

if TYPE_CHECKING:
    from fw.engine.spec_decode import SpecDecodeStats

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TOKEN_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)


class _EngineState:
    """The engine's latest stats snapshot, read at scrape time (the engine publishes one per step)."""

    def __init__(self, engine: EngineClient) -> None:
        self.engine = engine

    def collect(self):
        stats = self.engine.stats()
        if stats.replicas:
            yield from _replica_families(stats.replicas)
            return
        for name, doc, value in (
            ("fw:num_requests_running", "Requests in the running batch.", stats.running),
            ("fw:num_requests_waiting", "Requests waiting to be scheduled (or for their KV to arrive).",
             stats.waiting),
            ("fw:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).", stats.kv_cache_usage),
        ):
            yield GaugeMetricFamily(name, doc, value=value)
        yield CounterMetricFamily("fw:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                  value=stats.prefix_cache_queries)
        yield CounterMetricFamily("fw:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                                  value=stats.prefix_cache_hits)
        yield CounterMetricFamily("fw:num_preemptions", PREEMPTIONS_DOC, value=stats.num_preemptions)
        if stats.kv_connector is not None:
            yield from _connector_families(stats.kv_connector)
        if stats.spec_decode is not None:
            yield from _spec_decode_families(stats.spec_decode)


PREEMPTIONS_DOC = "Requests preempted (their KV freed, recomputed later)."


def _spec_decode_families(stats: SpecDecodeStats):
    yield CounterMetricFamily("fw:spec_decode_num_drafts", "Request steps that verified draft tokens.",
                              value=stats.num_drafts)
    yield CounterMetricFamily("fw:spec_decode_num_draft_tokens", "Draft tokens verified.",
                              value=stats.num_draft_tokens)
    yield CounterMetricFamily("fw:spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                              value=stats.num_accepted_tokens)


def _connector_families(stats: KVConnectorStats):
    yield CounterMetricFamily("fw:external_prefix_cache_queries",
                              "Prompt tokens looked up through the KV connector.", value=stats.queries)
    yield CounterMetricFamily("fw:external_prefix_cache_hits",
                              "Prompt tokens the KV connector loaded instead of computing.", value=stats.hits)
    # fw's own names: vLLM has these per connector only (vllm:nixl_bytes_transferred, ...).
    moved = CounterMetricFamily("fw:kv_transfer_bytes", "KV-cache bytes the connector moved.", labels=["direction"])
    moved.add_metric(["load"], stats.bytes_loaded)
    moved.add_metric(["save"], stats.bytes_saved)
    yield moved
    yield CounterMetricFamily("fw:kv_transfer_seconds", "Time the KV connector spent transferring.",
                              value=stats.seconds)
    yield CounterMetricFamily("fw:kv_load_failures",
                              "Requests whose KV load failed or timed out and which computed their prompt.",
                              value=stats.failed_loads)


def _replica_families(replicas: tuple[ReplicaStats, ...]):
    """``-dp N``: each replica's state as it last reported it, labelled ``engine`` as vLLM labels its engines, and
    the requests routed to each."""
    families = [
        (GaugeMetricFamily, "fw:num_requests_running", "Requests in the running batch.", "running"),
        (GaugeMetricFamily, "fw:num_requests_waiting", "Requests waiting to be scheduled (or for their KV to arrive).",
         "waiting"),
        (GaugeMetricFamily, "fw:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).",
         "kv_cache_usage"),
        (CounterMetricFamily, "fw:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
         "prefix_cache_queries"),
        (CounterMetricFamily, "fw:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
         "prefix_cache_hits"),
        (CounterMetricFamily, "fw:num_preemptions", PREEMPTIONS_DOC, "num_preemptions"),
        (CounterMetricFamily, "fw:requests_routed", "Requests the server sent to each data-parallel replica.",
         "routed"),
    ]
    for kind, name, doc, field in families:
        family = kind(name, doc, labels=["engine"])
        for replica in replicas:
            family.add_metric([str(replica.rank)], getattr(replica, field))
        yield family


class Metrics:
    def __init__(self, engine: EngineClient) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineState(engine))
        r = self.registry
        self.prompt_tokens = Counter("fw:prompt_tokens", "Prompt tokens processed.", registry=r)
        self.generation_tokens = Counter("fw:generation_tokens", "Tokens generated.", registry=r)
        self.requests = Counter("fw:request_success", "Finished requests.", ["finished_reason"], registry=r)
        self.ttft = Histogram("fw:time_to_first_token_seconds", "Time to first token.", buckets=LATENCY_BUCKETS,
                              registry=r)
        self.tpot = Histogram("fw:time_per_output_token_seconds", "Time per output token after the first.",
                              buckets=TOKEN_BUCKETS, registry=r)
        self.e2e = Histogram("fw:e2e_request_latency_seconds", "End-to-end request latency.",
                             buckets=LATENCY_BUCKETS, registry=r)

    def observe_request(self, output: RequestOutput | PoolingRequestOutput | None, start: float) -> None:
        """Account a request the server saw to its end (``start``: time.monotonic() at arrival)."""
        if output is None:
            return
        now = time.monotonic()
        if isinstance(output, PoolingRequestOutput):  # embeddings: a prompt, nothing generated
            self.prompt_tokens.inc(len(output.prompt_token_ids))
            self.requests.labels(finished_reason="stop").inc()
            self.e2e.observe(now - start)
            return
        generated = sum(len(c.token_ids) for c in output.outputs)
        self.prompt_tokens.inc(len(output.prompt_token_ids))
        self.generation_tokens.inc(generated)
        for comp in output.outputs:
            self.requests.labels(finished_reason=comp.finish_reason or "abort").inc()
        self.e2e.observe(now - start)
        if output.first_token_time is not None:
            self.ttft.observe(max(output.first_token_time - start, 0.0))
            if generated > len(output.outputs):
                self.tpot.observe((now - output.first_token_time) / (generated - len(output.outputs)))

    def render(self) -> bytes:
        return generate_latest(self.registry)

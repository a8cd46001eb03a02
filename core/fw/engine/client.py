"""The engine's boundary: what ``LLM``, ``fw serve`` and the data-parallel front may use of an engine.

Two faces of one contract. ``EngineClient`` is asynchronous: ``AsyncEngine`` (one engine, stepped on its own
thread) and ``DataParallelEngine`` (``-dp N``: replicas in processes) implement it, and ``fw serve`` talks to either
through it alone. ``SyncEngineClient`` is the synchronous face that ``LLM``, ``fw generate`` and ``fw bench`` step
themselves; ``LLMEngine`` implements it. Both give the same facts (``view``: tokenizer, limits, selected plugins),
the same ``stats()`` and ``shutdown()``. Neither exposes the scheduler, KV cache or executor.

``fw router`` holds no engine: it proxies ``fw serve`` instances, so its boundary is their HTTP API (``/v1/*``
and ``/health``), which the server serves through ``EngineClient`` (tests/test_engine_boundary.py checks that
the router imports nothing of ``fw``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from fw.engine.spec_decode import SpecDecodeStats
    from fw.inputs import PromptType
    from fw.interfaces.hooks import EngineView
    from fw.kv_transfers import KVConnectorStats
    from fw.outputs import RequestOutput
    from fw.pooling import PoolingParams
    from fw.sdk.sampling_params import SamplingParams

# What an engine client runs: (prompt, params, request id, priority); PoolingParams make it a pooling request.
Submission = tuple["PromptType", "SamplingParams | PoolingParams", str, int]


class EngineError(ValueError):
    """A request or configuration the engine cannot serve; the message says why."""


@dataclass(frozen=True)
class EngineStats:
    """An engine's state after its latest step, admission or abort, for /metrics: a snapshot the engine
    replaces, never mutates, so a reader on another thread needs no lock."""

    running: int = 0  # requests in the running batch
    waiting: int = 0  # requests queued, or parked until their KV load arrives
    kv_cache_usage: float = 0.0  # fraction of KV-cache blocks in use
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache, in total
    prefix_cache_hits: int = 0
    num_preemptions: int = 0  # requests preempted (their KV freed, to recompute later), in total
    kv_connector: KVConnectorStats | None = None  # the connector's totals; None without a connector
    spec_decode: SpecDecodeStats | None = None  # speculative decoding's totals; None without speculation
    decode_graphs: DecodeGraphStats | None = None  # captured decode steps; None where none are (enforce_eager, CUDA)
    replicas: tuple[ReplicaStats, ...] = ()  # -dp N: each replica's, as it last reported, by rank


@dataclass(frozen=True)
class DecodeGraphStats:
    """Captured decode steps (``fw.decode_graph``): replays per step shape (requests, tokens), the shapes whose
    steps the tracer could not record and why, and why every step runs eagerly, if one does."""

    replayed: dict[tuple[int, int], int]
    untraced: dict[tuple[int, int], str]
    off: str | None


@dataclass(frozen=True)
class ReplicaStats(EngineStats):
    """A data-parallel replica's ``EngineStats``, with what the front and lockstep rounds add."""

    rank: int = 0
    routed: int = 0  # requests the front sent to this replica, ever
    rounds: int = 0  # lockstep rounds run (expert parallelism only)
    dummy_steps: int = 0  # of those, forward passes of other replicas this one joined without a batch


class _EngineFacts(Protocol):
    view: EngineView  # what the engine serves: fixed once it is built

    def stats(self) -> EngineStats: ...

    def has_unfinished_requests(self) -> bool: ...

    def shutdown(self) -> None: ...


class EngineClient(_EngineFacts, Protocol):
    """An engine as the server uses it. A caller that stops iterating ``generate_many`` (closes it, or is cancelled)
    aborts its requests: that is how a client disconnect frees their KV blocks."""

    def generate_many(self, requests: Sequence[Submission]) -> AsyncIterator[tuple[int, RequestOutput]]: ...


class SyncEngineClient(_EngineFacts, Protocol):
    """An engine its caller steps: add requests, ``step()`` until none is unfinished, abort what it gives up on."""

    def add_request(
        self, prompt: PromptType, params: SamplingParams | PoolingParams | None = None, request_id: str | None = None,
        priority: int = 0,
    ) -> str: ...

    def abort_request(self, request_id: str) -> RequestOutput | None: ...

    def step(self) -> list[RequestOutput]: ...

    @property
    def runs_workers(self) -> bool:
        """Whether worker processes run that only ``shutdown()`` stops (its owner shuts it down when dropped)."""

"""One generation request as the scheduler tracks it."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fw.detokenizer import IncrementalDetokenizer
from fw.outputs import PositionLogprobs, RequestMetrics
from fw.sdk.sampling_params import SamplingParams

if TYPE_CHECKING:
    from fw.pooling import Pooling

_arrival = itertools.count()


def new_metrics() -> RequestMetrics:
    now = time.time()
    return RequestMetrics(arrival_time=now, last_token_time=now)


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    max_model_len: int = 1 << 30
    priority: int = 0
    prompt: str | None = None
    detokenizer: IncrementalDetokenizer | None = None
    group_id: str = ""  # the client's request id; differs from request_id for the sequences of n > 1
    output_token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    # Per output token, when params.logprobs is set: the chosen token and the top N.
    output_logprobs: list[PositionLogprobs] = field(default_factory=list)
    # Per prompt token, when params.prompt_logprobs is set (None for the first token, which nothing predicts).
    prompt_logprobs: list[PositionLogprobs | None] = field(default_factory=list)
    # Tokens whose KV is in the cache; the next step computes from here.
    num_computed_tokens: int = 0
    # Speculative decoding: draft tokens the next step verifies after the last known token (fw.engine.spec_decode).
    draft_token_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    arrival: int = field(default_factory=lambda: next(_arrival))
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    num_preemptions: int = 0
    cache_keys: tuple = ()  # extra prefix-cache hash keys (the prompt's cache_salt): no sharing across them
    # Shared by the sequences of an n > 1 request, so they report as one: first to start, last to finish.
    metrics: RequestMetrics = field(default_factory=new_metrics)
    num_cached_tokens: int | None = None  # prefix-cache hit at the first scheduling (None until then)
    # A pooling request (fw.pooling): a prefill that samples nothing and ends with the pooled vector.
    pooling: Pooling | None = None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def scheduled(self, num_cached_tokens: int) -> None:
        """Admitted to run; a request resumed after preemption keeps its first numbers."""
        if self.num_cached_tokens is None:
            self.num_cached_tokens = num_cached_tokens
        if self.metrics.first_scheduled_time is None:
            self.metrics.first_scheduled_time = time.time()
            self.metrics.time_in_queue = self.metrics.first_scheduled_time - self.metrics.arrival_time

    def append_token(self, token: int, logprob: float | None = None) -> None:
        """Record a sampled token and decide whether the request is done."""
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()
        self.metrics.last_token_time = time.time()
        if self.metrics.first_token_time is None:
            self.metrics.first_token_time = self.metrics.last_token_time
        self.output_token_ids.append(token)
        if logprob is not None:
            self.cumulative_logprob += logprob
        params, n = self.params, len(self.output_token_ids)
        stop_string = self.detokenizer.append(token) if self.detokenizer is not None else None
        may_stop = n >= params.min_tokens
        if may_stop and token in params.stop_token_ids:
            self._finish("stop", token)
        elif may_stop and not params.ignore_eos and token in self.eos_token_ids:
            self._finish("stop", None)
        elif may_stop and stop_string is not None:
            self._finish("stop", stop_string)
        elif self._repeats():
            self._finish("stop", "repetition")
        elif (params.max_tokens is not None and n >= params.max_tokens) or self.num_tokens >= self.max_model_len:
            self._finish("length", None)

    def finish_pooling(self) -> None:
        """Every prompt position is computed: the pooled vector is the request's result."""
        self.pooling.finish(self.num_tokens)
        self._finish("stop", None)

    def _repeats(self) -> bool:
        """The last ``repetition_ngram_size`` tokens occurred ``repetition_max_repeats`` times back to back."""
        size, times = self.params.repetition_ngram_size, self.params.repetition_max_repeats
        out = self.output_token_ids
        if not size or len(out) < size * times:
            return False
        tail = out[-size:]
        return all(out[len(out) - size * (k + 1) : len(out) - size * k] == tail for k in range(1, times))

    def _finish(self, reason: str, stop_reason: str | int | None) -> None:
        self.finish_reason, self.stop_reason = reason, stop_reason
        self.status = Status.FINISHED
        self.metrics.finished_time = time.time()

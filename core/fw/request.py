"""One generation request as the scheduler tracks it."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

from fw.sampling_params import SamplingParams

_arrival = itertools.count()


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_id: int | None = None
    max_model_len: int = 1 << 30
    priority: int = 0
    prompt: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    # Tokens whose KV is in the cache; the next step computes from here.
    num_computed_tokens: int = 0
    status: Status = Status.WAITING
    finish_reason: str | None = None
    arrival: int = field(default_factory=lambda: next(_arrival))
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    num_preemptions: int = 0

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def append_token(self, token: int, logprob: float | None) -> None:
        """Record a sampled token and decide whether the request is done."""
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()
        self.output_token_ids.append(token)
        if logprob is not None:
            self.output_logprobs.append(logprob)
        n = len(self.output_token_ids)
        stops = token in self.params.stop_token_ids or (not self.params.ignore_eos and token == self.eos_token_id)
        if stops and n >= self.params.min_tokens:
            self.finish_reason = "stop"
        if self.finish_reason is None and (
            (self.params.max_tokens is not None and n >= self.params.max_tokens) or self.num_tokens >= self.max_model_len
        ):
            self.finish_reason = "length"
        if self.finish_reason is not None:
            self.status = Status.FINISHED

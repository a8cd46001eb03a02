"""What generation returns, with vLLM's names."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fw.interfaces.tool_parser import ToolCall


@dataclass
class Logprob:
    """One token's log-probability at one position, as vLLM returns it."""

    logprob: float
    rank: int | None = None  # 1 for the most likely token
    decoded_token: str | None = None


# Per position: {token id: Logprob} for the chosen (or prompt) token and the top-N alternatives.
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[PositionLogprobs] | None = None  # per output token, when asked for
    finish_reason: str | None = None  # "stop", "length", "abort"
    stop_reason: str | int | None = None  # the stop string or token id; "repetition" for a repeating n-gram
    # LLM.chat's reading of ``text`` (fw.tool_calls): the tool calls, and the reasoning a --reasoning-parser split off
    tool_calls: list[ToolCall] | None = None
    reasoning_content: str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """When a request reached each stage, in time.time() seconds, with vLLM's names."""

    arrival_time: float
    last_token_time: float  # the latest output token's; the arrival until the first
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    time_in_queue: float | None = None  # first_scheduled_time - arrival_time
    finished_time: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    first_token_time: float | None = None  # time.monotonic() when the first output token was sampled
    prompt_logprobs: list[PositionLogprobs | None] | None = None  # None for the first prompt token
    metrics: RequestMetrics | None = None
    num_cached_tokens: int | None = None  # prompt tokens the prefix cache served when first scheduled


@dataclass
class BeamSearchSequence:
    token_ids: list[int]
    text: str
    cum_logprob: float
    score: float  # cum_logprob / len(token_ids) ** length_penalty
    finish_reason: str  # "stop" (end of sequence) or "length"


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]  # best first


@dataclass
class PoolingOutput:
    data: Any  # torch.Tensor [hidden] (or [dimensions]): the pooled vector; None for an aborted request


@dataclass
class PoolingRequestOutput:
    """A pooling request's result, as vLLM's ``LLM.encode`` returns it."""

    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    finished: bool
    num_cached_tokens: int | None = None


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """``LLM.embed``'s result: ``outputs.embedding`` as floats (vLLM's names)."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool

    @classmethod
    def from_base(cls, output: PoolingRequestOutput) -> EmbeddingRequestOutput:
        return cls(output.request_id, EmbeddingOutput(output.outputs.data.tolist()), output.prompt_token_ids,
                   output.finished)

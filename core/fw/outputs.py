"""What generation returns, with vLLM's names."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    # Per token, when asked for: {token id: (logprob, rank)} for the chosen token and the top-N alternatives.
    logprobs: list[dict[int, tuple[float, int]]] | None = None
    finish_reason: str | None = None  # "stop", "length", "abort"
    stop_reason: str | int | None = None  # the stop string or token id; "repetition" for a repeating n-gram

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    first_token_time: float | None = None  # time.monotonic() when the first output token was sampled
    prompt_logprobs: list[dict[int, tuple[float, int]] | None] | None = None


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

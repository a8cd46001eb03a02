"""Sampler interface (plugin kind ``fw.sampler``).

Once per step the engine hands the sampler the logits of every request that
produces a token, as one float32 [B, V] tensor, plus a ``SamplingBatch``
describing each row. The sampler returns one token per row. A step whose rows
would all take their argmax (``argmax_suffices``) may skip the sampler. Everything
per-request lives in ``SamplingBatch`` so a sampler can stay vectorised.

A sampler that keeps per-request state (a grammar's automaton, say) learns
of requests through ``add_request`` — called before the request is admitted,
so an invalid constraint is rejected with its reason — and forgets them in
``remove_request``. ``is_ready`` lets slow preparation (compiling a grammar)
happen off the hot path: the scheduler admits the request only once ready.

With speculative decoding, a request's rows are its positions (its last token, then each draft token), each
with ``output_token_ids`` as they would be at that position; ``probabilities`` gives the distributions the
drafts are checked against.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from fw.interfaces.base import Capabilities

if TYPE_CHECKING:
    import torch
    from pydantic import BaseModel

    from fw.sdk.sampling_params import SamplingParams
    from fw.sdk.tokenizer import Tokenizer

API_VERSION = 1

# Feature flags a sampler may declare in ``SamplerCapabilities.features``.
FEATURES = frozenset({"seed", "logprobs", "penalties", "beam", "structured"})


@dataclass(frozen=True)
class SamplerCapabilities(Capabilities):
    KNOWN: ClassVar[dict[str, frozenset[str]]] = {**Capabilities.KNOWN, "features": FEATURES}


class RequestError(Exception):
    """Raised from ``sample`` when some requests cannot go on (their constraint failed to compile, say):
    ``errors`` maps each one's request id to why (a ValueError: the request's own fault). ``LLMEngine.step``
    raises it too, by the client's request ids, before changing any state; ``AsyncEngine`` then fails just those
    requests, and the others step on."""

    def __init__(self, errors: dict[str, Exception]) -> None:
        super().__init__("; ".join(f"{request_id}: {error}" for request_id, error in errors.items()))
        self.errors = errors


@dataclass
class SamplingBatch:
    request_ids: list[str]
    params: list[SamplingParams]  # one per logits row
    temperature: torch.Tensor  # [B] float32; 0 where the row is greedy
    all_greedy: bool
    generators: list[torch.Generator | None]  # per-row seeded generator, or None
    prompt_token_ids: list[list[int]]
    output_token_ids: list[list[int]]  # tokens generated so far, for penalties
    eos_token_id: int | None = None


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None = None  # [B] float32 log-probability of the chosen token
    # Top-N alternatives for rows that asked for logprobs: ids and log-probabilities, [B, N].
    top_token_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None
    ranks: torch.Tensor | None = None  # [B] rank of the chosen token (1 = most likely)


class Sampler(ABC):
    api_version = API_VERSION

    def __init__(self, options: BaseModel | None = None) -> None:
        self.options = options

    def add_request(self, request_id: str, params: SamplingParams, tokenizer: Tokenizer) -> None:
        """A request is about to be admitted; raise ValueError (with the reason) to reject it."""

    def is_ready(self, request_id: str) -> bool:
        """Whether the request may be scheduled (its per-request preparation has finished)."""
        return True

    def remove_request(self, request_id: str) -> None:
        """The request finished or was aborted."""

    @abstractmethod
    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput: ...

    def argmax_suffices(self, request_ids: list[str], params: list[SamplingParams]) -> bool:
        """Whether ``sample`` would give every one of these rows the argmax of its raw logits (the first of equal
        values) and read nothing else of them, so that the engine may skip it and compute only the argmax
        (``ModelBase.greedy_tokens``): greedy, no logprobs, nothing that changes the logits. False unless the sampler
        knows."""
        return False

    def probabilities(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """[B, V] float32: the distribution ``sample`` draws each row's token from, after everything it applies
        (penalties, biases, temperature, truncation), one-hot at the chosen token for greedy rows. Speculative
        decoding verifies draft tokens against it, so without it the engine refuses speculation."""
        raise NotImplementedError(f"{type(self).__name__} does not give its sampling probabilities")

"""A second model that the engine builds for a speculative-decoding proposer (``ProposerContext.load_draft``).

A draft model, or the target checkpoint's multi-token-prediction head, runs on rank 0 between the engine's steps,
with a paged KV cache of its own: its own blocks, of the engine's block size, handed out by the core's block
allocator. The proposer decides what to compute; the runner keeps, per request, the slots of the positions computed
so far (position p holds the KV of the p-th token the proposer gave it).

- ``reserve(request_id, n)``: slots for positions 0..n-1, or False when the cache has no room (then the proposer
  drafts nothing for the request this time).
- ``run(sequences, hidden_states)``: one forward pass over every sequence's new tokens, batched.
- ``rollback(request_id, n)``: keep positions 0..n-1 only (the rest held rejected drafts); their blocks go back.
- ``free(request_id)``: the request is gone (finished, aborted, preempted).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:
    import torch


@dataclass
class DraftSequence:
    request_id: str
    start: int  # the position of token_ids[0]: positions 0..start-1 are in the cache already
    token_ids: list[int]


@dataclass
class DraftOutput:
    logits: torch.Tensor  # [len(sequences), vocab] float32: at each sequence's last new token
    # [len(sequences), hidden]: the model's output hidden state at that token, when the run was given hidden_states
    # (a head that chains reads its own output next); None otherwise.
    hidden: torch.Tensor | None


class DraftRunner(ABC):
    hf_config: dict[str, Any]  # the draft's config.json (for an MTP head: the target's)

    @abstractmethod
    def reserve(self, request_id: str, num_tokens: int) -> bool:
        """Slots for positions 0..num_tokens-1 (kept if there are more already); False when the cache is full."""

    @abstractmethod
    def run(self, sequences: list[DraftSequence], hidden_states: torch.Tensor | None = None) -> DraftOutput:
        """Compute every sequence's new tokens at their positions (slots allocated as needed) in one forward pass.
        ``hidden_states`` [total new tokens, hidden]: the previous depth's state at each of them, for a model that
        reads one (an MTP head); None for a plain draft model."""

    @abstractmethod
    def rollback(self, request_id: str, num_tokens: int) -> None:
        """Keep the first ``num_tokens`` positions of the request; the blocks past them go back to the pool."""

    @abstractmethod
    def free(self, request_id: str) -> None:
        """Drop the request's cache (no-op for an unknown request)."""


class DraftingOptions(BaseModel):
    """The options every proposer that drafts with a model takes (its spec's options model derives from this)."""

    model_config = ConfigDict(extra="forbid")

    draft_temperature: float = Field(
        0.0, ge=0.0,
        description="0: each draft is the draft model's most likely token; above 0: drafts are sampled from its "
        "softmax at this temperature (the rejection rule then weighs them by that distribution).",
    )

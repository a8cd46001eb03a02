"""Speculative-decoding proposer interface (plugin kind ``fw.spec_proposers``).

With speculation on (``speculative_config``), after every step the engine asks the proposer for draft tokens for
each running request that decodes next, up to ``k`` each. The next step computes the request's last token and its
drafts in one forward pass and keeps the longest prefix of drafts that the target model's own sampling accepts,
plus one token of its own: so a proposer only changes speed, never what is generated (greedy output is token for
token the same; sampled output keeps the target's distribution, through the rejection rule of Leviathan et al. and
Chen et al., which needs the proposer's own distribution ``q`` when its drafts are sampled).

A proposer is built once per engine, ``impl(options, context)``: ``options`` is its spec's pydantic model filled
from the ``speculative_config`` keys the core does not read itself (``method``, ``num_speculative_tokens``,
``disable_by_batch_size``): ``prompt_lookup_max`` for ``ngram``, ``model`` for ``draft_model``.
``context`` (``ProposerContext``) says what it drafts for.

Calls, all from the engine's thread:

- ``propose(requests)``: one ``Proposal`` per ``ProposalRequest``, in order; up to ``request.k`` tokens each
  (fewer or none is fine: no drafts means a plain one-token decode step), every id below ``context.vocab_size``.
- ``accepted(request_id, num_drafts, num_accepted)``: after the step that verified the request's drafts: of the
  ``num_drafts`` scheduled, the first ``num_accepted`` were kept (a draft model rolls its own KV back past the rest).
  Drafts the scheduler could not fit in a step count as not scheduled (``num_drafts`` is what it verified).
- ``remove_request(request_id)``: the request finished, was aborted or preempted (it may come back under the same
  id, with every token it had: a preempted request resumes). Drop its state.

A proposer that needs the target model's hidden states (MTP, EAGLE) sets ``needs_hidden_states``; each
``ProposalRequest`` then carries the final hidden states of the positions the latest step computed and kept for it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from fw.interfaces.base import Capabilities

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch
    from pydantic import BaseModel

    from fw.interfaces.draft_runner import DraftRunner

API_VERSION = 1


@dataclass(frozen=True)
class SpecProposerCapabilities(Capabilities):
    pass


@dataclass(frozen=True)
class ProposerContext:
    """What a proposer drafts for, given once when it is built."""

    num_speculative_tokens: int | None  # k as configured; None when the configuration left it to the proposer
    vocab_size: int  # the target's: every draft id must be below it
    max_model_len: int
    device: str
    dtype: torch.dtype  # the target model's
    hf_config: dict[str, Any]  # the target's config.json
    config: Any  # the engine's whole configuration (fw.config.FwConfig): a draft model reads its own cache settings
    # The target model (fw.interfaces.model.ModelBase, on rank 0): MTP and EAGLE heads share its embedding and head.
    target_model: Any = None
    # ``load_draft(model_path, mtp=False) -> fw.interfaces.draft_runner.DraftRunner``: a second model with its own KV
    # cache, built with the engine's configuration (``mtp``: the checkpoint's multi-token-prediction head).
    load_draft: Callable[..., DraftRunner] | None = None


@dataclass
class ProposalRequest:
    """One running request the engine asks drafts for."""

    request_id: str
    token_ids: list[int]  # prompt and output so far; the last one is the token the next step computes first
    num_prompt_tokens: int
    k: int  # the most drafts the engine takes this step (>= 1; less than num_speculative_tokens near a length limit)
    # With ``needs_hidden_states``: [m, hidden], the target's final hidden states at the m positions its latest step
    # computed and kept, positions len(token_ids) - 1 - m .. len(token_ids) - 2 (so the last row predicted the last
    # token); m is the step's prompt chunk, or 1 + the drafts accepted. None otherwise.
    hidden_states: torch.Tensor | None = None


@dataclass
class Proposal:
    token_ids: list[int]  # at most k drafts
    # [len(token_ids), vocab] float32: the distribution each draft was sampled from. None: deterministic drafts
    # (each one has probability 1 under the proposer), as for n-gram lookup or a greedy draft model.
    probs: torch.Tensor | None = None


class SpecProposer(ABC):
    api_version = API_VERSION
    # Whether ``ProposalRequest.hidden_states`` is filled (the runner then keeps every computed position's states).
    needs_hidden_states: ClassVar[bool] = False

    def __init__(self, options: BaseModel | None, context: ProposerContext) -> None:
        self.options = options
        self.context = context
        if context.num_speculative_tokens is None:
            raise ValueError("speculative_config.num_speculative_tokens is required for this method")
        # k: the engine reads it after building, so a proposer whose checkpoint knows it may set it instead.
        self.num_speculative_tokens: int = context.num_speculative_tokens

    @abstractmethod
    def propose(self, requests: list[ProposalRequest]) -> list[Proposal]:
        """One proposal per request, in order."""

    def accepted(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        """The step verified ``num_drafts`` of the request's drafts and kept the first ``num_accepted``."""

    def remove_request(self, request_id: str) -> None:
        """The request finished, was aborted or was preempted."""

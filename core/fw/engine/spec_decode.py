"""Speculative decoding: a proposer plugin drafts tokens, the next step scores them all, the rejection rule keeps a
prefix of them plus one token of the target's own.

After every step the engine asks the proposer (``fw.interfaces.spec_proposer``) for up to k drafts for each request
that decodes next; the scheduler schedules the request's last token and its drafts together (KV slots for all);
the runner returns logits at each of those positions; the sampler gives the target's distribution ``p`` at each
(``Sampler.probabilities``: penalties, biases, temperature and truncation applied, with the drafts before the
position counted as output); then ``rejection_sample`` keeps the accepted drafts and one more token, and the
scheduler rolls the request back past the rejected ones (their KV blocks go back to the pool).

The rule (Leviathan et al. 2023, Chen et al. 2023): draft x drawn from q is accepted with probability
min(1, p(x) / q(x)); at the first rejection the token is drawn from norm(max(p - q, 0)); when every draft is
accepted one more is drawn from p at the position after the last. The kept tokens are then distributed exactly as
the target samples them one at a time. Deterministic drafts (q one-hot) are accepted with probability p(x); for a
greedy request p is one-hot at the argmax, so it keeps exactly the drafts equal to its argmax and then its argmax:
token for token what it generates without speculation.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from fw.config import SpeculativeConfig
from fw.engine.client import EngineError
from fw.interfaces.spec_proposer import Proposal, ProposalRequest, SpecProposer
from fw.request import Request
from fw.scheduler import ScheduledBatch
from fw.sdk.sampling_params import SamplingParams
from fw.step_inputs import StepInputs

log = logging.getLogger("fw")

# speculative_config.disable_by_batch_size when unset, per device: above it a step of drafts costs more than it
# saves. CPU: the default model on 2 cores (benchmarks/spec_decode.py, RESULTS.md) gained 2.1x at 1 request, 1.2x
# at 2 and 4, and lost 12% at 8. No GPU has been measured: there speculation stays on at every batch size.
DISABLE_BY_BATCH_SIZE = {"cpu": 4}

# (p [d + 1, V], drafts [d], q [d, V] or None for deterministic drafts, generator) -> the tokens kept.
AcceptanceRule = Callable[[torch.Tensor, list[int], torch.Tensor | None, torch.Generator | None], list[int]]


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(probs, 1, generator=generator))


def rejection_sample(
    p: torch.Tensor, drafts: list[int], q: torch.Tensor | None, generator: torch.Generator | None
) -> list[int]:
    """The accepted prefix of ``drafts``, then one token of the target's (module docstring)."""
    d = len(drafts)
    if d:
        ids = torch.tensor(drafts)
        p_draft = p[torch.arange(d), ids]
        q_draft = q[torch.arange(d), ids] if q is not None else torch.ones(d)
        # u < p/q, written so that q(x) = 0 (a proposer's own mistake) accepts wherever p(x) > 0.
        rejected = (torch.rand(d, generator=generator) * q_draft >= p_draft).nonzero()
        if len(rejected):
            j = int(rejected[0])
            q_j = q[j] if q is not None else torch.zeros_like(p[j]).index_fill_(0, ids[j], 1.0)
            residual = (p[j] - q_j).clamp_(min=0)
            # p == q leaves no residual (rejection had probability 0, rounding aside): draw from p.
            return drafts[:j] + [_draw(residual if residual.sum() > 0 else p[j], generator)]
    return drafts + [_draw(p[d], generator)]


@dataclass
class SpecDecodeStats:
    """Totals since the engine started, with vLLM's metric names (``fw:spec_decode_*``)."""

    num_drafts: int = 0  # requests' steps that verified drafts
    num_draft_tokens: int = 0  # drafts verified
    num_accepted_tokens: int = 0  # of those, accepted

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None


class SpecDecoder:
    """The engine's speculative decoding: the proposer, what it drafted, the acceptance counters."""

    def __init__(self, config: SpeculativeConfig, proposer: SpecProposer, vocab_size: int, max_model_len: int,
                 device: str) -> None:
        self.proposer = proposer
        self.k = proposer.num_speculative_tokens
        self.disable_by_batch_size = config.disable_by_batch_size or DISABLE_BY_BATCH_SIZE.get(device)
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        # The acceptance rule, an attribute so that a test can swap in a wrong one and see its check fail.
        self.rule: AcceptanceRule = rejection_sample
        self.draft_probs: dict[str, torch.Tensor] = {}
        # Hidden states computed for each request since its latest proposal (needs_hidden_states proposers only).
        self.hidden: dict[str, list[torch.Tensor]] = {}
        self.stats = SpecDecodeStats()

    def check_request(self, params: SamplingParams) -> None:
        """Refuse, by name, what speculation cannot keep exact."""
        if params.structured_outputs is not None:
            raise EngineError(
                "structured output with speculative decoding is not supported (the constraint advances one "
                "token at a time); drop speculative_config or the request's structured_outputs"
            )

    def forget(self, request_id: str) -> None:
        """The request finished, was aborted or preempted."""
        self.draft_probs.pop(request_id, None)
        self.hidden.pop(request_id, None)
        self.proposer.remove_request(request_id)

    def keep_hidden(self, batch: ScheduledBatch, inputs: StepInputs, tokens: list[list[int]], states: torch.Tensor) -> None:
        """Store each request's final hidden states of the positions this step computed and kept (before
        ``Scheduler.update``, which drops the drafts)."""
        sampled = dict(zip(inputs.sample_rows, tokens, strict=True))
        offset = 0
        for i, (request, n) in enumerate(zip(batch.requests, batch.num_new, strict=True)):
            new = sampled.get(i, [None])
            kept = n - len(request.draft_token_ids) + len(new) - 1
            # A copy: a view would keep the step's whole [tokens, hidden] alive while proposals wait (e.g. above
            # disable_by_batch_size).
            self.hidden.setdefault(request.request_id, []).append(states[offset : offset + kept].clone())
            offset += n

    def verify(
        self, requests: list[Request], probs: torch.Tensor, generators: list[torch.Generator | None]
    ) -> list[list[int]]:
        """Per request, the tokens kept: ``probs`` has a row per position (its last token's, then each draft's)."""
        kept, row = [], 0
        for request, generator in zip(requests, generators, strict=True):
            drafts = request.draft_token_ids
            d = len(drafts)
            q = self.draft_probs.pop(request.request_id, None)
            tokens = self.rule(probs[row : row + d + 1], drafts, q[:d] if q is not None and d else None, generator)
            row += d + 1
            kept.append(tokens)
            if d:
                accepted = len(tokens) - 1
                self.stats.num_drafts += 1
                self.stats.num_draft_tokens += d
                self.stats.num_accepted_tokens += accepted
                self.proposer.accepted(request.request_id, d, accepted)
        return kept

    def propose(self, running: list[Request]) -> None:
        """Drafts for each running request whose next step is a decode, for that step to verify."""
        if self.disable_by_batch_size is not None and len(running) > self.disable_by_batch_size:
            return
        asks, owners = [], []
        for request in running:
            # Still computing its prompt, or a pooling request (fw.pooling), which never decodes.
            if request.num_computed_tokens != request.num_tokens - 1 or request.pooling is not None:
                continue
            k = self._limit(request)
            if k < 1:
                continue
            hidden = self.hidden.pop(request.request_id, None)
            asks.append(ProposalRequest(
                request.request_id, request.all_token_ids, len(request.prompt_token_ids), k,
                torch.cat(hidden) if hidden else None,
            ))
            owners.append(request)
        if not asks:
            return
        proposals = self.proposer.propose(asks)
        if len(proposals) != len(asks):
            raise EngineError(f"spec proposer {type(self.proposer).__name__} answered {len(proposals)} of {len(asks)} requests")
        for request, ask, proposal in zip(owners, asks, proposals, strict=True):
            self._check(ask, proposal)
            request.draft_token_ids = list(proposal.token_ids)
            if proposal.probs is not None and proposal.token_ids:
                self.draft_probs[request.request_id] = proposal.probs

    def _limit(self, request: Request) -> int:
        """Drafts worth verifying: none past max_tokens or the context length (a request ends there)."""
        k = min(self.k, self.max_model_len - request.num_tokens - 1)
        max_tokens = request.params.max_tokens
        return k if max_tokens is None else min(k, max_tokens - len(request.output_token_ids) - 1)

    def _check(self, ask: ProposalRequest, proposal: Proposal) -> None:
        """A proposal the engine would compute wrong is the proposer's bug: named, never verified."""
        name = type(self.proposer).__name__
        tokens = proposal.token_ids
        if len(tokens) > ask.k:
            raise EngineError(f"spec proposer {name} drafted {len(tokens)} tokens for {ask.request_id}; at most {ask.k}")
        if any(not 0 <= t < self.vocab_size for t in tokens):
            raise EngineError(f"spec proposer {name} drafted a token id outside the vocabulary [0, {self.vocab_size})")
        if proposal.probs is not None and tuple(proposal.probs.shape) != (len(tokens), self.vocab_size):
            raise EngineError(
                f"spec proposer {name}: probs of shape {tuple(proposal.probs.shape)}, "
                f"expected ({len(tokens)}, {self.vocab_size})"
            )

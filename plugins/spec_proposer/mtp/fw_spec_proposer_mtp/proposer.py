"""Multi-token prediction: the checkpoint's MTP layer (DeepSeek-V3's ``num_nextn_predict_layers``) drafts from the
target's final hidden states.

At position p the head reads the token after it (p + 1) and the hidden state the target computed at p, and
predicts the token after that: fed the rows the target's latest step kept, its output at the last of them is the
first draft. Each further draft feeds the previous one, with the head's own output as the hidden state (one layer,
chained, as vLLM does beyond the checkpoint's layers). The head's KV cache keeps only positions computed from the
target's states: the chained ones are rolled back after every proposal. Positions the target never handed states
for (a prompt prefix served from the prefix cache) are computed from a zero state: drafts there are worse, never
wrong, as the target verifies them.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from fw.interfaces.draft_runner import DraftSequence
from fw.interfaces.spec_proposer import Proposal, ProposalRequest, ProposerContext, SpecProposer
from fw.sdk.drafting import draft_chains
from fw_spec_proposer_mtp.spec import MTPOptions


class MTPProposer(SpecProposer):
    needs_hidden_states = True

    def __init__(self, options: MTPOptions, context: ProposerContext) -> None:
        layers = context.hf_config.get("num_nextn_predict_layers") or 0
        if layers < 1:
            raise ValueError(
                "speculative_config method mtp: the model's config.json declares no multi-token-prediction layers "
                "(num_nextn_predict_layers); use draft_model or ngram"
            )
        # As vLLM: k defaults to the checkpoint's MTP layers.
        super().__init__(options, replace(context, num_speculative_tokens=context.num_speculative_tokens or layers))
        if context.load_draft is None:
            raise ValueError("speculative_config method mtp: this engine builds no MTP head (ProposerContext.load_draft)")
        self.runner = context.load_draft(options.model or context.config.model.model, mtp=True)
        self.valid: dict[str, int] = {}  # request -> positions its head cache holds from the target's states
        self.generator = torch.Generator(context.device).manual_seed(context.config.model.seed)

    def propose(self, requests: list[ProposalRequest]) -> list[Proposal]:
        proposals = [Proposal([]) for _ in requests]
        firsts, states, ready = [], [], []
        for i, request in enumerate(requests):
            prepared = self._prepare(request)
            if prepared is not None:
                firsts.append(prepared[0])
                states.append(prepared[1])
                ready.append(i)
        if not ready:
            return proposals
        ids = [requests[i].request_id for i in ready]
        # The first draft is fed at the request's last token's position.
        positions = [len(requests[i].token_ids) - 1 for i in ready]
        first = self.runner.run(firsts, torch.cat(states))
        drafted = draft_chains(
            self.runner, ids, positions, [requests[i].k for i in ready], first, self.options.draft_temperature,
            self.generator,
        )
        for i, rid, position, proposal in zip(ready, ids, positions, drafted, strict=True):
            proposals[i] = proposal
            self.runner.rollback(rid, position)
            self.valid[rid] = position
        return proposals

    def _prepare(self, request: ProposalRequest) -> tuple[DraftSequence, torch.Tensor] | None:
        """What the head computes for the request before drafting (positions from its cache's end to the one
        before the last token) and the hidden states it reads there; None when it cannot draft."""
        rid, tokens = request.request_id, request.token_ids
        last = len(tokens) - 2  # the position whose output drafts the first token
        if last < 0:
            return None
        context = self.context
        given = request.hidden_states
        if given is None:
            given = torch.empty(0, context.hf_config["hidden_size"], dtype=context.dtype, device=context.device)
        first_given = len(tokens) - 1 - len(given)
        start = min(self.valid.get(rid, 0), first_given, last)
        self.runner.rollback(rid, start)
        self.valid[rid] = start
        # Positions the target handed no state for (served from the prefix cache) read zeros.
        states = torch.cat([given.new_zeros(first_given - start, given.shape[1]), given])
        if not self.runner.reserve(rid, len(tokens) + request.k - 2):
            return None
        return DraftSequence(rid, start, tokens[start + 1 :]), states

    def remove_request(self, request_id: str) -> None:
        self.runner.free(request_id)
        self.valid.pop(request_id, None)

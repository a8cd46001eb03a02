"""Draft-model speculation: a smaller model of the target's tokenizer runs k steps ahead for every request.

Its KV cache (``ProposerContext.load_draft``) holds, per request, the tokens it computed: the prompt and output,
then the drafts of its latest proposal. Each proposal first keeps the positions whose tokens are still those of
the request (the rest, rejected drafts, are rolled back), computes the ones after them up to the request's last
token (the target's token of the latest step and the drafts it accepted) to draft the first token, then one draft
per forward pass; every request's catch-up and drafts go through the same passes.
"""

from __future__ import annotations

import torch

from fw.interfaces.draft_runner import DraftSequence
from fw.interfaces.spec_proposer import Proposal, ProposalRequest, ProposerContext, SpecProposer
from fw.sdk.drafting import common_prefix, draft_chains
from fw.sdk.errors import ModelError
from fw.sdk.tokenizer import Tokenizer
from fw_spec_proposer_draft_model.spec import DraftModelOptions


def _vocabulary(path: str) -> dict[str, int] | None:
    """The tokenizer's vocabulary in ``path``; None when the directory has no tokenizer.json of its own."""
    try:
        return Tokenizer.from_dir(path).get_vocab()
    except ModelError:
        return None


def check_same_vocabulary(draft_path: str, target_tokenizer: str, draft_vocab_size: int, vocab_size: int) -> None:
    """Refuse a draft model whose token ids mean other tokens than the target's: its drafts would be noise."""
    if draft_vocab_size != vocab_size:
        raise ValueError(
            f"speculative_config.model {draft_path}: the draft model's vocab_size {draft_vocab_size} is not the "
            f"target's {vocab_size}; a draft model needs the target's tokenizer and vocabulary"
        )
    draft, target = _vocabulary(draft_path), _vocabulary(target_tokenizer)
    if draft is not None and target is not None and draft != target:
        differ = sorted(set(draft.items()) ^ set(target.items()))[:3]
        raise ValueError(
            f"speculative_config.model {draft_path}: the draft model's tokenizer is not the target's "
            f"(e.g. {', '.join(f'{token!r}={i}' for token, i in differ)}); a draft model needs the target's tokenizer"
        )


class DraftModelProposer(SpecProposer):
    def __init__(self, options: DraftModelOptions, context: ProposerContext) -> None:
        super().__init__(options, context)
        if context.load_draft is None:
            raise ValueError("speculative_config.model: this engine builds no draft model (ProposerContext.load_draft)")
        model = context.config.model
        self.runner = context.load_draft(options.model)
        check_same_vocabulary(
            options.model, model.tokenizer or model.model, self.runner.hf_config["vocab_size"], context.vocab_size
        )
        self.cached: dict[str, list[int]] = {}  # request -> the tokens at the positions its draft cache holds
        self.generator = torch.Generator(context.device).manual_seed(model.seed)

    def propose(self, requests: list[ProposalRequest]) -> list[Proposal]:
        proposals = [Proposal([]) for _ in requests]
        ready = [i for i, r in enumerate(requests) if self._prepare(r)]
        if not ready:
            return proposals
        firsts = []
        for i in ready:
            request = requests[i]
            start = len(self.cached.get(request.request_id, ()))
            firsts.append(DraftSequence(request.request_id, start, request.token_ids[start:]))
        ids = [requests[i].request_id for i in ready]
        lengths = [len(requests[i].token_ids) for i in ready]
        ks = [requests[i].k for i in ready]
        drafted = draft_chains(
            self.runner, ids, lengths, ks, self.runner.run(firsts), self.options.draft_temperature, self.generator
        )
        for i, proposal in zip(ready, drafted, strict=True):
            proposals[i] = proposal
            # The last draft was chosen, never computed: the cache ends at the one before it.
            self.cached[requests[i].request_id] = requests[i].token_ids + proposal.token_ids[:-1]
        return proposals

    def _prepare(self, request: ProposalRequest) -> bool:
        """Roll the request's cache back to the positions still valid; whether it has room for this proposal."""
        rid, tokens = request.request_id, request.token_ids
        # The last token is computed again whatever the cache holds: its logits give the first draft.
        keep = common_prefix(self.cached.get(rid, []), tokens[:-1])
        self.runner.rollback(rid, keep)
        self.cached[rid] = tokens[:keep]
        return self.runner.reserve(rid, len(tokens) + request.k - 1)

    def remove_request(self, request_id: str) -> None:
        self.runner.free(request_id)
        self.cached.pop(request_id, None)

"""Prompt lookup decoding: the context's last n tokens (n from prompt_lookup_max down to prompt_lookup_min) are
looked up in the prompt and output before them; the tokens that followed their latest occurrence are the drafts.

Text that copies its context (summaries, code edits, quoting) repeats long runs, so whole runs are accepted; text
that does not gets no match and no drafts, and decodes as without speculation.
"""

from __future__ import annotations

import torch

from fw.interfaces.spec_proposer import Proposal, ProposalRequest, SpecProposer


def lookup(token_ids: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the longest matching suffix n-gram."""
    tokens = torch.tensor(token_ids, dtype=torch.long)
    length = len(token_ids)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        # Every window of n tokens that starts before the suffix itself, compared with the suffix at once.
        windows = tokens[: length - 1].unfold(0, n, 1)
        hits = (windows == tokens[length - n :]).all(dim=1).nonzero()
        if len(hits):
            start = int(hits[-1]) + n
            return token_ids[start : start + k]
    return []


class NgramProposer(SpecProposer):
    def propose(self, requests: list[ProposalRequest]) -> list[Proposal]:
        lo, hi = self.options.prompt_lookup_min, self.options.prompt_lookup_max
        return [Proposal(lookup(r.token_ids, lo, hi, r.k)) for r in requests]

"""Drafting k tokens per request with a draft runner (``fw.interfaces.draft_runner``), for the proposers that run
a model: every request's next draft comes out of one batched forward pass, k passes in all after the first.

A draft is the argmax of the draft model's logits (temperature 0: deterministic, so the proposal carries no
probabilities and the target accepts it with its own probability of that token), or a sample from its softmax at
a temperature, reported with the distribution it was drawn from (the ``q`` of the rejection rule).
"""

from __future__ import annotations

import torch

from fw.interfaces.draft_runner import DraftOutput, DraftRunner, DraftSequence
from fw.interfaces.spec_proposer import Proposal


def choose(
    logits: torch.Tensor, temperature: float, generator: torch.Generator | None
) -> tuple[list[int], torch.Tensor | None]:
    """Each row's draft, and the float32 distributions they were sampled from (None when chosen greedily)."""
    if temperature == 0:
        return logits.argmax(dim=-1).tolist(), None
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1).tolist(), probs


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def draft_chains(
    runner: DraftRunner,
    request_ids: list[str],
    positions: list[int],
    ks: list[int],
    first: DraftOutput,
    temperature: float,
    generator: torch.Generator | None,
) -> list[Proposal]:
    """Each request's drafts, ``ks[i]`` of them: the first from ``first`` (the output at its last known token),
    each next one from a pass that feeds the previous draft at ``positions[i]`` and on. A runner that chains hidden
    states (``first.hidden`` set: an MTP head) gets each request's own previous output as its hidden state."""
    tokens, probs = choose(first.logits, temperature, generator)
    drafts = [[t] for t in tokens]
    dists = [[] if probs is None else [probs[i]] for i in range(len(tokens))]
    hidden = first.hidden
    for j in range(1, max(ks, default=0)):
        active = [i for i, k in enumerate(ks) if k > j]
        rows = torch.tensor(active, device=hidden.device) if hidden is not None else None
        out = runner.run(
            [DraftSequence(request_ids[i], positions[i] + j - 1, [drafts[i][-1]]) for i in active],
            hidden[rows] if hidden is not None else None,
        )
        tokens, probs = choose(out.logits, temperature, generator)
        for row, i in enumerate(active):
            drafts[i].append(tokens[row])
            if probs is not None:
                dists[i].append(probs[row])
        if hidden is not None:
            hidden[rows] = out.hidden
    return [Proposal(d, torch.stack(q) if q else None) for d, q in zip(drafts, dists, strict=True)]

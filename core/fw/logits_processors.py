"""``allowed_token_ids`` and ``bad_words`` as per-request logits processors.

The engine runs them before the sampler plugin sees the logits, so every
sampler honours them. Each is ``f(output_token_ids, logits[V]) -> logits[V]``,
the ``fw_logits_processors`` hook's form.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from fw.sdk.tokenizer import Tokenizer

LogitsProcessor = Callable[[list[int], torch.Tensor], torch.Tensor]


def bad_words_token_ids(tokenizer: Tokenizer, words: list[str]) -> list[list[int]]:
    """Each word's tokens at the start of a text and after a space, where a word usually tokenizes differently."""
    sequences: list[list[int]] = []
    for word in words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = tokenizer.encode(text, add_special_tokens=False)
            if ids and ids not in sequences:
                sequences.append(ids)
    return sequences


def allow_only(token_ids: list[int]) -> LogitsProcessor:
    keep = torch.tensor(sorted(set(token_ids)))

    def process(output_token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        ids = keep.to(logits.device)
        return torch.full_like(logits, float("-inf")).index_copy_(0, ids, logits[ids])

    return process


def ban_sequences(sequences: list[list[int]]) -> LogitsProcessor:
    """Ban a sequence's last token where the output ends with the rest of it (single tokens: always)."""

    def process(output_token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        n = len(output_token_ids)
        banned = [s[-1] for s in sequences if len(s) - 1 <= n and output_token_ids[n - len(s) + 1 :] == s[:-1]]
        if banned:
            logits = logits.index_fill(0, torch.tensor(banned, device=logits.device), float("-inf"))
        return logits

    return process

"""Incremental detokenization and stop strings.

Decoding one token at a time is wrong for byte-level BPE and multi-byte
characters (a character can span tokens) and for SentencePiece spaces (a
token's text depends on its left neighbour). So each step decodes a short
window — the tokens since the last emitted text plus a few of context — and
emits only the difference, holding it back while it ends in an incomplete
UTF-8 sequence (decoded as U+FFFD).

Stop strings are matched on the text, across token boundaries. While a
request runs, the visible text withholds any tail that could still grow into
a stop string, so a stream never shows a partial stop string.
"""

from __future__ import annotations

from fw.sdk.tokenizer import Tokenizer

# Prompt tokens used as left context for the first output tokens.
CONTEXT_TOKENS = 5
REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
        stop: list[str] | None = None,
        include_stop_str_in_output: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = stop or []
        self.include_stop = include_stop_str_in_output
        self._ids = list(prompt_token_ids[-CONTEXT_TOKENS:])
        self._prefix = 0  # window start: context for the next decode
        self._read = len(self._ids)  # tokens already turned into text
        self.text = ""
        self.stop_reason: str | None = None

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def append(self, token_id: int) -> str | None:
        """Add a generated token; returns the stop string it completed, if any."""
        self._ids.append(token_id)
        before = self._decode(self._ids[self._prefix : self._read])
        after = self._decode(self._ids[self._prefix :])
        if after.endswith(REPLACEMENT) or len(after) <= len(before):
            return None  # an incomplete character, or nothing visible yet
        new = after[len(before) :]
        self._prefix, self._read = self._read, len(self._ids)
        start = max(len(self.text) - max((len(s) for s in self.stop), default=0) + 1, 0)
        self.text += new
        return self._match_stop(start)

    def _match_stop(self, start: int) -> str | None:
        found = [(i, s) for s in self.stop if (i := self.text.find(s, start)) >= 0]
        if not found:
            return None
        index, stop = min(found)
        self.text = self.text[: index + len(stop) if self.include_stop else index]
        self.stop_reason = stop
        return stop

    def visible_text(self, finished: bool) -> str:
        """The text a client may see now: all of it when finished, else without a possible stop-string prefix."""
        if finished or not self.stop:
            return self.text
        held = 0
        for stop in self.stop:
            for n in range(min(len(stop) - 1, len(self.text)), held, -1):
                if self.text.endswith(stop[:n]):
                    held = n
                    break
        return self.text[: len(self.text) - held]

"""Reasoning parser interface (plugin kind ``fw.reasoning_parsers``, chosen by ``--reasoning-parser NAME``).

A reasoning model thinks before it answers (``<think>...</think>answer``). A reasoning parser splits its output
into ``reasoning_content`` and ``content``. The server builds one per request, with the request's tokenizer, and
either ``split``s the whole output or ``feed``s it piece by piece while streaming and ``finish``es it at the end.

A plugin implements ``split``. Its reading of a text says whether the reasoning is over: ``content`` is None while
it goes on (or may yet begin), and a suffix of the text once it has ended ("" when nothing follows it). Streaming
comes from ``split`` (see ``fw.interfaces.streaming``): declare the ``markers`` (the tags), and a stream cut inside
one waits for the rest. The token-level ``is_reasoning_end`` / ``content_token_ids`` come from ``split`` too; they
let a structured-output constraint start where the reasoning ends.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from fw.interfaces.streaming import StreamParser, grown

if TYPE_CHECKING:
    from fw.sdk.tokenizer import Tokenizer

API_VERSION = 1


@dataclass(frozen=True)
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""


class ReasoningParser(StreamParser):
    api_version = API_VERSION
    # False when the tags are special tokens, which the output's text must keep to be split.
    skip_special_tokens: ClassVar[bool] = True
    # The text that ends the reasoning, when there is one: a structured-output constraint starts after it.
    end_marker: ClassVar[str | None] = None

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        super().__init__()
        self.tokenizer = tokenizer
        self._sent = ReasoningDelta()

    @abstractmethod
    def split(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of ``text``, a whole output or a settled prefix of one: reasoning None when the
        text has none; content None while the reasoning goes on, else the suffix of ``text`` after it."""

    def is_reasoning_end(self, token_ids: Sequence[int]) -> bool:
        """Whether the generated tokens ``token_ids`` have ended the reasoning."""
        return self.split(self._decode(token_ids))[1] is not None

    def content_token_ids(self, token_ids: Sequence[int]) -> list[int]:
        """The tokens of ``token_ids`` (generated tokens) after the reasoning: none while it goes on."""
        text = self._decode(token_ids)
        content = self.split(text)[1]
        if content is None:
            return []
        # The fewest leading tokens whose text reaches the content's start (decoded length grows with the count).
        start, lo, hi = len(text) - len(content), 0, len(token_ids)
        while lo < hi:
            mid = (lo + hi) // 2
            if len(self._decode(token_ids[:mid])) >= start:
                hi = mid
            else:
                lo = mid + 1
        return list(token_ids[lo:])

    def _decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=self.skip_special_tokens)

    def _advance(self, text: str) -> ReasoningDelta:
        reasoning, content = self.split(text)
        delta = ReasoningDelta(grown(reasoning or "", self._sent.reasoning), grown(content or "", self._sent.content))
        self._sent = ReasoningDelta(self._sent.reasoning + delta.reasoning, self._sent.content + delta.content)
        return delta

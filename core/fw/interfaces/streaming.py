"""What the two output-parser kinds (tool-call and reasoning parsers) share: parsing a stream of text.

A parser of these kinds states what a whole output means (``extract`` / ``split``); streaming is derived from
that: after each piece of text the parser re-reads the part of the output that more text can no longer change
(``settled``), and sends what that reading adds to what it sent before. So a parser whose reading of a settled
prefix only ever grows as the text grows streams exactly what it returns for the whole text, for any chunking.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import Any, ClassVar


def stable_length(text: str, markers: Iterable[str]) -> int:
    """How much of ``text`` later text cannot change: all but a tail that may be the start of a marker
    ("</thi" of "</think>"), and trailing whitespace (the next text decides whether it belongs to what
    follows, e.g. whitespace dropped beside a tool call)."""
    held = 0
    for marker in markers:
        for size in range(min(len(marker) - 1, len(text)), held, -1):
            if text.endswith(marker[:size]):
                held = size
                break
    return len(text[: len(text) - held].rstrip())


class StreamParser(ABC):
    """Per-request streaming over a whole-text reading: ``feed`` each new piece of output, ``finish`` at its end."""

    # Strings that change the meaning of what follows them; a stream's tail that may begin one waits for more text.
    markers: ClassVar[tuple[str, ...]] = ()

    def __init__(self) -> None:
        self._text = ""

    @property
    def text(self) -> str:
        """The output fed so far."""
        return self._text

    def settled(self, text: str) -> int:
        """The length of the prefix of ``text`` (an unfinished output) whose reading no later text can change.
        Override to hold back more, e.g. a tool call that is open and may yet turn out malformed."""
        return stable_length(text, self.markers)

    def feed(self, delta: str) -> Any:
        """The next piece of output; returns what it adds (the kind's delta type)."""
        self._text += delta
        return self._advance(self._text[: self.settled(self._text)])

    def finish(self) -> Any:
        """The output ended: returns what its held-back tail adds."""
        return self._advance(self._text)

    @abstractmethod
    def _advance(self, text: str) -> Any:
        """Read ``text`` (a settled prefix, or the whole output) and return what it adds to what was sent."""


def grown(now: str, sent: str) -> str:
    """What ``now`` adds to ``sent``; nothing when it does not extend it (a parser that rewrote what it had
    read: the conformance suites fail such a parser, and a server sends nothing rather than garbage)."""
    return now[len(sent) :] if now.startswith(sent) else ""

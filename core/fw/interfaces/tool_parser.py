"""Tool-call parser interface (plugin kind ``fw.tool_parsers``, chosen by ``--tool-call-parser NAME``).

A model asked to call tools writes the calls in its family's own format (Hermes' ``<tool_call>{json}</tool_call>``,
Mistral's ``[TOOL_CALLS][...]``, ...). A tool parser reads that text back into OpenAI tool calls. The server builds
one per request, with the request's tokenizer and ``tools`` (OpenAI tool dicts), and either ``parse``s the whole
output or ``feed``s it piece by piece while streaming and ``finish``es it at the end.

A plugin implements ``extract``: the content and the calls of a whole text. Text that looks like a call but does
not read as one (malformed JSON, say) is content, never an error. Streaming comes from ``extract`` (see
``fw.interfaces.streaming``): declare the ``markers`` that open a call, and override ``settled`` to hold back a
call until it is complete, so that a call is only ever sent once it is known to parse. A call is sent as two
deltas: its id and name (``arguments`` ""), then its arguments.
"""

from __future__ import annotations

import logging
import secrets
from abc import abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from fw.interfaces.streaming import StreamParser, grown

if TYPE_CHECKING:
    from fw.sdk.tokenizer import Tokenizer

API_VERSION = 1

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FunctionCall:
    name: str
    arguments: str  # the arguments object as JSON text, as OpenAI sends it


@dataclass(frozen=True)
class ToolCall:
    id: str
    function: FunctionCall


@dataclass(frozen=True)
class ToolCallResult:
    """A whole output read: ``content`` is its text outside the calls (None when there is none)."""

    content: str | None
    tool_calls: list[ToolCall]


@dataclass(frozen=True)
class CallDelta:
    """One piece of a streamed call, OpenAI's chunk shape: the first of a call carries its id and name."""

    index: int
    id: str | None
    name: str | None
    arguments: str


@dataclass
class ToolDelta:
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


class ToolParser(StreamParser):
    api_version = API_VERSION
    # False when the format's markers are special tokens, which the output's text must keep to be parsed.
    skip_special_tokens: ClassVar[bool] = True

    def __init__(
        self, tokenizer: Tokenizer | None, tools: list[dict[str, Any]], new_id: Callable[[], str] = new_call_id
    ) -> None:
        super().__init__()
        self.tokenizer = tokenizer
        self.tools = tools
        self.new_id = new_id  # tests pass a counter, for ids they can predict
        self._sent_content = ""
        self._sent_calls: list[ToolCall] = []

    @abstractmethod
    def extract(self, text: str) -> tuple[str | None, list[FunctionCall]]:
        """The content and the calls of ``text``, a whole output or a settled prefix of one."""

    def parse(self, text: str) -> ToolCallResult:
        """The calls of a whole output, each with a new id."""
        content, calls = self._extract(text)
        return ToolCallResult(content or None, [ToolCall(self.new_id(), call) for call in calls])

    @property
    def tool_calls(self) -> list[ToolCall]:
        """The calls streamed so far, with the ids they were sent with."""
        return list(self._sent_calls)

    def _extract(self, text: str) -> tuple[str | None, list[FunctionCall]]:
        try:
            return self.extract(text)
        except Exception:  # a parser's bug must not fail the request: its output stays text
            log.exception("%s failed to parse a model output; it is returned as content", type(self).__name__)
            return text, []

    def _advance(self, text: str) -> ToolDelta:
        content, calls = self._extract(text)
        delta = ToolDelta(grown(content or "", self._sent_content))
        self._sent_content += delta.content
        for call in calls[len(self._sent_calls) :]:
            index, sent = len(self._sent_calls), ToolCall(self.new_id(), call)
            self._sent_calls.append(sent)
            delta.calls += [CallDelta(index, sent.id, call.name, ""), CallDelta(index, None, None, call.arguments)]
        return delta

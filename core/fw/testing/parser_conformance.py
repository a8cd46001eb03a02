"""Conformance tests every output parser must pass: tool-call parsers and reasoning parsers.

Subclass the suite of your parser's kind in a test module, name the plugin and give recorded outputs in your
model family's format, each with what it must read as; pytest then runs the whole suite against it::

    from fw.testing.parser_conformance import ToolParserConformance

    class TestMyFormat(ToolParserConformance):
        plugin = "my_format"
        samples = {'Sure.<call>{"name": "f", "args": {"x": 1}}</call>': ("Sure.", [("f", {"x": 1})])}
        malformed = ['<call>{"name": "f", "args": {</call>']  # each must come back whole, as content

    class TestMyThinking(ReasoningParserConformance):
        plugin = "my_thinking"
        samples = {"<reason>why</reason>answer": ("why", "answer")}

Beyond the samples, the suites check what a server relies on: streaming the output in any pieces (one character
at a time, cut anywhere, random chunks; texts made of your markers and pieces of the samples too) sends exactly
what parsing it whole returns, never raising; streamed calls take OpenAI's chunk shape; a reasoning parser's
token-level answers agree with its text. fw's own tests run each suite against a deliberately broken parser.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from functools import cache
from typing import Any, ClassVar

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fw import plugins
from fw.interfaces.reasoning_parser import ReasoningParser
from fw.interfaces.tool_parser import ToolCallResult, ToolParser
from fw.sdk.tokenizer import Tokenizer
from fw.testing.conformance import PluginConformance
from fw.testing.models import write_tokenizer

# Many generated texts, each streamed many ways: a parser is called thousands of times, each call quick. Every
# suite class runs the same inherited test functions, which hypothesis would otherwise take for a mistake.
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.differing_executors])


def pieces(text: str, cuts: Iterable[int]) -> list[str]:
    """``text`` cut at ``cuts`` (positions, any order, repeats allowed)."""
    bounds = [0, *sorted({min(max(c, 0), len(text)) for c in cuts}), len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


def chunkings(text: str) -> list[list[str]]:
    """One character at a time, and every cut of ``text`` in two."""
    return [list(text), *([text[:i], text[i:]] for i in range(1, len(text)))]


@cache
def _parser_class(kind: str, name: str) -> type:
    """Looked up once: the suites build a parser per streamed text, thousands of them."""
    return plugins.load_parser(kind, name)


class ParserConformance(PluginConformance):
    """What both parser kinds share: a tokenizer to build them with, and how the suites stream an output."""

    samples: ClassVar[dict[str, Any]] = {}

    @pytest.fixture(scope="class")
    @classmethod
    def tokenizer(cls, tmp_path_factory) -> Tokenizer:
        path = tmp_path_factory.mktemp("parser-tokenizer")
        write_tokenizer(path)
        return Tokenizer.from_dir(str(path))

    def test_implementation_loads(self) -> None:
        plugins.load_parser(self.kind, self.plugin)  # imports it and checks its base class

    @property
    def parser_class(self) -> type:
        return _parser_class(self.kind, self.plugin)

    def fuzz_texts(self) -> st.SearchStrategy[str]:
        """Texts made of the parser's markers, pieces of the samples and a few odd characters."""
        parts = set(self.parser_class.markers)
        for text in [*self.samples, *getattr(self, "malformed", ())]:
            parts.update({text, text[: len(text) // 2], text[len(text) // 2 :]})
        part = st.one_of(st.sampled_from(sorted(parts)), st.text(alphabet=" \n{}[]<>/\":;,é", max_size=3))
        return st.lists(part, max_size=8).map("".join)

    def test_samples_stream_as_they_parse_in_any_two_pieces_or_one_character_at_a_time(self, tokenizer) -> None:
        for text in [*self.samples, *getattr(self, "malformed", ())]:
            for chunks in chunkings(text):
                self.check_stream(tokenizer, text, chunks)

    @FUZZ
    @given(data=st.data())
    def test_samples_stream_as_they_parse_in_random_chunks(self, tokenizer, data) -> None:
        texts = [*self.samples, *getattr(self, "malformed", ())]
        text = data.draw(st.sampled_from(texts))
        cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=12))
        self.check_stream(tokenizer, text, pieces(text, cuts))

    @FUZZ
    @given(data=st.data())
    def test_any_text_streams_as_it_parses(self, tokenizer, data) -> None:
        text = data.draw(self.fuzz_texts())
        cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=12))
        self.check_stream(tokenizer, text, list(text))
        self.check_stream(tokenizer, text, pieces(text, cuts))

    def check_stream(self, tokenizer: Tokenizer, text: str, chunks: list[str]) -> None:
        raise NotImplementedError


class ToolParserConformance(ParserConformance):
    """``samples``: output text -> (content or None, [(function name, arguments dict), ...]);
    ``malformed``: outputs that look like calls but are not, each read back whole as content; ``tools``: the
    OpenAI tool dicts the parser is built with."""

    kind = "tool_parsers"
    samples: ClassVar[dict[str, tuple[str | None, list[tuple[str, dict[str, Any]]]]]] = {}
    malformed: ClassVar[list[str]] = []
    tools: ClassVar[list[dict[str, Any]]] = []

    def make(self, tokenizer: Tokenizer) -> ToolParser:
        return self.parser_class(tokenizer, self.tools)

    @staticmethod
    def calls(result: ToolCallResult) -> list[tuple[str, dict[str, Any]]]:
        return [(call.function.name, json.loads(call.function.arguments)) for call in result.tool_calls]

    def test_samples_parse(self, tokenizer) -> None:
        assert self.samples, "give recorded outputs of your model family, with what each must read as"
        for text, (content, calls) in self.samples.items():
            result = self.make(tokenizer).parse(text)
            assert (result.content, self.calls(result)) == (content, calls), text

    def test_malformed_calls_are_content(self, tokenizer) -> None:
        for text in self.malformed:
            result = self.make(tokenizer).parse(text)
            assert (result.content, result.tool_calls) == (text, []), text

    def test_each_call_gets_its_own_id(self, tokenizer) -> None:
        parser = self.make(tokenizer)
        ids = [call.id for text in self.samples for call in parser.parse(text).tool_calls]
        assert all(isinstance(i, str) and i for i in ids) and len(set(ids)) == len(ids), ids

    def check_stream(self, tokenizer: Tokenizer, text: str, chunks: list[str]) -> None:
        expected = self.make(tokenizer).parse(text)
        parser = self.make(tokenizer)
        deltas = [parser.feed(chunk) for chunk in chunks] + [parser.finish()]
        content = "".join(d.content for d in deltas)
        streamed: list[dict[str, Any]] = []
        for delta in (c for d in deltas for c in d.calls):
            if delta.index == len(streamed):  # a new call: OpenAI sends its id and name first, no arguments yet
                assert delta.id and delta.name and delta.arguments == "", (text, chunks, delta)
                streamed.append({"id": delta.id, "name": delta.name, "arguments": ""})
            else:
                assert delta.index == len(streamed) - 1 and delta.id is None and delta.name is None, (text, delta)
                streamed[-1]["arguments"] += delta.arguments
        assert content == (expected.content or ""), (text, chunks)
        assert [(c["name"], json.loads(c["arguments"])) for c in streamed] == self.calls(expected), (text, chunks)
        assert [c["id"] for c in streamed] == [c.id for c in parser.tool_calls], "tool_calls lists what was sent"


class ReasoningParserConformance(ParserConformance):
    """``samples``: output text -> (reasoning or None, content or None); content None means the reasoning had
    not ended (a cut-off output), "" that it ended with nothing after."""

    kind = "reasoning_parsers"
    samples: ClassVar[dict[str, tuple[str | None, str | None]]] = {}

    def make(self, tokenizer: Tokenizer) -> ReasoningParser:
        return self.parser_class(tokenizer)

    def test_samples_split(self, tokenizer) -> None:
        assert self.samples, "give recorded outputs of your model family, with what each must read as"
        for text, expected in self.samples.items():
            assert self.make(tokenizer).split(text) == expected, text

    def test_content_is_what_follows_the_reasoning(self, tokenizer) -> None:
        for text in self.samples:
            content = self.make(tokenizer).split(text)[1]
            assert content is None or text.endswith(content), text

    def test_token_level_answers_agree_with_the_text(self, tokenizer) -> None:
        # The reasoning and the content tokenized apart, so that a token boundary falls where the content starts.
        for text in self.samples:
            parser = self.make(tokenizer)
            content = parser.split(text)[1]
            start = len(text) if content is None else len(text) - len(content)
            head, tail = (tokenizer.encode(part, add_special_tokens=False) for part in (text[:start], text[start:]))
            assert parser.is_reasoning_end(head + tail) == (content is not None), text
            assert parser.content_token_ids(head + tail) == (tail if content is not None else []), text

    def check_stream(self, tokenizer: Tokenizer, text: str, chunks: list[str]) -> None:
        reasoning, content = self.make(tokenizer).split(text)
        parser = self.make(tokenizer)
        deltas = [parser.feed(chunk) for chunk in chunks] + [parser.finish()]
        assert "".join(d.reasoning for d in deltas) == (reasoning or ""), (text, chunks)
        assert "".join(d.content for d in deltas) == (content or ""), (text, chunks)

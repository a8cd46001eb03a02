"""Tool calls and reasoning in chat completions, as OpenAI and vLLM define them; shared by `fw serve` and ``LLM.chat``.

A request's ``tools`` are checked (each function's ``parameters`` a valid JSON schema) and its ``tool_choice`` read
(``ToolRequest``): ``none`` renders the tools and reads no calls; ``auto`` lets the model call them in its own format,
read back by the ``--tool-call-parser`` plugin; ``required`` and a named function constrain the output with the
structured-output sampler (a JSON list of calls, or the function's arguments), so the calls always parse, with no
parser. ``OutputReader`` reads a choice's output, whole or streamed: the ``--reasoning-parser`` plugin splits the
reasoning off first, then the tool reader finds the calls in the content.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from jsonschema.exceptions import SchemaError
from jsonschema.validators import validator_for

from fw import plugins
from fw.interfaces.reasoning_parser import ReasoningParser
from fw.interfaces.tool_parser import CallDelta, FunctionCall, ToolCall, ToolParser
from fw.sdk.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    from fw.config import ChatSection
    from fw.interfaces.hooks import EngineView
    from fw.sdk.sampling_params import SamplingParams
    from fw.sdk.tokenizer import Tokenizer

Choice = Literal["none", "auto", "required", "function"]


class ToolCallError(ValueError):
    """A request's tools or tool_choice cannot be served; ``field`` names the request's field (a 400 on the server)."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class ChatParsers:
    """The chat section's parser classes, loaded once (an unknown name fails here, listing the installed ones)."""

    tool_parser: type[ToolParser] | None = None
    reasoning_parser: type[ReasoningParser] | None = None
    auto_tool_choice: bool = False

    @classmethod
    def from_config(cls, chat: ChatSection) -> ChatParsers:
        return cls(
            plugins.load_parser("tool_parsers", chat.tool_call_parser) if chat.tool_call_parser else None,
            plugins.load_parser("reasoning_parsers", chat.reasoning_parser) if chat.reasoning_parser else None,
            chat.enable_auto_tool_choice,
        )


@dataclass(frozen=True)
class ToolRequest:
    """What a request asks of tools: those the template renders, and how the output's calls are made and read."""

    tools: list[dict[str, Any]] | None
    choice: Choice
    function: str | None = None  # the function a named tool_choice forces
    parallel: bool = True  # parallel_tool_calls: False keeps at most one call

    def constraint(self) -> StructuredOutputsParams | None:
        """The structured output that enforces ``required`` or a named function (None for the other choices)."""
        if self.choice == "function":
            return StructuredOutputsParams(json=_parameters(_by_name(self.tools)[self.function]))
        if self.choice != "required":
            return None
        calls = [
            {"type": "object", "properties": {"name": {"type": "string", "enum": [f["name"]]},
                                               "parameters": _parameters(f)},
             "required": ["name", "parameters"]}
            for f in (tool["function"] for tool in self.tools or [])
        ]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if not self.parallel:
            schema["maxItems"] = 1
        return StructuredOutputsParams(json=schema)


def _parameters(function: dict[str, Any]) -> dict[str, Any]:
    # OpenAI: a function without parameters takes none.
    return function.get("parameters") or {"type": "object", "properties": {}}


def _by_name(tools: list[dict[str, Any]] | None) -> dict[str, dict[str, Any]]:
    return {tool["function"]["name"]: tool["function"] for tool in tools or []}


def check_tools(tools: list[dict[str, Any]] | None) -> None:
    """Each tool a function with a name, whose ``parameters`` (if any) is a valid JSON schema."""
    for i, tool in enumerate(tools or []):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(function, dict):
            raise ToolCallError(f'tools[{i}]: expected {{"type": "function", "function": {{...}}}}', "tools")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise ToolCallError(f"tools[{i}].function.name: a function needs a name", "tools")
        schema = function.get("parameters")
        if schema is None:
            continue
        if not isinstance(schema, dict):
            raise ToolCallError(f"tools[{i}] ({name!r}): parameters must be a JSON schema object", "tools")
        try:
            validator_for(schema).check_schema(schema)
        except SchemaError as exc:
            raise ToolCallError(f"tools[{i}] ({name!r}): parameters is not a valid JSON schema: {exc.message}",
                                "tools") from None


def tool_request(
    tools: list[dict[str, Any]] | None,
    tool_choice: Any,
    parallel_tool_calls: bool | None,
    parsers: ChatParsers,
    *,
    server: bool = True,
) -> ToolRequest:
    """A request's tools and tool_choice, checked as vLLM checks them. Unset, tool_choice is ``auto`` with tools
    and ``none`` without. ``server``: auto needs --enable-auto-tool-choice there; offline a tool parser suffices."""
    check_tools(tools)
    parallel = parallel_tool_calls is not False
    if tool_choice is None:
        tool_choice = "auto" if tools and (parsers.tool_parser or server) else "none"
    if tool_choice == "none":
        return ToolRequest(tools or None, "none", parallel=parallel)
    if not tools:
        raise ToolCallError(f"tool_choice {json.dumps(tool_choice)} needs tools", "tool_choice")
    if tool_choice == "auto":
        if parsers.tool_parser is None or (server and not parsers.auto_tool_choice):
            raise ToolCallError('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be '
                                "set", "tool_choice")
        return ToolRequest(tools, "auto", parallel=parallel)
    if tool_choice == "required":
        return ToolRequest(tools, "required", parallel=parallel)
    name = tool_choice.get("function", {}).get("name") if isinstance(tool_choice, dict) else None
    if not isinstance(name, str) or tool_choice.get("type", "function") != "function":
        raise ToolCallError('tool_choice: expected "none", "auto", "required" or {"type": "function", "function": '
                            '{"name": ...}}', "tool_choice")
    if name not in _by_name(tools):
        raise ToolCallError(f"tool_choice: function {name!r} is not among the tools ({', '.join(_by_name(tools))})",
                            "tool_choice")
    return ToolRequest(tools, "function", name, parallel)


def chat_params(params: SamplingParams, request: ToolRequest, parsers: ChatParsers, prompt: str,
                view: EngineView) -> SamplingParams:
    """``params`` as a chat request's ``tools`` need them: constrained for ``required`` or a named function, any
    constraint starting after the reasoning, and the special tokens kept that a parser reads."""
    constraint = request.constraint()
    if constraint is not None:
        if params.structured_outputs is not None:
            raise ToolCallError(f"tool_choice {request.choice!r} constrains the output already: drop response_format "
                                "(or the structured outputs) from the request", "tool_choice")
        if "structured" not in view.sampler_features:
            raise ToolCallError(f"tool_choice {request.choice!r} is enforced with structured output, which the selected "
                                f"sampler {view.selected.get('sampler')!r} lacks: choose one with the 'structured' "
                                "feature (--sampler outlines)", "tool_choice")
        params = dataclasses.replace(params, structured_outputs=constraint)
    if params.structured_outputs is not None:
        params = dataclasses.replace(params, structured_outputs=_after_reasoning(params.structured_outputs, parsers,
                                                                                 prompt))
    readers = [parsers.reasoning_parser, parsers.tool_parser if request.choice == "auto" else None]
    if any(reader is not None and not reader.skip_special_tokens for reader in readers):
        params = dataclasses.replace(params, skip_special_tokens=False)
    return params


def _after_reasoning(structured: StructuredOutputsParams, parsers: ChatParsers,
                     prompt: str) -> StructuredOutputsParams:
    """``structured`` applied after the reasoning (the reasoning parser's end marker), unless the prompt has ended
    the reasoning already (a template that turns thinking off writes the closed tags itself)."""
    marker = parsers.reasoning_parser.end_marker if parsers.reasoning_parser else None
    if not marker or prompt.rstrip().endswith(marker):
        return structured
    return dataclasses.replace(structured, reasoning_end=marker)


# --- reading outputs -------------------------------------------------------------------------------------------


class _RequiredCalls(ToolParser):
    """tool_choice "required": the output is a JSON list of {"name", "parameters"}; each complete item is a call."""

    def _items(self, text: str) -> tuple[list[FunctionCall], int]:
        """The calls of the complete items at the start of the list, and where the last one ends."""
        decoder, calls, end = json.JSONDecoder(), [], 0
        at = len(text) - len(text.lstrip())
        if not text.startswith("[", at):
            return [], 0
        at += 1
        while True:
            at += len(text[at:]) - len(text[at:].lstrip())
            try:
                item, at = decoder.raw_decode(text, at)
            except json.JSONDecodeError:
                return calls, end
            if not isinstance(item, dict) or not isinstance(item.get("name"), str):
                return calls, end
            calls.append(FunctionCall(item["name"], json.dumps(item.get("parameters", {}), ensure_ascii=False)))
            end = at
            at += len(text[at:]) - len(text[at:].lstrip())
            if not text.startswith(",", at):
                return calls, end
            at += 1

    def settled(self, text: str) -> int:
        return self._items(text)[1]

    def extract(self, text: str) -> tuple[str | None, list[FunctionCall]]:
        calls = self._items(text)[0]
        return (None if calls else text), calls


class _NamedCall(ToolParser):
    """A named tool_choice: the whole output is the function's arguments object."""

    def __init__(self, tokenizer: Tokenizer | None, tools: list[dict[str, Any]], name: str) -> None:
        super().__init__(tokenizer, tools)
        self.name = name

    def settled(self, text: str) -> int:
        return 0  # the arguments are known to parse only once the output ends

    def extract(self, text: str) -> tuple[str | None, list[FunctionCall]]:
        try:
            arguments = json.loads(text)
        except json.JSONDecodeError:  # cut short by max_tokens: the text comes back as content
            return text, []
        return None, [FunctionCall(self.name, json.dumps(arguments, ensure_ascii=False))]


@dataclass
class ChatDelta:
    """What a piece of output adds to a chat message: reasoning, content, and tool-call pieces."""

    reasoning: str = ""
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)


@dataclass(frozen=True)
class ChatMessage:
    """A whole output read: ``content`` None when there is none (all of it reasoning or calls)."""

    reasoning: str | None
    content: str | None
    tool_calls: list[ToolCall]


class OutputReader:
    """One choice's output, read as a chat message: reasoning split off first, then tool calls from the content.
    Either ``read`` a whole output, or ``feed`` the pieces of a stream, the last one ``final``."""

    def __init__(self, parsers: ChatParsers, request: ToolRequest, tokenizer: Tokenizer | None) -> None:
        self.reasoning = parsers.reasoning_parser(tokenizer) if parsers.reasoning_parser else None
        self.tools: ToolParser | None = None
        if request.choice == "auto":
            self.tools = parsers.tool_parser(tokenizer, request.tools)
        elif request.choice == "required":
            self.tools = _RequiredCalls(tokenizer, request.tools)
        elif request.choice == "function":
            self.tools = _NamedCall(tokenizer, request.tools, request.function)
        self.parallel = request.parallel

    def read(self, text: str) -> ChatMessage:
        reasoning, content = self.reasoning.split(text) if self.reasoning else (None, text)
        if self.tools is None or content is None:
            return ChatMessage(reasoning, content, [])
        result = self.tools.parse(content)
        calls = result.tool_calls if self.parallel else result.tool_calls[:1]
        return ChatMessage(reasoning, result.content, calls)

    def feed(self, text: str, final: bool = False) -> ChatDelta:
        """What the next piece of a streamed output adds; ``final`` with the output's end (what was held
        back comes out)."""
        delta, content = ChatDelta(), text
        if self.reasoning is not None:
            pieces = [self.reasoning.feed(text), *([self.reasoning.finish()] if final else [])]
            delta.reasoning = "".join(piece.reasoning for piece in pieces)
            content = "".join(piece.content for piece in pieces)
        if self.tools is None:
            delta.content = content
            return delta
        pieces = [self.tools.feed(content), *([self.tools.finish()] if final else [])]
        delta.content = "".join(piece.content for piece in pieces)
        delta.calls = [call for piece in pieces for call in piece.calls if self.parallel or call.index == 0]
        return delta

    @property
    def made_calls(self) -> bool:
        """Whether the output streamed so far holds a call (its finish_reason is then "tool_calls")."""
        return self.tools is not None and bool(self.tools.tool_calls)


def finish_reason(reason: str | None, calls: bool) -> str | None:
    """A choice that ended by itself ("stop") having made calls finishes with "tool_calls", as in OpenAI's API."""
    return "tool_calls" if calls and reason == "stop" else reason

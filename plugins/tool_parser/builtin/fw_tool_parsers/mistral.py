"""Mistral's format: ``[TOOL_CALLS]`` (a control token) then a JSON list of ``{"name", "arguments"}`` objects."""

from __future__ import annotations

import json
import secrets
import string
from collections.abc import Callable
from typing import Any

from fw.interfaces.tool_parser import FunctionCall, ToolParser
from fw_tool_parsers.json_call import function_call

MARKER = "[TOOL_CALLS]"
ALPHANUMERIC = string.ascii_letters + string.digits


def mistral_call_id() -> str:
    """Mistral's chat templates refuse a history whose tool call ids are not 9 letters or digits."""
    return "".join(secrets.choice(ALPHANUMERIC) for _ in range(9))


class Mistral(ToolParser):
    markers = (MARKER,)
    skip_special_tokens = False

    def __init__(self, tokenizer: Any, tools: list[dict[str, Any]], new_id: Callable[[], str] = mistral_call_id):
        super().__init__(tokenizer, tools, new_id)

    def _calls(self, text: str) -> tuple[int, list[FunctionCall]] | None:
        """Where the list after the marker ends, and its calls; None without a marker or a complete, valid list."""
        marker = text.find(MARKER)
        if marker < 0:
            return None
        after = text[marker + len(MARKER) :]
        start = len(text) - len(after.lstrip())
        try:
            items, end = json.JSONDecoder().raw_decode(text, start)
        except ValueError:
            return None
        calls = [function_call(item) for item in items] if isinstance(items, list) and items else [None]
        return None if None in calls else (end, calls)

    def settled(self, text: str) -> int:
        marker = text.find(MARKER)
        if marker >= 0 and self._calls(text) is None:
            text = text[:marker]  # the list is incomplete, or malformed, which only the output's end tells apart
        return super().settled(text)

    def extract(self, text: str) -> tuple[str | None, list[FunctionCall]]:
        found = self._calls(text)
        if found is None:
            return text, []
        end, calls = found
        runs = (text[: text.find(MARKER)], text[end:])
        return "".join(run for run in runs if run.strip()), calls

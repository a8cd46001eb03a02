"""``<function=NAME>{json arguments}</function>``, the format Llama 3.1's model card gives for custom tools.

Text before the first call is content; from it on, the output must be calls (whitespace between them), or the
whole output is content. So while streaming, everything from the first ``<function=`` waits for the output's end.
"""

from __future__ import annotations

import json
import re

from fw.interfaces.tool_parser import FunctionCall, ToolParser

OPEN = "<function="
CALL = re.compile(r"<function=([\w.-]+)>(.*?)</function>\s*", re.S)


def _arguments(text: str) -> str | None:
    """The arguments as JSON text, when ``text`` is a JSON object."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else None


class FunctionTag(ToolParser):
    markers = (OPEN,)

    def settled(self, text: str) -> int:
        start = text.find(OPEN)
        return super().settled(text if start < 0 else text[:start])

    def extract(self, text: str) -> tuple[str | None, list[FunctionCall]]:
        start = text.find(OPEN)
        if start < 0:
            return text, []
        calls, at = [], start
        while at < len(text):
            match = CALL.match(text, at)
            arguments = match and _arguments(match.group(2))
            if arguments is None:
                return text, []
            calls.append(FunctionCall(match.group(1), arguments))
            at = match.end()
        return text[:start].strip() and text[:start], calls

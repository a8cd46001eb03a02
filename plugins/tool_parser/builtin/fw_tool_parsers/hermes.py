"""Hermes' format (Qwen2.5 and Qwen3 use it too): each call a JSON object between ``<tool_call>`` tags, after,
between or before ordinary text."""

from __future__ import annotations

import re

from fw.interfaces.tool_parser import FunctionCall, ToolParser
from fw_tool_parsers.json_call import decode_call

OPEN, CLOSE = "<tool_call>", "</tool_call>"
CALL = re.compile(re.escape(OPEN) + "(.*?)" + re.escape(CLOSE), re.S)


class Hermes(ToolParser):
    markers = (OPEN,)

    def settled(self, text: str) -> int:
        # An open call is undecided until it closes: it may yet be malformed, and then it is content.
        closed = max((match.end() for match in CALL.finditer(text)), default=0)
        opened = text.find(OPEN, closed)
        return super().settled(text if opened < 0 else text[:opened])

    def extract(self, text: str) -> tuple[str | None, list[FunctionCall]]:
        runs, calls, at = [], [], 0
        for match in CALL.finditer(text):
            call = decode_call(match.group(1))
            if call is not None:  # a malformed call stays in the text around it
                runs.append(text[at : match.start()])
                calls.append(call)
                at = match.end()
        runs.append(text[at:])
        # The text between calls is content unless it is only the whitespace that separates them.
        return "".join(run for run in runs if run.strip()) if calls else text, calls

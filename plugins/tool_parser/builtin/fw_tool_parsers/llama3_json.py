"""Llama 3.1/3.2's JSON format: the whole output is calls, ``{"name": ..., "parameters": {...}}`` objects joined by
``;``, optionally after ``<|python_tag|>``. Anything else, a malformed object included, is all content."""

from __future__ import annotations

import json

from fw.interfaces.tool_parser import FunctionCall, ToolParser
from fw_tool_parsers.json_call import function_call

PYTHON_TAG = "<|python_tag|>"


class Llama3Json(ToolParser):
    markers = (PYTHON_TAG,)
    skip_special_tokens = False  # <|python_tag|> is a special token

    def settled(self, text: str) -> int:
        # An output that may be calls is decided only by its end: a call after the first may be malformed.
        body = text.lstrip()
        if body.startswith(("{", PYTHON_TAG)) or PYTHON_TAG.startswith(body):
            return 0
        return super().settled(text)

    def extract(self, text: str) -> tuple[str | None, list[FunctionCall]]:
        body = text.strip().removeprefix(PYTHON_TAG).lstrip()
        calls: list[FunctionCall] = []
        decoder, at = json.JSONDecoder(), 0
        while body.startswith("{", at):
            try:
                obj, at = decoder.raw_decode(body, at)
            except ValueError:
                return text, []
            call = function_call(obj, "arguments" if isinstance(obj, dict) and "arguments" in obj else "parameters")
            if call is None:
                return text, []
            calls.append(call)
            rest = body[at:].lstrip()
            at = len(body) - len(rest[1:].lstrip()) if rest.startswith(";") else len(body) - len(rest)
        return (None, calls) if calls and at == len(body) else (text, [])

"""The pythonic format (Llama 3.2 and 4, ToolACE, ...): the whole output a Python list of calls with keyword
arguments, ``[get_weather(city="Paris"), get_time()]``. Read with ``ast``: only literals, nothing is evaluated."""

from __future__ import annotations

import ast
import json

from fw.interfaces.tool_parser import FunctionCall, ToolParser


def _call(node: ast.expr) -> FunctionCall | None:
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
        return None
    try:
        arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg is not None}
        if len(arguments) != len(node.keywords):  # **kwargs
            return None
        return FunctionCall(node.func.id, json.dumps(arguments, ensure_ascii=False, allow_nan=False))
    except (ValueError, TypeError, SyntaxError, RecursionError):  # not a literal, or not JSON (a set, bytes, inf)
        return None


class Pythonic(ToolParser):
    def settled(self, text: str) -> int:
        # An output that may be a call list is decided only by its end.
        return 0 if text.lstrip().startswith("[") else super().settled(text)

    def extract(self, text: str) -> tuple[str | None, list[FunctionCall]]:
        body = text.strip()
        if not body.startswith("["):
            return text, []
        try:
            tree = ast.parse(body, mode="eval").body
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            return text, []
        calls = [_call(node) for node in tree.elts] if isinstance(tree, ast.List) and tree.elts else [None]
        return (text, []) if None in calls else (None, calls)

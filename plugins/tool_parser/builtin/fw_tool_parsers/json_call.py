"""A call read from a decoded JSON object, the shape the JSON formats share."""

from __future__ import annotations

import json
from typing import Any

from fw.interfaces.tool_parser import FunctionCall


def function_call(obj: Any, arguments_key: str = "arguments") -> FunctionCall | None:
    """``{"name": ..., arguments_key: {...}}`` as a call (no arguments: ``{}``); None when ``obj`` is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    arguments = obj.get(arguments_key, {})
    if not isinstance(arguments, dict):
        return None
    try:
        return FunctionCall(obj["name"], json.dumps(arguments, ensure_ascii=False, allow_nan=False))
    except ValueError:  # NaN or Infinity, which JSON has no text for
        return None


def decode_call(text: str, arguments_key: str = "arguments") -> FunctionCall | None:
    """The call one JSON object's ``text`` holds; None when it is not valid JSON or not a call."""
    try:
        return function_call(json.loads(text), arguments_key)
    except ValueError:
        return None

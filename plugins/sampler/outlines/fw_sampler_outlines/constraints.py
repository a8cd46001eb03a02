"""Constraints -> the regexes outlines-core compiles, with the cheap up-front checks that reject bad input."""

from __future__ import annotations

import json
import math
from typing import Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError
from outlines_core.json_schema import WHITESPACE, build_regex_from_schema

try:
    from re import _parser as _sre  # Python 3.11+
except ImportError:
    import sre_parse as _sre  # type: ignore[no-redef]

# Python `re` features that outlines-core's (Rust) regex engine cannot turn into an automaton.
_UNSUPPORTED_REGEX = {
    "AT": "anchors (^, $, \\A, \\Z, \\b) are",
    "ASSERT": "lookaround is",
    "ASSERT_NOT": "lookaround is",
    "GROUPREF": "backreferences are",
    "GROUPREF_EXISTS": "conditional groups are",
    "ATOMIC_GROUP": "atomic groups are",
    "POSSESSIVE_REPEAT": "possessive quantifiers are",
}
_REGEX_META = set("\\.+*?()|[]{}^$#&-~")

_JSON_STRING = r'"([^"\\\x00-\x1F]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*"'
_JSON_SCALAR = rf"{_JSON_STRING}|-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?|true|false|null"
# Containers inside a json_object answer nest this deep. The automaton grows steeply with depth: outlines-core's
# own {"type": "object"} regex (3 levels) takes ~6 s to index against a 32k vocabulary, 1 level ~0.3 s.
JSON_OBJECT_NESTING = 1

_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
# A JSON schema is walked recursively (validation, regex building): bound its shape before anything does.
MAX_SCHEMA_DEPTH = 64
MAX_SCHEMA_VALUES = 10_000
# Keys whose values are data, not subschemas.
_DATA_KEYS = ("const", "enum", "default", "examples")


def _nodes(pattern: str):
    """Every (opcode name, argument) of a regex's parse tree (Python's parser, standing in for outlines-core's)."""
    try:
        tree = _sre.parse(pattern)
    except (_sre.error, RecursionError) as e:
        raise ValueError(f"invalid regex: {e}") from None
    stack: list[Any] = [tree]
    while stack:
        item = stack.pop()
        if isinstance(item, _sre.SubPattern):
            for op, arg in item:
                yield op.name, arg
                stack.append(arg)
        elif isinstance(item, (list, tuple)):
            stack.extend(item)


def check_regex(pattern: str) -> None:
    """Reject, with the reason, a regex that cannot constrain output: unparsable or using a feature automata lack.

    Python's parser stands in for outlines-core's, whose errors only come after the (slow) compilation;
    patterns have to be in the syntax the two share.
    """
    for op, _arg in _nodes(pattern):
        if op in _UNSUPPORTED_REGEX:
            raise ValueError(
                f"invalid regex: {_UNSUPPORTED_REGEX[op]} not supported (the whole output must match the pattern)"
            )


def check_size(regex: str, max_length: int, max_repeat: int) -> None:
    """Bound what a regex's automaton can grow from: the regex's length and each counted repetition {m,n}
    (against a 49k-token vocabulary, "[^"]{0,100}" compiles in 0.9 s to 27 MB, {0,1000} in 9 s to 366 MB)."""
    if len(regex) > max_length:
        raise ValueError(f"constraint too large: its regex has {len(regex)} characters, at most {max_length} "
                         "(the outlines sampler's max_regex_length)")
    for op, arg in _nodes(regex):
        if op in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT"):
            low, high = arg[0], arg[1]
            count = low if high == _sre.MAXREPEAT else high  # {m,}: m copies, then an unbounded loop
            if count > max_repeat:
                raise ValueError(f"constraint too large: a repetition of up to {count}, at most {max_repeat} "
                                 "(the outlines sampler's max_repeat; an unbounded * or + costs nothing)")


def choice_regex(choices: list[str]) -> str:
    """An alternation matching exactly one of ``choices``, escaped for outlines-core's regex syntax."""
    return "(" + "|".join("".join("\\" + c if c in _REGEX_META else c for c in s) for s in choices) + ")"


def json_object_regex(whitespace: str | None = None, nesting: int = JSON_OBJECT_NESTING) -> str:
    """Any JSON object whose values nest objects/arrays at most ``nesting`` levels deep."""
    ws = whitespace or WHITESPACE

    def obj(value: str) -> str:
        member = f"{_JSON_STRING}{ws}:{ws}({value})"
        return rf"\{{{ws}({member}({ws},{ws}{member})*)?{ws}\}}"

    def arr(value: str) -> str:
        return rf"\[{ws}(({value})({ws},{ws}({value}))*)?{ws}\]"

    value = _JSON_SCALAR
    for _ in range(nesting):
        value = f"{_JSON_SCALAR}|{obj(value)}|{arr(value)}"
    return obj(value)


def _digit_class(lo: str, hi: str) -> str:
    return lo if lo == hi else f"[{lo}-{hi}]"


def _any_digits(count: int) -> str:
    return "" if count == 0 else "[0-9]" if count == 1 else f"[0-9]{{{count}}}"


def _same_length(lo: str, hi: str) -> list[str]:
    """Alternatives spelling every digit string from ``lo`` to ``hi`` (equal lengths, lo <= hi)."""
    if lo == hi:
        return [lo]
    width = len(lo) - 1
    if lo[1:] == "0" * width and hi[1:] == "9" * width:
        return [_digit_class(lo[0], hi[0]) + _any_digits(width)]
    if lo[0] == hi[0]:
        return [lo[0] + rest for rest in _same_length(lo[1:], hi[1:])]
    out = [lo[0] + rest for rest in _same_length(lo[1:], "9" * width)]
    if int(hi[0]) - int(lo[0]) > 1:
        out.append(_digit_class(str(int(lo[0]) + 1), str(int(hi[0]) - 1)) + _any_digits(width))
    return out + [hi[0] + rest for rest in _same_length("0" * width, hi[1:])]


def _magnitudes(lo: int, hi: int | None) -> str:
    """A group matching the integers in [lo, hi] (hi None: unbounded), lo >= 0, unsigned, no leading zeros."""
    out: list[str] = []
    while hi is None or lo <= hi:
        digits = len(str(lo))
        top = 10**digits - 1 if hi is None else min(hi, 10**digits - 1)
        out += _same_length(str(lo), str(top))
        if hi is None:
            out.append(f"[1-9][0-9]{{{digits},}}")  # every longer number
            break
        lo = top + 1
    return "(" + "|".join(out) + ")"


def _unsigned(lo: int, hi: int | None, fraction: bool) -> str:
    """Non-negative decimals in [lo, hi]: integers, or with ``fraction`` any fixed-point number."""
    if not fraction:
        return _magnitudes(lo, hi)
    if hi is None:
        return rf"{_magnitudes(lo, None)}(\.[0-9]+)?"
    below = [rf"{_magnitudes(lo, hi - 1)}(\.[0-9]+)?"] if lo < hi else []
    return "(" + "|".join([*below, rf"{hi}(\.0+)?"]) + ")"


def bounded_number_regex(schema: dict[str, Any]) -> str:
    """An integer/number schema's bounds as a regex (outlines-core 0.2 ignores minimum/maximum).

    Bounds become integers: exact for integers and for numbers with whole inclusive bounds; otherwise a
    number's range narrows to the whole numbers inside it (``minimum: 0.5`` allows 1 and up), so every
    output still validates. Bounded numbers are written without exponents.
    """
    if not all(math.isfinite(schema[k]) for k in _BOUNDS if k in schema):
        raise ValueError(f"unsupported JSON schema: bounds must be finite numbers, got {json.dumps(schema)}")
    lo = hi = None
    if "minimum" in schema:
        lo = math.ceil(schema["minimum"])
    if "exclusiveMinimum" in schema:
        lo = max(lo if lo is not None else -math.inf, math.floor(schema["exclusiveMinimum"]) + 1)
    if "maximum" in schema:
        hi = math.floor(schema["maximum"])
    if "exclusiveMaximum" in schema:
        hi = min(hi if hi is not None else math.inf, math.ceil(schema["exclusiveMaximum"]) - 1)
    if lo is not None and hi is not None and lo > hi:
        raise ValueError(f"unsupported JSON schema: no whole number satisfies {json.dumps(schema)}")
    fraction = schema["type"] == "number"
    sides = []
    if lo is None or lo < 0:  # negatives, by magnitude: -x in [lo, hi] <=> x in [-hi, -lo]
        smallest = 0 if fraction else 1  # "-0.5" exists, "-0" adds nothing
        sides.append(
            "-"
            + _unsigned(max(smallest, -hi) if hi is not None else smallest, -lo if lo is not None else None, fraction)
        )
    if hi is None or hi >= 0:
        sides.append(_unsigned(max(lo, 0) if lo is not None else 0, hi, fraction))
    return "(" + "|".join(sides) + ")"


def _check_shape(schema: Any) -> None:
    values = 0
    stack = [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        values += 1
        if depth > MAX_SCHEMA_DEPTH or values > MAX_SCHEMA_VALUES:
            raise ValueError(f"unsupported JSON schema: nested deeper than {MAX_SCHEMA_DEPTH} or holding more than "
                             f"{MAX_SCHEMA_VALUES} values")
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        stack.extend((child, depth + 1) for child in children)


def schema_regex(schema: str | dict[str, Any], whitespace: str | None = None) -> str:
    """Validate a JSON schema and turn it into a regex; ValueError says what is wrong."""
    try:
        parsed = json.loads(schema) if isinstance(schema, str) else schema
        _check_shape(parsed)
        Draft202012Validator.check_schema(parsed)
    except (json.JSONDecodeError, RecursionError) as e:
        raise ValueError(f"invalid JSON schema: not JSON ({e})") from None
    except SchemaError as e:
        raise ValueError(f"invalid JSON schema: {e.message}") from None

    # Bounded numbers go to outlines-core as string constants, swapped for our own regex afterwards.
    bounded: dict[str, str] = {}

    def rewrite(node: Any) -> Any:
        if isinstance(node, list):
            return [rewrite(item) for item in node]
        if not isinstance(node, dict):
            return node
        if node.get("type") in ("integer", "number") and any(k in node for k in _BOUNDS):
            marker = f"FWBOUNDED{len(bounded)}"
            bounded[marker] = bounded_number_regex(node)
            return {"const": marker}
        return {k: v if k in _DATA_KEYS else rewrite(v) for k, v in node.items()}

    try:
        regex = build_regex_from_schema(json.dumps(rewrite(parsed)), whitespace)
    except (ValueError, TypeError) as e:  # TypeError: values JSON lacks (NaN, Infinity)
        raise ValueError(f"unsupported JSON schema: {(str(e).splitlines() or [type(e).__name__])[0]}") from None
    for marker, number in bounded.items():
        regex = regex.replace(f'"{marker}"', number)
    return regex

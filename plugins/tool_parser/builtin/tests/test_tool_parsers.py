"""The built-in tool-call parsers against outputs written the way each model family writes its calls."""

import json

import pytest

from fw import plugins
from fw.interfaces.spec import PluginError
from fw.testing.parser_conformance import ToolParserConformance

WEATHER = {"city": "Paris", "unit": "celsius"}
NESTED = {"filter": {"tags": ["a", "b"], "range": {"from": 1, "to": 2.5}}, "dry_run": False, "note": None}
UNICODE = {"text": "naïve café — 東京 🚀", "quote": 'she said "hi"'}
# The calls as the JSON formats write them (hermes, mistral), in the key order models use.
WEATHER_CALL = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
SEARCH_CALL = '{"name": "search", "arguments": ' + json.dumps(NESTED) + "}"
TRANSLATE_CALL = '{"name": "translate", "arguments": ' + json.dumps(UNICODE, ensure_ascii=False) + "}"


class TestHermes(ToolParserConformance):
    plugin = "hermes"
    samples = {
        # Qwen2.5 / Qwen3: the JSON on its own line between the tags, calls one per block.
        f"<tool_call>\n{WEATHER_CALL}\n</tool_call>": (None, [("get_weather", WEATHER)]),
        f"Let me look both up.\n<tool_call>\n{WEATHER_CALL}\n</tool_call>\n<tool_call>\n{SEARCH_CALL}\n</tool_call>":
            ("Let me look both up.\n", [("get_weather", WEATHER), ("search", NESTED)]),
        f"<tool_call>{TRANSLATE_CALL}</tool_call>": (None, [("translate", UNICODE)]),
        # A tag inside an argument's string does not end the call.
        '<tool_call>{"name": "echo", "arguments": {"s": "<tool_call>"}}</tool_call> Done.':
            (" Done.", [("echo", {"s": "<tool_call>"})]),
        '<tool_call>{"name": "now"}</tool_call>': (None, [("now", {})]),
        "No tools needed: 2 + 2 = 4.": ("No tools needed: 2 + 2 = 4.", []),
    }
    malformed = [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"\n</tool_call>',
        "<tool_call>not json at all</tool_call>",
        '<tool_call>{"arguments": {"city": "Paris"}}</tool_call>',  # no name
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Par',  # cut off
    ]

    def test_a_malformed_call_beside_a_good_one_stays_text(self, tokenizer):
        bad = '<tool_call>{"name": "f", "arguments": {</tool_call>'
        result = self.make(tokenizer).parse(bad + '\n<tool_call>{"name": "g", "arguments": {}}</tool_call>')
        assert (result.content, self.calls(result)) == (bad + "\n", [("g", {})])


class TestLlama3Json(ToolParserConformance):
    plugin = "llama3_json"
    samples = {
        '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}': (None, [("get_weather", WEATHER)]),
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
        '{"name": "search", "parameters": ' + json.dumps(NESTED) + "}": (None, [("get_weather", WEATHER), ("search", NESTED)]),
        '{"name": "translate", "arguments": ' + json.dumps(UNICODE) + "}": (None, [("translate", UNICODE)]),
        "The capital of France is Paris.": ("The capital of France is Paris.", []),
    }
    malformed = [
        '{"name": "get_weather", "parameters": {"city": "Paris"}; {"name": "search", "parameters": {',
        '{"name": "get_weather", "parameters": {"city": "Paris"}} and then some words',
        '{"answer": 42}',  # JSON, but not a call
    ]


class TestMistral(ToolParserConformance):
    plugin = "mistral"
    samples = {
        f"[TOOL_CALLS] [{WEATHER_CALL}]": (None, [("get_weather", WEATHER)]),
        f"Checking.[TOOL_CALLS][{WEATHER_CALL}, {SEARCH_CALL}]": ("Checking.", [("get_weather", WEATHER), ("search", NESTED)]),
        f"[TOOL_CALLS][{TRANSLATE_CALL}]": (None, [("translate", UNICODE)]),
        "Paris is sunny today.": ("Paris is sunny today.", []),
    }
    malformed = [
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}]',
        '[TOOL_CALLS] {"name": "get_weather", "arguments": {}}',  # not a list
        "[TOOL_CALLS] []",
    ]

    def test_call_ids_are_what_mistral_templates_accept(self, tokenizer):
        (call,) = self.make(tokenizer).parse(next(iter(self.samples))).tool_calls
        assert len(call.id) == 9 and call.id.isalnum()


class TestPythonic(ToolParserConformance):
    plugin = "pythonic"
    samples = {
        '[get_weather(city="Paris", unit="celsius")]': (None, [("get_weather", WEATHER)]),
        "[get_weather(city='Paris', unit='celsius'), search(filter={'tags': ['a', 'b'], 'range': {'from': 1, "
        "'to': 2.5}}, dry_run=False, note=None)]": (None, [("get_weather", WEATHER), ("search", NESTED)]),
        "[translate(text='naïve café — 東京 🚀', quote='she said \"hi\"'), now()]":
            (None, [("translate", UNICODE), ("now", {})]),
        "[1, 2, 3] are the first numbers.": ("[1, 2, 3] are the first numbers.", []),
        "Nothing to call.": ("Nothing to call.", []),
    }
    malformed = [
        '[get_weather(city="Paris"',
        "[get_weather('Paris')]",  # positional arguments
        "[get_weather(city=os.getcwd())]",  # not a literal: never evaluated
        "[get_weather(city={1, 2})]",  # a set has no JSON
        "[1, 2, 3]",
    ]


def test_the_formats_whose_markers_are_special_tokens_keep_them_in_the_text():
    kept = {name for name in ("hermes", "llama3_json", "mistral", "pythonic")
            if not plugins.load_parser("tool_parsers", name).skip_special_tokens}
    assert kept == {"llama3_json", "mistral"}


def test_an_unknown_parser_names_the_installed_ones():
    with pytest.raises(PluginError, match=r"unknown tool-call parser 'nope' \(installed: .*hermes, .*pythonic"):
        plugins.load_parser("tool_parsers", "nope")

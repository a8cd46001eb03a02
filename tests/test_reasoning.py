"""Reasoning output through `fw serve` (official openai client) and ``LLM.chat``: --reasoning-parser splits
reasoning_content from content, streaming and not, and composes with tool calls and with constraints, which apply
only once the reasoning has ended.

Outputs are scripted (fw.testing.scripted forces a request's text by its seed); a script that ends "free" hands
the rest of the output to sampling, under the request's constraint.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
import test_tools
from test_tools import MAX_TOKENS, MESSAGES, SCHEMAS, TOOLS, arguments, tools_server

CALL = '<tool_call>{"name": "get_time", "arguments": {"zone": "cet"}}</tool_call>'
SCRIPTS = {
    11: {"text": "<think>The user greets me.</think>Hello there."},
    12: {"text": "Just an answer."},  # qwen3: no <think> opening the output, so no reasoning
    13: {"text": "<think>Time needs the tool.</think>" + CALL},
    14: {"text": "<think>A plan.</think>", "then": "free"},  # the constraint takes over after the tag
    15: {"text": "<think>Still thinking", "then": "free"},
}
ANSWER = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}


model = test_tools.model  # the same checkpoint fixture


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    with tools_server(model, tmp_path_factory.mktemp("reasoning"), SCRIPTS, "--reasoning-parser", "qwen3") as (base, _):
        yield base


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0, timeout=120)


def message(client, seed: int, **kwargs):
    return client.chat.completions.create(model="tiny", messages=MESSAGES, seed=seed, max_tokens=MAX_TOKENS, **kwargs)


def streamed(client, seed: int, **kwargs) -> tuple[str, str, list, str]:
    """(reasoning, content, tool-call pieces, finish_reason) of a streamed answer."""
    chunks = [c for c in message(client, seed, stream=True, **kwargs) if c.choices]
    deltas = [c.choices[0].delta for c in chunks]
    reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    pieces = [tc for d in deltas for tc in d.tool_calls or []]
    return reasoning, "".join(d.content or "" for d in deltas), pieces, chunks[-1].choices[0].finish_reason


def test_reasoning_and_content_split(client):
    out = message(client, 11).choices[0]
    assert out.message.reasoning_content == "The user greets me." and out.message.content == "Hello there."
    assert out.finish_reason == "stop"


def test_the_stream_splits_the_same_although_cut_inside_the_tags(client, server):
    # The tags are several tokens each here, so the stream's pieces end inside them.
    tag = httpx.post(f"{server}/tokenize", json={"prompt": "</think>", "add_special_tokens": False}, timeout=60)
    assert tag.json()["count"] > 1
    assert streamed(client, 11) == ("The user greets me.", "Hello there.", [], "stop")


def test_an_output_without_reasoning_is_all_content(client):
    out = message(client, 12).choices[0].message
    assert out.reasoning_content is None and out.content == "Just an answer."
    assert streamed(client, 12)[:2] == ("", "Just an answer.")


def test_reasoning_then_a_tool_call(client):
    out = message(client, 13, tools=TOOLS).choices[0]
    assert out.message.reasoning_content == "Time needs the tool." and out.message.content is None
    (call,) = out.message.tool_calls
    assert call.function.name == "get_time" and arguments(call) == {"zone": "cet"}
    assert out.finish_reason == "tool_calls"
    reasoning, content, pieces, finish = streamed(client, 13, tools=TOOLS)
    assert (reasoning, content, finish) == ("Time needs the tool.", "", "tool_calls")
    assert [p.function.name for p in pieces if p.id] == ["get_time"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_response_format_applies_after_the_reasoning(client, stream):
    """The scripted reasoning is free text that the JSON schema would forbid; the answer after it must follow it."""
    response_format = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}}
    for _ in range(5):
        if stream:
            reasoning, content, _, finish = streamed(client, 14, response_format=response_format, temperature=1.0)
        else:
            out = message(client, 14, response_format=response_format, temperature=1.0).choices[0]
            reasoning, content, finish = out.message.reasoning_content, out.message.content, out.finish_reason
        assert reasoning == "A plan." and finish == "stop"
        jsonschema.validate(json.loads(content), ANSWER)


def test_tool_choice_required_applies_after_the_reasoning(client):
    for _ in range(5):
        out = message(client, 14, tools=TOOLS, tool_choice="required", temperature=1.0).choices[0]
        assert out.message.reasoning_content == "A plan." and out.message.tool_calls
        for call in out.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_reasoning_cut_by_max_tokens_has_no_content(client):
    out = client.chat.completions.create(model="tiny", messages=MESSAGES, seed=15, max_tokens=12).choices[0]
    assert out.finish_reason == "length" and out.message.content is None
    assert "Still thinking".startswith(out.message.reasoning_content[:8]) and out.message.reasoning_content


def test_offline_chat_splits_the_reasoning(model, monkeypatch):
    import fw.testing.scripted as scripted
    from fw import LLM, SamplingParams, plugins

    monkeypatch.setenv("FW_TEST_SCRIPTS", json.dumps(SCRIPTS))
    manager = plugins.get_plugin_manager()
    name = manager.register(scripted)
    try:
        llm = LLM(model, reasoning_parser="deepseek_r1", num_kv_blocks=64, max_model_len=1024, device="cpu")
        try:
            (out,) = llm.chat(MESSAGES, SamplingParams(seed=11, max_tokens=MAX_TOKENS), use_tqdm=False)
        finally:
            llm.shutdown()
    finally:
        manager.unregister(name=name)
    comp = out.outputs[0]
    assert comp.reasoning_content == "The user greets me." and comp.tool_calls is None
    assert comp.text == SCRIPTS[11]["text"]

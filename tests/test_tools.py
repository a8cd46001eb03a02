"""Tool calling through `fw serve` with the official openai client, and through ``LLM.chat`` (fw.tool_calls).

The model is the tiny random-weight Llama with a Hermes-style template (fw.testing.models.TOOLS_TEMPLATE). A random
model never decides to call a tool, so ``auto`` runs on scripted outputs (fw.testing.scripted forces a request's
text by its seed) read back by the hermes parser; ``required`` and a named function run on free sampling, which the
structured-output constraint must keep valid.
"""

from __future__ import annotations

import json
import os

import httpx
import jsonschema
import openai
import pytest

from conftest import fw_serve, make_site, run_fw
from fw.testing.models import TOOLS_TEMPLATE

# Bounded strings and enums: a random model at temperature 1 writes long strings, and the JSON must close within
# max_tokens for the output to parse (a cut output comes back as content with finish_reason "length", as in vLLM).
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}</tool_call>'
# Scripted outputs, by request seed (fw.testing.scripted).
SCRIPTS = {
    1: {"text": CALL},
    2: {"text": "It is 18 degrees in Paris."},
    3: {"text": "Let me check." + CALL + '\n<tool_call>{"name": "get_time", "arguments": {"zone": "utc"}}</tool_call>'},
    4: {"text": '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>'},  # malformed
}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
# Enough for every call the schemas allow: the longest list of calls plus separators stays well below it.
MAX_TOKENS = 160


def scripted_site(root) -> dict[str, str]:
    """The environment of a server whose requests with a SCRIPTS seed write their script."""
    site = make_site(root, "fw-scripted", {"fw.hooks": {"scripted": "fw.testing.scripted"}}, {})
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])),
            "FW_TEST_SCRIPTS": json.dumps(SCRIPTS)}


SERVE = ("--served-model-name", "tiny", "--num-kv-blocks", "128", "--max-model-len", "1024", "--sampler", "outlines")


@pytest.fixture(scope="module")
def model(checkpoint):
    """The tiny Llama with room for the tools' schemas in its prompts (the test tokenizer spends many tokens)."""
    return str(checkpoint("LlamaForCausalLM", max_position_embeddings=1024))


def tools_server(model: str, root, scripts: dict, *flags: str):
    """`fw serve` of ``model`` with TOOLS_TEMPLATE, auto tool choice by hermes, ``scripts`` and ``flags``."""
    (root / "tools.jinja").write_text(TOOLS_TEMPLATE)
    env = {**scripted_site(root / "site"), "FW_TEST_SCRIPTS": json.dumps(scripts)}
    return fw_serve("--model", model, *SERVE, "--chat-template", str(root / "tools.jinja"), "--enable-auto-tool-choice",
                    "--tool-call-parser", "hermes", *flags, env=env)


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    with tools_server(model, tmp_path_factory.mktemp("tools"), SCRIPTS) as (base, _proc):
        yield base


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0, timeout=120)


def arguments(call) -> dict:
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, SCHEMAS[call.function.name])
    return args


def test_auto_reads_the_models_call_and_the_conversation_goes_on(client):
    first = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, seed=1, max_tokens=MAX_TOKENS)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.id and call.type == "function" and call.function.name == "get_weather"
    assert arguments(call) == {"city": "Paris", "unit": "c"}
    # Second turn: the call and its result go back in the history; the model answers in text.
    history = [*MESSAGES, choice.message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "18 C"}]
    second = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS, seed=2, max_tokens=MAX_TOKENS)
    assert second.choices[0].message.content == "It is 18 degrees in Paris."
    assert second.choices[0].finish_reason == "stop" and not second.choices[0].message.tool_calls


def test_the_history_reaches_the_template(server):
    history = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "-3 C"}]
    ids = httpx.post(f"{server}/tokenize", json={"messages": history}, timeout=60).json()["tokens"]
    text = httpx.post(f"{server}/detokenize", json={"tokens": ids}, timeout=60).json()["prompt"]
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>' in text
    assert "<tool_response>\n-3 C\n</tool_response>" in text


def test_auto_streams_calls_in_openai_chunks(client):
    stream = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, seed=3,
                                            max_tokens=MAX_TOKENS, stream=True)
    chunks = list(stream)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    pieces = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert content == "Let me check."
    # Per call: first its index, id, type and name with arguments "", then its arguments.
    firsts = [p for p in pieces if p.id is not None]
    assert [(p.index, p.type, p.function.name, p.function.arguments) for p in firsts] == [
        (0, "function", "get_weather", ""), (1, "function", "get_time", "")]
    args = {i: "".join(p.function.arguments for p in pieces if p.index == i and p.id is None) for i in (0, 1)}
    assert json.loads(args[0]) == {"city": "Paris", "unit": "c"} and json.loads(args[1]) == {"zone": "utc"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_the_clients_stream_helper_assembles_the_calls(client):
    with client.chat.completions.stream(model="tiny", messages=MESSAGES, tools=TOOLS, seed=3,
                                        max_tokens=MAX_TOKENS) as stream:
        final = stream.get_final_completion()
    message = final.choices[0].message
    assert message.content == "Let me check." and final.choices[0].finish_reason == "tool_calls"
    assert [c.function.name for c in message.tool_calls] == ["get_weather", "get_time"]
    assert [arguments(c) for c in message.tool_calls] == [{"city": "Paris", "unit": "c"}, {"zone": "utc"}]
    assert len({c.id for c in message.tool_calls}) == 2


def test_parallel_tool_calls_false_keeps_the_first(client):
    out = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, seed=3, max_tokens=MAX_TOKENS,
                                         parallel_tool_calls=False)
    assert [c.function.name for c in out.choices[0].message.tool_calls] == ["get_weather"]


def test_a_malformed_call_is_content(client):
    for stream in (False, True):
        out = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, seed=4,
                                             max_tokens=MAX_TOKENS, stream=stream)
        if stream:
            chunks = list(out)
            content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            assert not any(c.choices[0].delta.tool_calls for c in chunks if c.choices)
            finish = chunks[-1].choices[0].finish_reason
        else:
            content, finish = out.choices[0].message.content, out.choices[0].finish_reason
            assert not out.choices[0].message.tool_calls
        assert content == SCRIPTS[4]["text"] and finish == "stop"


def test_tool_choice_none_renders_tools_and_reads_no_calls(client):
    out = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="none", seed=1,
                                         max_tokens=MAX_TOKENS)
    assert out.choices[0].message.content == CALL and not out.choices[0].message.tool_calls
    assert out.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("stream", [False, True])
def test_required_calls_validate_in_every_sampled_run(client, stream):
    """50 free samples at temperature 1 (25 streamed): the constraint makes every one a list of valid calls.

    The list's length is the model's choice: a random model may go on adding calls until max_tokens cuts the list.
    Then, as in vLLM, the complete calls come back with finish_reason "length" (the cut one is dropped), so every
    returned call still validates; otherwise the list closed and the finish_reason is "tool_calls"."""
    for _ in range(25):
        out = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                             temperature=1.0, max_tokens=MAX_TOKENS, stream=stream)
        if stream:
            chunks = list(out)
            pieces = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
            names = {p.index: p.function.name for p in pieces if p.id is not None}
            args = {i: "".join(p.function.arguments for p in pieces if p.index == i and p.id is None) for i in names}
            assert names and sorted(names) == list(range(len(names)))
            for i, name in names.items():
                jsonschema.validate(json.loads(args[i]), SCHEMAS[name])
            finish = chunks[-1].choices[0].finish_reason
        else:
            choice = out.choices[0]
            assert choice.message.tool_calls and choice.message.content is None, choice
            for call in choice.message.tool_calls:
                arguments(call)
            finish = choice.finish_reason
        assert finish in ("tool_calls", "length")


def test_named_function_arguments_validate_in_every_sampled_run(client):
    for _ in range(50):
        out = client.chat.completions.create(
            model="tiny", messages=MESSAGES, tools=TOOLS, temperature=1.0, max_tokens=MAX_TOKENS,
            tool_choice={"type": "function", "function": {"name": "get_time"}})
        (call,) = out.choices[0].message.tool_calls
        assert call.function.name == "get_time" and arguments(call)["zone"] in ("utc", "cet")


def test_required_with_parallel_tool_calls_false_makes_one_call(client):
    for _ in range(5):
        out = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                             parallel_tool_calls=False, max_tokens=MAX_TOKENS)
        assert len(out.choices[0].message.tool_calls) == 1


def test_a_cut_constrained_output_comes_back_as_content(client):
    out = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=3,
                                         tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = out.choices[0]
    assert choice.finish_reason == "length" and not choice.message.tool_calls and choice.message.content


BAD = [
    ("invalid schema", {"tools": [{"type": "function", "function": {"name": "broken",
                                                                    "parameters": {"type": "objekt"}}}]},
     "tools", "'broken'"),
    ("missing function", {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "'nope'"),
    ("tool_choice without tools", {"tool_choice": "required"}, "tool_choice", "needs tools"),
    ("bad tool_choice", {"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "expected"),
    ("constraint twice", {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice", "response_format"),
]


@pytest.mark.parametrize(("name", "extra", "param", "says"), BAD, ids=[b[0] for b in BAD])
def test_bad_tool_requests_are_openai_400s(server, name, extra, param, says):
    resp = httpx.post(f"{server}/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 4, **extra}, timeout=60)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["param"] == param and says in error["message"]


def test_a_server_without_the_flags(model, tmp_path):
    """auto needs --enable-auto-tool-choice; a template that ignores tools is refused unless tool_choice is none;
    required needs a sampler with structured output."""
    (tmp_path / "tools.jinja").write_text(TOOLS_TEMPLATE)
    with fw_serve("--model", model, *SERVE[:-2], "--sampler", "default") as (base, _):
        body = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 4}
        for choice in ("auto", None):  # tools without tool_choice mean auto
            resp = httpx.post(f"{base}/v1/chat/completions", json={**body, "tool_choice": choice} if choice else body,
                              timeout=60)
            assert resp.status_code == 400 and "--enable-auto-tool-choice" in resp.json()["error"]["message"]
        ignored = httpx.post(f"{base}/v1/chat/completions", json={**body, "tool_choice": "required"}, timeout=60)
        assert ignored.status_code == 400 and "ignores tools" in ignored.json()["error"]["message"]
        assert httpx.post(f"{base}/v1/chat/completions", json={**body, "tool_choice": "none"},
                          timeout=60).status_code == 200
    with fw_serve("--model", model, *SERVE[:-2], "--sampler", "default", "--chat-template",
                  str(tmp_path / "tools.jinja")) as (base, _):
        resp = httpx.post(f"{base}/v1/chat/completions", json={**body, "tool_choice": "required"}, timeout=60)
        assert resp.status_code == 400 and "--sampler" in resp.json()["error"]["message"]


def test_unknown_parsers_fail_at_startup_listing_the_installed_ones(model):
    for flag, installed in (("--tool-call-parser", "hermes"), ("--reasoning-parser", "qwen3")):
        result = run_fw("serve", "--model", model, "--port", "0", flag, "no-such-parser")
        assert result.returncode != 0
        assert f"{flag}: unknown" in result.stderr and "no-such-parser" in result.stderr and installed in result.stderr


def test_offline_chat_returns_the_parsed_calls(model, monkeypatch):
    from fw import LLM, SamplingParams, plugins

    monkeypatch.setenv("FW_TEST_SCRIPTS", json.dumps(SCRIPTS))
    manager = plugins.get_plugin_manager()
    import fw.testing.scripted as scripted

    name = manager.register(scripted)
    try:
        with pytest.raises(Exception, match="unknown tool-call parser 'nope'"):
            LLM(model, tool_call_parser="nope", device="cpu")
        llm = LLM(model, tool_call_parser="hermes", sampler="outlines", num_kv_blocks=128, max_model_len=1024,
                  device="cpu")
        try:
            auto, = llm.chat(MESSAGES, SamplingParams(seed=1, max_tokens=MAX_TOKENS), use_tqdm=False, tools=TOOLS,
                             chat_template=TOOLS_TEMPLATE)
            (call,) = auto.outputs[0].tool_calls
            assert call.function.name == "get_weather" and arguments(call) == {"city": "Paris", "unit": "c"}
            assert auto.outputs[0].text == CALL  # the raw text stays
            forced, = llm.chat(MESSAGES, SamplingParams(max_tokens=MAX_TOKENS), use_tqdm=False, tools=TOOLS,
                               chat_template=TOOLS_TEMPLATE, tool_choice="required")
            assert forced.outputs[0].tool_calls and all(arguments(c) for c in forced.outputs[0].tool_calls)
            plain, = llm.chat(MESSAGES, SamplingParams(max_tokens=2), use_tqdm=False)
            assert plain.outputs[0].tool_calls is None
        finally:
            llm.shutdown()
    finally:
        manager.unregister(name=name)

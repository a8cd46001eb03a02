from click.testing import CliRunner

from fw.testing.parser_conformance import ToolParserConformance


class TestFunctionTagConformance(ToolParserConformance):
    plugin = "function_tag"
    samples = {
        '<function=get_weather>{"city": "Paris"}</function>': (None, [("get_weather", {"city": "Paris"})]),
        'I will check both.\n<function=get_weather>{"city": "東京"}</function>\n'
        '<function=get_time>{"zone": {"name": "Asia/Tokyo", "dst": false}}</function>':
            ("I will check both.\n", [("get_weather", {"city": "東京"}), ("get_time", {"zone": {"name": "Asia/Tokyo", "dst": False}})]),
        "No call here.": ("No call here.", []),
    }
    malformed = [
        '<function=get_weather>{"city": </function>',
        '<function=get_weather>{"city": "Paris"}</function> and some words after',
        '<function=get_weather>{"city": "Paris"}',
    ]


def test_listed_by_fw_plugins_list():
    from fw_cli.main import cli

    listed = CliRunner().invoke(cli, ["plugins", "list", "--kind", "tool_parsers"])
    assert listed.exit_code == 0, listed.output
    assert any(line.split()[:2] == ["function_tag", "ok"] for line in listed.output.splitlines()), listed.output


def test_chosen_by_name_with_no_change_to_fw(tmp_path, monkeypatch):
    """`tool_call_parser="function_tag"` (`--tool-call-parser function_tag`) reaches this plugin through its entry
    point alone: a chat whose model writes a ``<function=...>`` call (scripted: a random model never would) comes
    back with the call parsed."""
    import json

    import fw.testing.scripted as scripted
    from fw import LLM, SamplingParams, plugins
    from fw.testing.models import TOOLS_TEMPLATE, make_tiny_model

    call = '<function=get_weather>{"city": "Paris"}</function>'
    monkeypatch.setenv(scripted.ENV, json.dumps({"7": {"text": "Checking. " + call}}))
    manager = plugins.get_plugin_manager()
    name = manager.register(scripted)
    try:
        model = make_tiny_model("LlamaForCausalLM", tmp_path / "llama", max_position_embeddings=1024)
        llm = LLM(str(model), tool_call_parser="function_tag", num_kv_blocks=64, max_model_len=1024, device="cpu")
        try:
            tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
            out, = llm.chat([{"role": "user", "content": "Weather in Paris?"}], SamplingParams(seed=7, max_tokens=64),
                            tools=tools, chat_template=TOOLS_TEMPLATE, use_tqdm=False)
        finally:
            llm.shutdown()
    finally:
        manager.unregister(name=name)
    (tool_call,) = out.outputs[0].tool_calls
    assert tool_call.function.name == "get_weather"
    assert json.loads(tool_call.function.arguments) == {"city": "Paris"}

from fw.interfaces.base import Capabilities
from fw.interfaces.spec import PluginSpec


def _spec(name: str, impl: str, description: str) -> PluginSpec:
    return PluginSpec(
        name=name, kind="tool_parsers", impl=f"fw_tool_parsers.{impl}", capabilities=Capabilities(), api_version=1,
        description=description,
    )


HERMES = _spec("hermes", "hermes:Hermes", 'Hermes, Qwen2.5, Qwen3: <tool_call>{"name": ..., "arguments": {...}}</tool_call>.')
LLAMA3_JSON = _spec(
    "llama3_json", "llama3_json:Llama3Json", 'Llama 3.1/3.2: {"name": ..., "parameters": {...}}, several joined by ";".'
)
MISTRAL = _spec("mistral", "mistral:Mistral", 'Mistral: [TOOL_CALLS] then a JSON list of {"name", "arguments"}.')
PYTHONIC = _spec("pythonic", "pythonic:Pythonic", "Llama 3.2/4 and others: a Python list of calls, [f(a=1), g(b='x')].")

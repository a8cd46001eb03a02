# The entry point names this module: keep it light, so `fw plugins list` stays fast.
from fw.interfaces.base import Capabilities
from fw.interfaces.spec import PluginSpec

SPEC = PluginSpec(
    name="function_tag",
    kind="tool_parsers",
    impl="fw_tool_parser_functiontag.parser:FunctionTag",
    capabilities=Capabilities(),
    api_version=1,
    description='Llama 3.1 custom tools: <function=get_weather>{"city": "Paris"}</function>, after any text.',
)

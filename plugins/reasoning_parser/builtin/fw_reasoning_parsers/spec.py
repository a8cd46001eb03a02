from fw.interfaces.base import Capabilities
from fw.interfaces.spec import PluginSpec


def _spec(name: str, impl: str, description: str) -> PluginSpec:
    return PluginSpec(
        name=name, kind="reasoning_parsers", impl=f"fw_reasoning_parsers.think:{impl}", capabilities=Capabilities(),
        api_version=1, description=description,
    )


DEEPSEEK_R1 = _spec(
    "deepseek_r1", "DeepSeekR1", "DeepSeek-R1 and QwQ: everything before </think> is reasoning (the template opens <think>)."
)
QWEN3 = _spec(
    "qwen3", "Qwen3", "Qwen3: <think>...</think> opening the output is reasoning; an output without it is all content."
)

from fw.interfaces import quant
from fw.interfaces.base import frozen
from fw.interfaces.spec import BUILTIN_PRIORITY, PluginSpec

SPEC = PluginSpec(
    name="none",
    kind="quant",
    impl="fw_quant_none.method:Unquantized",
    capabilities=quant.QuantCapabilities(formats=frozen("none")),
    api_version=2,
    description="Unquantized weights in the model dtype (bf16 on CPU: prepacked for oneDNN).",
    aliases=("unquantized",),
    # The default for plain checkpoints: a plugin that also loads them replaces it only by name or a higher priority.
    priority=BUILTIN_PRIORITY,
)

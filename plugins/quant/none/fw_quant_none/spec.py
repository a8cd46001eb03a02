from fw.interfaces import quant
from fw.interfaces.base import frozen
from fw.plugins import PluginSpec

SPEC = PluginSpec(
    name="none",
    kind="quant",
    impl="fw_quant_none.method:Unquantized",
    capabilities=quant.QuantCapabilities(formats=frozen("none")),
    api_version=quant.API_VERSION,
    description="Unquantized weights in the model dtype (bf16 on CPU: prepacked for oneDNN).",
    aliases=("unquantized",),
)

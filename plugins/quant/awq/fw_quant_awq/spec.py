"""The AWQ quant plugin's record. Light: imports no torch, so listing plugins stays fast."""

from fw.interfaces import quant
from fw.interfaces.base import frozen
from fw.plugins import BUILTIN_PRIORITY, PluginSpec
from fw_quant_gptq.spec import IntOptions

SPEC = PluginSpec(
    name="awq",
    kind="quant",
    # fw-quant-gptq's method reads every integer layout; this plugin declares the AWQ format and its tests.
    impl="fw_quant_gptq.method:IntMethod",
    capabilities=quant.QuantCapabilities(
        formats=frozen("awq"),
        devices=frozen("cpu", "cuda"),
        dtypes=frozen("float32", "bfloat16", "float16"),
    ),
    api_version=quant.API_VERSION,
    description=(
        "AWQ checkpoints in the GEMM layout (AutoAWQ, GPTQModel's AWQ export): 4-bit weights with zero points "
        "(zero_point: true), any group size, linear layers and experts; the GEMV, Marlin and exllama layouts "
        "and zero_point: false are refused by name."
    ),
    options=IntOptions,
    priority=BUILTIN_PRIORITY,
)

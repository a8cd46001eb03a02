"""The INT8 quant plugin's record. Light: imports no torch, so listing plugins stays fast."""

from fw.interfaces import quant
from fw.interfaces.base import frozen
from fw.plugins import BUILTIN_PRIORITY, PluginSpec
from fw_quant_fp8.spec import Fp8Options


class Int8Options(Fp8Options):
    """fw-quant-fp8's options: the layers are the same."""


SPEC = PluginSpec(
    name="int8",
    kind="quant",
    impl="fw_quant_int8.method:Int8Method",
    # "none": plain checkpoints, quantized as they load (--quant int8), below `none`'s priority so that auto never
    # picks it for them.
    capabilities=quant.QuantCapabilities(
        formats=frozen("compressed-tensors-int8", "none"),
        devices=frozen("cpu", "cuda"),
        dtypes=frozen("float32", "bfloat16", "float16"),
    ),
    api_version=quant.API_VERSION,
    description=(
        "INT8 weights: compressed-tensors int-quantized (symmetric channel or tensor weight scales; int8 "
        "activations with dynamic per-token or static scales: llm-compressor's W8A8), fused experts, and plain "
        "checkpoints quantized per channel at load. W8A8 products are integer dot products on the CPU; "
        "elsewhere, and for experts, activation quantization is emulated exactly."
    ),
    options=Int8Options,
    priority=BUILTIN_PRIORITY - 1,
)

"""The INT8 quant plugin's record. Light: imports no torch, so listing plugins stays fast."""

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from fw.interfaces import quant
from fw.interfaces.base import frozen
from fw.plugins import BUILTIN_PRIORITY, PluginSpec


class Int8Options(BaseModel):
    model_config = ConfigDict(extra="forbid")

    activations: Literal["auto", "none", "dynamic"] = Field(
        "auto",
        description="Activation quantization. auto: as the checkpoint says (W8A8 where its config quantizes "
        "activations), none for plain checkpoints quantized at load (W8A16); none: weight-only everywhere; "
        "dynamic: int8 activations with a scale per token everywhere (W8A8, integer products), also for plain "
        "checkpoints.",
    )
    lm_head: bool = Field(
        False,
        description="Also round the LM head to INT8 per row at load (float32 logits; its activations too where the "
        "activations option is dynamic; a tied embedding "
        "keeps its float table for the lookup). Off by default, as in vLLM: the head's rounding moves the logits "
        "most, and it is the largest matrix of a small model, so on a CPU it is the largest saving.",
    )


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

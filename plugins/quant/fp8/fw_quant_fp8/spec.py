"""The 8-bit quant plugins' records: fp8 and int8, two specs of one implementation (``Fp8Method``'s layers, with
float or integer elements). Light: imports no torch, so listing plugins stays fast."""

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from fw.interfaces import quant
from fw.interfaces.base import frozen
from fw.interfaces.spec import BUILTIN_PRIORITY, PluginSpec


class Fp8Options(BaseModel):
    """The options of both 8-bit plugins: their layers are the same."""

    model_config = ConfigDict(extra="forbid")

    activations: Literal["auto", "none", "dynamic"] = Field(
        "auto",
        description="Activation quantization. auto: as the checkpoint says (W8A8 where its config quantizes "
        "activations), none for plain checkpoints quantized at load (W8A16); none: weight-only everywhere; "
        "dynamic: activations rounded to the weights' 8-bit type with a scale per token everywhere (W8A8), also "
        "for plain checkpoints.",
    )
    lm_head: bool = Field(
        False,
        description="Also round the LM head to the plugin's 8-bit type per row at load (float32 logits; its "
        "activations too where the activations option is dynamic; a tied embedding keeps its float table for the "
        "lookup). Off by default, as in vLLM: the head's rounding moves the logits most, and it is the largest "
        "matrix of a small model, so on a CPU it is the largest saving.",
    )
    layers: Literal["all", "lm_head"] = Field(
        "all",
        description="Which layers a plain checkpoint has rounded at load. all: every linear layer (and the LM head "
        "where lm_head is true); lm_head: the LM head alone, the other layers staying in the model's dtype: an "
        "8-bit head for a bf16 model. Checkpoints that are already quantized take only all.",
    )


SPEC = PluginSpec(
    name="fp8",
    kind="quant",
    impl="fw_quant_fp8.method:Fp8Method",
    # "none": plain checkpoints, quantized as they load (--quant fp8). Its priority is below `none`'s for those, so
    # auto never picks it for a plain checkpoint; FP8 checkpoints only it loads.
    capabilities=quant.QuantCapabilities(
        formats=frozen("fp8", "compressed-tensors-fp8", "none"),
        devices=frozen("cpu", "cuda"),
        dtypes=frozen("float32", "bfloat16", "float16"),
    ),
    api_version=2,
    description=(
        "FP8 e4m3 weights: compressed-tensors float-quantized (channel/tensor/block weight scales; dynamic "
        "per-token or static activations), vLLM/AutoFP8 quant_method fp8 (per-tensor, or DeepSeek-V3 128x128 "
        "blocks), fused experts, and plain checkpoints quantized per channel at load. Weights stay FP8 in memory "
        "and are widened in the product; activation quantization (W8A8) is emulated exactly, also on CUDA: "
        "torch._scaled_mm is not used yet."
    ),
    options=Fp8Options,
    priority=BUILTIN_PRIORITY - 1,
)

INT8 = PluginSpec(
    name="int8",
    kind="quant",
    impl="fw_quant_fp8.int8:Int8Method",
    # "none": plain checkpoints, quantized as they load (--quant int8), below `none`'s priority so that auto never
    # picks it for them.
    capabilities=quant.QuantCapabilities(
        formats=frozen("compressed-tensors-int8", "none"),
        devices=frozen("cpu", "cuda"),
        dtypes=frozen("float32", "bfloat16", "float16"),
    ),
    api_version=2,
    description=(
        "INT8 weights: compressed-tensors int-quantized (symmetric channel or tensor weight scales; int8 "
        "activations with dynamic per-token or static scales: llm-compressor's W8A8), fused experts, and plain "
        "checkpoints quantized per channel at load. W8A8 products are integer dot products on the CPU; "
        "elsewhere, and for experts, activation quantization is emulated exactly."
    ),
    options=Fp8Options,
    priority=BUILTIN_PRIORITY - 1,
)

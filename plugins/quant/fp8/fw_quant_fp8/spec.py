"""The FP8 quant plugin's record. Light: imports no torch, so listing plugins stays fast."""

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from fw.interfaces import quant
from fw.interfaces.base import frozen
from fw.plugins import BUILTIN_PRIORITY, PluginSpec


class Fp8Options(BaseModel):
    """The options of the 8-bit plugins (fw-quant-int8 takes the same)."""

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
    api_version=quant.API_VERSION,
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

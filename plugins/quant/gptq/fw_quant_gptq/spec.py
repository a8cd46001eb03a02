"""The integer-weight quant plugins' records: gptq and awq, two specs of one implementation (``IntMethod`` reads
every integer layout, repacked at load into one form). Light: imports no torch, so listing plugins stays fast."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from fw.interfaces import quant
from fw.interfaces.base import frozen
from fw.interfaces.spec import BUILTIN_PRIORITY, PluginSpec


class IntOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    activations: Literal["none", "int8"] = Field(
        "none",
        description="none: the weights multiply the activations as they are (exact, the reference's numerics). "
        "int8: each block of 32 activation values is rounded to int8 with its own scale first, as llama.cpp "
        "does, and the CPU kernel multiplies integers: faster decoding, a rounding several times bf16's.",
    )
    lm_head: bool = Field(
        False,
        description="Also round the LM head, which GPTQ and AWQ checkpoints leave in float, to 8 bits (or "
        "lm_head_bits) at load (symmetric, a scale per 128 input features) and multiply it with this plugin's "
        "product: float32 "
        "logits, its activations rounded to int8 too where activations is int8; a tied embedding keeps its float "
        "table for the lookup. Off by default, as in vLLM: the head's rounding moves the logits most, and on a CPU "
        "it halves the largest matrix a small model reads every decode step.",
    )
    lm_head_bits: int = Field(
        8,
        description="The rounded LM head's bits (with lm_head=true): 4 reads a quarter of a 16-bit head's bytes, "
        "through the plugin's 4-bit product (levels -7..7, a scale per 128 input features: steps 18 times as "
        "coarse as 8 bits'). 8 or 4.",
    )

    @model_validator(mode="after")
    def _bits_need_a_head(self) -> IntOptions:
        if self.lm_head_bits not in (8, 4):
            raise ValueError(f"lm_head_bits must be 8 or 4, not {self.lm_head_bits}")
        if self.lm_head_bits != 8 and not self.lm_head:
            raise ValueError("lm_head_bits applies to a rounded LM head: set lm_head=true with it")
        return self


SPEC = PluginSpec(
    name="gptq",
    kind="quant",
    impl="fw_quant_gptq.method:IntMethod",
    capabilities=quant.QuantCapabilities(
        formats=frozen("gptq", "pack-quantized"),
        devices=frozen("cpu", "cuda"),
        dtypes=frozen("float32", "bfloat16", "float16"),
    ),
    api_version=2,
    description=(
        "GPTQ v1/v2 checkpoints (AutoGPTQ, GPTQModel, optimum: 4 or 8 bits, symmetric or not, group sizes or "
        "per channel, act-order) and compressed-tensors pack-quantized W4A16/W8A16 (llm-compressor), linear "
        "layers and experts. Weights stay packed and are decoded in the product: a native CPU kernel for "
        "decode-sized batches, dequantized chunks for prefill, a Triton GEMM on CUDA."
    ),
    options=IntOptions,
    priority=BUILTIN_PRIORITY,
)

# Its own name for `--quant`, its own format and description; the method, options and kernels are gptq's.
AWQ = PluginSpec(
    name="awq",
    kind="quant",
    impl="fw_quant_gptq.method:IntMethod",
    capabilities=quant.QuantCapabilities(
        formats=frozen("awq"),
        devices=frozen("cpu", "cuda"),
        dtypes=frozen("float32", "bfloat16", "float16"),
    ),
    api_version=2,
    description=(
        "AWQ checkpoints in the GEMM layout (AutoAWQ, GPTQModel's AWQ export): 4-bit weights with zero points "
        "(zero_point: true), any group size, linear layers and experts; the GEMV, Marlin and exllama layouts "
        "and zero_point: false are refused by name."
    ),
    options=IntOptions,
    priority=BUILTIN_PRIORITY,
)

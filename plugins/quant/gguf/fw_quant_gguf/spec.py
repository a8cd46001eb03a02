"""The GGUF plugins' records: the checkpoint format (config, weights and tokenizer in one file) and the quant method
its config names. Light: imports neither torch nor gguf, so listing plugins stays fast."""

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from fw.interfaces import checkpoint_format, quant
from fw.interfaces.base import frozen
from fw.interfaces.spec import BUILTIN_PRIORITY, PluginSpec


class GGUFOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    dequantize: bool = Field(
        False,
        description="Dequantize every weight at load for speed when memory allows (the model then takes as "
        "much memory as an unquantized one).",
    )
    activations: Literal["float", "int8"] = Field(
        "float",
        description="int8: on the CPU, products with Q4_0/Q4_1/Q8_0 weights (the LM head's Q8_0 too) round each "
        "block of 32 activation values to int8 with its own scale first, as llama.cpp does, and the native "
        "kernel multiplies integers: faster decoding, a rounding several times bf16's. float: the activations "
        "multiply the weights as they are (the reference's numerics; the default, as int8 changed the embedded "
        "SmolLM2's answers). Other weight types and devices always use float.",
    )


SPEC = PluginSpec(
    name="gguf",
    kind="quant",
    impl="fw_quant_gguf.method:GGUFMethod",
    # float16 serves on CUDA; on CPU the engine turns a float16 request into bfloat16.
    capabilities=quant.QuantCapabilities(
        formats=frozen("gguf"),
        devices=frozen("cpu", "cuda"),
        dtypes=frozen("float32", "bfloat16", "float16"),
        requires_modules=("gguf",),
    ),
    api_version=2,
    description=(
        "llama.cpp GGUF files (llama, qwen2, qwen3; F32/F16/BF16, Q4_0-Q8_0 and Q2_K-Q6_K weights) with the "
        "tokenizer and chat template they carry. Linear weights stay in their ggml blocks and are dequantized "
        "on the fly; embeddings and the LM head are dequantized at load. Tensor parallel: rows are split "
        "whole across ranks, and a row-parallel layer's share of the input features must be whole blocks."
    ),
    options=GGUFOptions,
    priority=BUILTIN_PRIORITY,
)

FORMAT = PluginSpec(
    name="gguf",
    kind="checkpoint_format",
    impl="fw_quant_gguf.format:GGUFFormat",
    capabilities=checkpoint_format.CheckpointFormatCapabilities(suffixes=frozen(".gguf"), requires_modules=("gguf",)),
    api_version=checkpoint_format.API_VERSION,
    description=(
        "llama.cpp GGUF files: the config, the weights (linear ones as their ggml blocks, for the gguf quant method) "
        "and the tokenizer with its chat template, all in one file."
    ),
    priority=BUILTIN_PRIORITY,
)

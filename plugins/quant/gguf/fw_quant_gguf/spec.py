"""The GGUF quant plugin's record. Light: imports neither torch nor gguf, so listing plugins stays fast."""

from pydantic import BaseModel, ConfigDict, Field

from fw.interfaces import quant
from fw.interfaces.base import frozen
from fw.plugins import BUILTIN_PRIORITY, PluginSpec


class GGUFOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    dequantize: bool = Field(
        False,
        description="Dequantize every weight at load for speed when memory allows (the model then takes as "
        "much memory as an unquantized one).",
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
    api_version=quant.API_VERSION,
    description=(
        "llama.cpp GGUF files (llama, qwen2, qwen3; F32/F16/BF16, Q4_0-Q8_0 and Q2_K-Q6_K weights) with the "
        "tokenizer and chat template they carry. Linear weights stay in their ggml blocks and are dequantized "
        "on the fly; embeddings and the LM head are dequantized at load. Tensor parallel: rows are split "
        "whole across ranks, and a row-parallel layer's share of the input features must be whole blocks."
    ),
    options=GGUFOptions,
    priority=BUILTIN_PRIORITY,
)

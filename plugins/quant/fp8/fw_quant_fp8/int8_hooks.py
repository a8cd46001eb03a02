"""Hook implementations: name compressed-tensors checkpoints whose weights are unpacked 8-bit integers
(``int-quantized``, llm-compressor's W8A8), so that auto picks this plugin. Light, as every hooks plugin is imported
whenever fw starts."""

from __future__ import annotations

from typing import Any

from fw.interfaces.hooks import hookimpl
from fw_quant_fp8.hooks import is_8bit_compressed_tensors

FORMAT = "compressed-tensors-int8"


@hookimpl
def fw_detect_quant_format(model_path: str, hf_config: dict[str, Any] | None) -> str | None:
    quant_config = (hf_config or {}).get("quantization_config") or {}
    return FORMAT if is_8bit_compressed_tensors(quant_config, "int") else None

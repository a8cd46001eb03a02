"""Hook implementations: name compressed-tensors checkpoints whose weights are FP8, so that auto picks this plugin.

compressed-tensors is one ``quant_method`` for many schemes (INT4/INT8 packed, FP8, NVFP4); this claims only the
float-quantized 8-bit ones. Light: imports nothing heavy, as every hooks plugin is imported whenever fw starts.
"""

from __future__ import annotations

from typing import Any

from fw.interfaces.hooks import hookimpl

FORMAT = "compressed-tensors-fp8"


def is_8bit_compressed_tensors(quant_config: dict[str, Any], kind: str = "float") -> bool:
    """Every config group quantizes weights to 8-bit ``kind`` ("float" or "int") values, stored one per byte: the
    ``float-quantized`` / ``int-quantized`` formats (an 8-bit ``pack-quantized`` checkpoint packs four in a word)."""
    if quant_config.get("quant_method") != "compressed-tensors" or quant_config.get("format") == "pack-quantized":
        return False
    groups = (quant_config.get("config_groups") or {}).values()
    return bool(groups) and all(
        (g.get("weights") or {}).get("type") == kind and (g.get("weights") or {}).get("num_bits") == 8
        for g in groups
    )


@hookimpl
def fw_detect_quant_format(model_path: str, hf_config: dict[str, Any] | None) -> str | None:
    quant_config = (hf_config or {}).get("quantization_config") or {}
    return FORMAT if is_8bit_compressed_tensors(quant_config) else None

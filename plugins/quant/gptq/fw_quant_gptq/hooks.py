"""Hook implementations: name compressed-tensors checkpoints whose weights are packed integers, so that auto
picks this plugin. compressed-tensors is one ``quant_method`` for many schemes; this claims the
``pack-quantized`` ones. Light: imports nothing heavy, as every hooks plugin is imported whenever fw starts."""

from __future__ import annotations

from typing import Any

from fw.interfaces.hooks import hookimpl

FORMAT = "pack-quantized"


@hookimpl
def fw_detect_quant_format(model_path: str, hf_config: dict[str, Any] | None) -> str | None:
    quant_config = (hf_config or {}).get("quantization_config") or {}
    packed = quant_config.get("quant_method") == "compressed-tensors" and quant_config.get("format") == FORMAT
    return FORMAT if packed else None

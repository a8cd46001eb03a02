"""Sampling defaults from a model's generation_config.json (``--generation-config``, as vLLM reads it)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fw.config import ModelSection

# generation_config.json key -> SamplingParams field: the keys vLLM takes as request defaults.
_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
# transformers' own defaults: vLLM reads the file through GenerationConfig.to_diff_dict(), which drops these.
_HF_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "repetition_penalty": 1.0}


def sampling_defaults(model: ModelSection) -> dict[str, Any]:
    """SamplingParams values for fields a request leaves unset: ``auto`` reads the model directory's file,
    ``vllm`` none, anything else names a folder holding generation_config.json. ``model.model`` is the
    resolved model path (the engine fills it in)."""
    if model.generation_config == "vllm":
        return {}
    folder = Path(model.model if model.generation_config == "auto" else model.generation_config)
    file = folder / "generation_config.json"
    if not file.is_file():  # a .gguf file, or a model directory without one (a given folder is checked by the config)
        return {}
    values = json.loads(file.read_text())
    return {
        field: values[key]
        for key, field in _FIELDS.items()
        if values.get(key) is not None and values[key] != _HF_DEFAULTS.get(key)
    }

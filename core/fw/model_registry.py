"""Model registry: ``config.json`` ``architectures`` -> the plugin implementing it.

Built-in architectures register under ``fw.models`` exactly like third-party
ones (see core's pyproject.toml), so lookup is one path for both.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fw import plugins
from fw.interfaces.spec import PluginSpec
from fw.sdk.errors import ModelError


def read_hf_config(model_path: str) -> dict[str, Any]:
    """config.json of a model directory."""
    path = Path(model_path)
    if not path.exists():
        raise ModelError(f"model path {model_path} does not exist")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelError(f"{model_path} has no config.json")
    try:
        return json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise ModelError(f"{config_file} is not valid JSON: {exc}") from None


def supported_architectures() -> dict[str, list[PluginSpec]]:
    """Architecture -> the models plugins that implement it."""
    out: dict[str, list[PluginSpec]] = {}
    for spec in {s.name: s for s in plugins.available("models").values()}.values():
        for arch in spec.capabilities.architectures:
            out.setdefault(arch, []).append(spec)
    return out


def resolve(hf_config: dict[str, Any]) -> PluginSpec:
    """The models plugin for the first of the config's architectures that one implements; where several do,
    the one of highest priority, as "auto" chooses in every slot (a tie is refused)."""
    archs = hf_config.get("architectures") or []
    known = supported_architectures()
    for arch in archs:
        if arch in known:
            top = plugins.by_priority(known[arch])[0]
            if len(top) > 1:
                names = ", ".join(sorted(s.name for s in top))
                raise ModelError(
                    f"{arch} is implemented by models plugins {names} at the same priority ({top[0].priority}); "
                    "disable all but one (FW_DISABLE_PLUGINS=models:NAME)"
                )
            return top[0]
    raise ModelError(
        f"unsupported model architecture {', '.join(archs) or '(config.json lists none)'}; "
        f"supported: {', '.join(sorted(known))}"
    )

"""A plugin's declaration: the ``PluginSpec`` its ``fw.<kind>`` entry point names.

A spec is data (capabilities, the interface version it was written against, a lazy ``module:attr`` path to the
implementation), so listing plugins never imports one; ``load`` imports it when the plugin is chosen.
Discovery, checking and choosing among specs is the core's (``fw.plugins``).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from fw.interfaces import (
    attention,
    checkpoint_format,
    comm,
    kvconnector,
    model,
    quant,
    reasoning_parser,
    sampler,
    spec_proposer,
    tool_parser,
)
from fw.interfaces.base import Capabilities

# Kind -> interface module; each module defines API_VERSION (and ``adapt``, once it changed since the previous one).
INTERFACES = {
    "models": model,
    "attention": attention,
    "quant": quant,
    "comm": comm,
    "kv_connector": kvconnector,
    "sampler": sampler,
    "checkpoint_format": checkpoint_format,
    "spec_proposers": spec_proposer,
    "tool_parsers": tool_parser,
    "reasoning_parsers": reasoning_parser,
}
# Older spellings of a kind, accepted wherever a kind is named (entry-point groups, selectors, --plugin-option).
KIND_ALIASES = {"kvconnector": "kv_connector"}
# The priority of fw's own default plugins: above PluginSpec's default, so that a plugin installed beside
# them is chosen by "auto" only when it declares more.
BUILTIN_PRIORITY = 10


def canonical_kind(kind: str) -> str:
    return KIND_ALIASES.get(kind, kind)


class PluginError(RuntimeError):
    """A plugin could not be found, loaded or used; the message says why."""


@dataclass(frozen=True)
class PluginSpec:
    """What an ``fw.<kind>`` entry point resolves to."""

    name: str
    kind: str
    impl: str  # "package.module:attr", imported only when the plugin is used
    capabilities: Capabilities
    api_version: int
    description: str = ""
    options: type | None = None  # pydantic model validating the slot's ``options`` (``--plugin-option KIND.X=...``)
    # Other names this plugin answers to (e.g. "unquantized" for "none").
    aliases: tuple[str, ...] = ()
    # Rank when the slot is "auto": the highest-priority plugin that fits is chosen (see ``fw.plugins``).
    priority: int = 0

    def load(self) -> Any:
        module_name, _, attr = self.impl.partition(":")
        try:
            obj = importlib.import_module(module_name)
            for part in attr.split(".") if attr else ():
                obj = getattr(obj, part)
        except Exception as exc:  # any import failure of a selected plugin is fatal, with its reason
            raise PluginError(
                f"{self.kind} plugin {self.name!r} failed to import {self.impl}: {type(exc).__name__}: {exc}"
            ) from exc
        # An interface that changed since the previous API version adapts plugins written against that one.
        adapt = getattr(INTERFACES.get(canonical_kind(self.kind)), "adapt", None)
        return obj if adapt is None else adapt(obj, self.api_version)

    def parse_options(self, options: dict[str, Any] | None) -> Any:
        """Validate ``options`` with the plugin's model.

        Environment variables and flags carry text, so a list or mapping arrives as JSON or YAML
        (``'["o_proj"]'``): text the model refuses is parsed, and used where it holds a list or mapping.
        Text the model accepts stays text (a regex like ``[a-z]`` for a string option).
        """
        if self.options is None:
            if options:
                raise PluginError(f"{self.kind} plugin {self.name!r} takes no options (got {sorted(options)})")
            return None
        options = dict(options or {})
        try:
            return self.options.model_validate(options)
        except ValidationError as exc:
            refused = {e["loc"][0] for e in exc.errors() if e["loc"] and isinstance(options.get(e["loc"][0]), str)}
            parsed = {key: value for key in refused if (value := _collection(options[key])) is not None}
            if not parsed:
                raise
        return self.options.model_validate({**options, **parsed})


def _collection(text: str) -> list | dict | None:
    """``text`` as a JSON or YAML list or mapping, else None."""
    import yaml

    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return None
    return value if isinstance(value, list | dict) else None

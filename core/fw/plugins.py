"""Plugin discovery and loading.

Every plugin, built-in or third-party, is a distribution that registers an
entry point in one of the groups ``fw.<kind>``. The entry point names a light
``PluginSpec`` (capabilities as data plus a lazy ``module:attr`` path), so
listing and validating never import an implementation. The one driver chosen
for each slot is loaded by name with stevedore and only then imported.
``fw.hooks`` entry points name pluggy hook implementations (see
``fw.hookspecs``).

``FW_PLUGINS`` (comma-separated allow-list) and ``FW_DISABLE_PLUGINS``
(deny-list) filter discovery, like pytest's ``-p no:NAME``. An item is a
plugin name (any kind) or ``kind:name``.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import warnings
from dataclasses import dataclass, field
from functools import cache
from typing import Any

from fw.interfaces import attention, comm, kvconnector, model, quant, sampler
from fw.interfaces.base import Capabilities, supported_api_versions

# Kind -> interface module; each module defines API_VERSION.
INTERFACES = {
    "models": model,
    "attention": attention,
    "quant": quant,
    "comm": comm,
    "kvconnector": kvconnector,
    "sampler": sampler,
}
KINDS = tuple(INTERFACES)
HOOKS_GROUP = "fw.hooks"


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
    options: type | None = None  # pydantic model validating ``plugins.<kind>.options``
    # Other names this plugin answers to (e.g. "unquantized" for "none").
    aliases: tuple[str, ...] = ()
    # Rank when the slot is "auto": the highest-priority plugin that fits is chosen.
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
        return obj

    def parse_options(self, options: dict[str, Any] | None) -> Any:
        if self.options is None:
            if options:
                raise PluginError(f"{self.kind} plugin {self.name!r} takes no options (got {sorted(options)})")
            return None
        return self.options(**(options or {}))


def _selector_matches(item: str, kind: str, name: str) -> bool:
    item_kind, sep, item_name = item.partition(":")
    return item_name == name and item_kind == kind if sep else item == name


def _env_list(var: str) -> list[str] | None:
    raw = os.environ.get(var)
    if raw is None:
        return None
    return [item.strip() for item in raw.split(",") if item.strip()]


def is_enabled(kind: str, name: str) -> bool:
    """Apply FW_PLUGINS (allow-list) and FW_DISABLE_PLUGINS (deny-list)."""
    allow = _env_list("FW_PLUGINS")
    if allow is not None and not any(_selector_matches(i, kind, name) for i in allow):
        return False
    deny = _env_list("FW_DISABLE_PLUGINS") or []
    return not any(_selector_matches(i, kind, name) for i in deny)


@dataclass
class Discovered:
    """One entry point of a plugin group, loaded or not."""

    kind: str
    name: str
    target: str  # entry point value
    distribution: str | None
    version: str | None
    spec: PluginSpec | None = None
    error: str | None = None
    enabled: bool = True
    notes: list[str] = field(default_factory=list)

    @property
    def status(self) -> str:
        if not self.enabled:
            return "disabled"
        return "broken" if self.error else "ok"


def _check_spec(kind: str, ep_name: str, obj: Any) -> str | None:
    if not isinstance(obj, PluginSpec):
        return f"entry point resolves to {type(obj).__name__}, not a fw.plugins.PluginSpec"
    if obj.kind != kind:
        return f"spec declares kind {obj.kind!r} but is registered under fw.{kind}"
    if obj.name != ep_name:
        return f"spec is named {obj.name!r} but registered as {ep_name!r}"
    current = INTERFACES[kind].API_VERSION
    if obj.api_version not in supported_api_versions(current):
        lo, hi = supported_api_versions(current)
        return f"written for {kind} API v{obj.api_version}; this fw-core supports v{lo} and v{hi}"
    return None


def _distributions() -> dict[tuple[str, str], tuple[str, str]]:
    """(group, entry point name) -> (distribution, version), for every installed fw plugin."""
    out = {}
    for dist in importlib.metadata.distributions():
        for ep in dist.entry_points:
            if ep.group.startswith("fw."):
                out[(ep.group, ep.name)] = (dist.metadata["Name"], dist.version)
    return out


def discover(kind: str) -> list[Discovered]:
    """Every plugin registered for ``kind``; loads specs (light), never implementations."""
    from stevedore import ExtensionManager

    if kind not in INTERFACES:
        raise PluginError(f"unknown plugin kind {kind!r} (kinds: {', '.join(KINDS)})")
    group = f"fw.{kind}"
    dists = _distributions()
    failures: dict[str, str] = {}

    def on_failure(_manager, ep, exc):
        failures[ep.name] = f"{type(exc).__name__}: {exc}"

    manager = ExtensionManager(group, invoke_on_load=False, on_load_failure_callback=on_failure)
    found: dict[str, Discovered] = {}
    for ext in manager.extensions:
        dist, version = dists.get((group, ext.name), (None, None))
        item = Discovered(kind, ext.name, ext.entry_point.value, dist, version)
        item.error = _check_spec(kind, ext.name, ext.plugin)
        item.spec = None if item.error else ext.plugin
        found[ext.name] = item
    for ep in importlib.metadata.entry_points(group=group):
        if ep.name in failures:
            dist, version = dists.get((group, ep.name), (None, None))
            found[ep.name] = Discovered(kind, ep.name, ep.value, dist, version, error=failures[ep.name])
    for item in found.values():
        item.enabled = is_enabled(kind, item.name)
    return sorted(found.values(), key=lambda d: d.name)


def available(kind: str) -> dict[str, PluginSpec]:
    """Enabled, importable-spec plugins of ``kind`` by name (aliases included)."""
    out: dict[str, PluginSpec] = {}
    for item in discover(kind):
        if item.enabled and item.spec is not None:
            out[item.name] = item.spec
            for alias in item.spec.aliases:
                out.setdefault(alias, item.spec)
    return out


def get_spec(kind: str, name: str) -> PluginSpec:
    """The spec of the plugin selected for a slot, loaded by name with stevedore."""
    from stevedore import DriverManager
    from stevedore.exception import NoMatches

    canonical = {alias: spec.name for spec in available(kind).values() for alias in spec.aliases}.get(name, name)
    if not is_enabled(kind, canonical):
        raise PluginError(f"{kind} plugin {name!r} is disabled by FW_PLUGINS / FW_DISABLE_PLUGINS")
    try:
        manager = DriverManager(f"fw.{kind}", canonical, invoke_on_load=False, on_load_failure_callback=_raise)
    except NoMatches:
        choices = ", ".join(sorted(available(kind))) or "none installed"
        raise PluginError(f"unknown {kind} plugin {name!r} (available: {choices})") from None
    except PluginError:
        raise
    spec = manager.driver
    problem = _check_spec(kind, canonical, spec)
    if problem:
        raise PluginError(f"{kind} plugin {name!r}: {problem}")
    return spec


def _raise(_manager, ep, exc):
    raise PluginError(f"plugin {ep.name!r} ({ep.value}) failed to load: {type(exc).__name__}: {exc}") from exc


def load_driver(kind: str, name: str) -> tuple[PluginSpec, Any]:
    """Resolve a slot's plugin by name and import its implementation."""
    spec = get_spec(kind, name)
    return spec, spec.load()


@cache
def get_plugin_manager():
    """The process-wide pluggy manager with every enabled ``fw.hooks`` plugin registered."""
    import pluggy

    from fw import hookspecs

    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    allow = _env_list("FW_PLUGINS") or []
    for ep in importlib.metadata.entry_points(group=HOOKS_GROUP):
        if not is_enabled("hooks", ep.name):
            pm.set_blocked(ep.name)
            continue
        try:
            plugin = ep.load()
        except Exception as exc:
            message = f"hooks plugin {ep.name!r} ({ep.value}) failed to import: {type(exc).__name__}: {exc}"
            if any(_selector_matches(i, "hooks", ep.name) for i in allow):
                raise PluginError(message) from exc
            warnings.warn(message, stacklevel=2)
            continue
        pm.register(plugin, name=ep.name)
    # A misspelled hook name (fw_* without a spec) is an error, not a silent no-op.
    pm.check_pending()
    return pm


def discover_hooks() -> list[Discovered]:
    """``fw.hooks`` entry points, for listing (imports them: hooks plugins are light by contract)."""
    dists = _distributions()
    out = []
    for ep in importlib.metadata.entry_points(group=HOOKS_GROUP):
        dist, version = dists.get((HOOKS_GROUP, ep.name), (None, None))
        item = Discovered("hooks", ep.name, ep.value, dist, version, enabled=is_enabled("hooks", ep.name))
        if item.enabled:
            try:
                ep.load()
            except Exception as exc:
                item.error = f"{type(exc).__name__}: {exc}"
        out.append(item)
    return sorted(out, key=lambda d: d.name)


def configure(config: Any) -> None:
    """Start-up: tell hooks plugins the effective configuration (also plugins registered later)."""
    get_plugin_manager().hook.fw_configure.call_historic(kwargs={"config": config})


def unconfigure(config: Any) -> None:
    get_plugin_manager().hook.fw_unconfigure(config=config)


def refresh() -> None:
    """Forget discovered entry points, e.g. after installing a plugin into the running process's environment."""
    from stevedore import ExtensionManager

    ExtensionManager.ENTRY_POINT_CACHE.clear()
    get_plugin_manager.cache_clear()

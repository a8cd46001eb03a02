"""Plugin discovery and loading.

Every plugin, built-in or third-party, is a distribution that registers an
entry point in one of the groups ``fw.<kind>``. The entry point names a light
``PluginSpec`` (capabilities as data plus a lazy ``module:attr`` path), so
listing never imports an implementation. Specs are checked when discovered
(names against the known sets, the API version); one that fails is listed as
broken and never selected. Only the plugin chosen for a slot is imported, by
``fw.validate.check``. ``fw.hooks`` entry points name pluggy hook
implementations (see ``fw.interfaces.hooks``).

``auto`` takes the plugin of highest ``priority`` among those that fit, never
one chosen by name or install order: a tie at the top is an error naming the
tied plugins. ``PluginSpec.priority`` defaults to 0 and fw's own defaults
declare ``BUILTIN_PRIORITY``, so installing a plugin changes what ``auto``
picks only if it declares a higher priority.

``FW_PLUGINS`` (comma-separated allow-list) and ``FW_DISABLE_PLUGINS``
(deny-list) filter discovery, like pytest's ``-p no:NAME``. An item is a
plugin name (any kind) or ``kind:name``.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import itertools
import os
import re
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import cache
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

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
from fw.interfaces.base import Capabilities, supported_api_versions
from fw.interfaces.spec import INTERFACES, KIND_ALIASES, PluginError, PluginSpec, canonical_kind

if TYPE_CHECKING:
    from fw.validate import CheckResult

# Kind -> the capability record its specs carry.
RECORDS: dict[str, type[Capabilities]] = {
    "models": model.ModelCapabilities,
    "attention": attention.AttentionCapabilities,
    "quant": quant.QuantCapabilities,
    "comm": comm.CommCapabilities,
    "kv_connector": kvconnector.KVConnectorCapabilities,
    "sampler": sampler.SamplerCapabilities,
    "checkpoint_format": checkpoint_format.CheckpointFormatCapabilities,
    "spec_proposers": spec_proposer.SpecProposerCapabilities,
    # Parsers read text: the shared record says all they can declare.
    "tool_parsers": Capabilities,
    "reasoning_parsers": Capabilities,
}
KINDS = tuple(INTERFACES)
HOOKS_GROUP = "fw.hooks"


def _groups(kind: str) -> list[str]:
    """The entry-point groups of ``kind``: its own and those of its older spellings."""
    return [f"fw.{kind}", *(f"fw.{alias}" for alias, canonical in KIND_ALIASES.items() if canonical == kind)]


def _selector_matches(item: str, kind: str, name: str) -> bool:
    item_kind, sep, item_name = item.partition(":")
    return item_name == name and canonical_kind(item_kind) == kind if sep else item == name


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

    @property
    def label(self) -> str:
        """``quant plugin 'int8' (fw-quant-fp8 0.1.0)``: names the distribution to fix or uninstall."""
        dist = f"{self.distribution} {self.version}" if self.distribution else f"no distribution, {self.target}"
        return f"{self.kind} plugin {self.name!r} ({dist})"


# "package.module" or "package.module:attr.attr"
_IMPL = re.compile(r"[A-Za-z_][\w.]*(:[A-Za-z_][\w.]*)?")


def _check_spec(kind: str, ep_name: str, obj: Any) -> str | None:
    """Every mistake in a discovered spec, each naming its field; None when it is well formed."""
    if not isinstance(obj, PluginSpec):
        return f"entry point resolves to {type(obj).__name__}, not a fw.interfaces.spec.PluginSpec"
    problems = []
    if canonical_kind(obj.kind) != kind:
        problems.append(f"kind: {obj.kind!r}, but the spec is registered under fw.{kind}")
    if obj.name != ep_name:
        problems.append(f"name: {obj.name!r}, but the spec is registered as {ep_name!r}")
    lo, hi = supported_api_versions(INTERFACES[kind].API_VERSION)
    if not (isinstance(obj.api_version, int) and lo <= obj.api_version <= hi):
        window = f"v{lo}" if lo == hi else f"v{lo} to v{hi}"
        problems.append(f"api_version: written for {kind} API v{obj.api_version}; this fw-core supports {window}")
    if isinstance(obj.capabilities, RECORDS[kind]):
        problems += obj.capabilities.unknown_names()
    else:
        problems.append(f"capabilities: a {type(obj.capabilities).__name__}, not a {RECORDS[kind].__name__}")
    if not _IMPL.fullmatch(obj.impl):
        problems.append(f"impl: {obj.impl!r} is not a 'package.module:attr' path")
    if obj.options is not None and not (isinstance(obj.options, type) and issubclass(obj.options, BaseModel)):
        problems.append(f"options: {obj.options!r} is not a pydantic model class")
    return "; ".join(problems) or None


def _distributions() -> dict[tuple[str, str], tuple[str, str]]:
    """(group, entry point name) -> (distribution, version), for every installed fw plugin."""
    out = {}
    for dist in importlib.metadata.distributions():
        for ep in dist.entry_points:
            if ep.group.startswith("fw."):
                out[(ep.group, ep.name)] = (dist.metadata["Name"], dist.version)
    return out


def discover(kind: str) -> list[Discovered]:
    """Every plugin registered for ``kind``; loads and checks specs (light), never implementations."""
    from stevedore import ExtensionManager

    kind = canonical_kind(kind)
    if kind not in INTERFACES:
        raise PluginError(f"unknown plugin kind {kind!r} (kinds: {', '.join(KINDS)})")
    dists = _distributions()
    failures: dict[tuple[str, str], str] = {}

    def on_failure(manager, ep, exc):
        failures[(manager.namespace, ep.name)] = f"{type(exc).__name__}: {exc}"

    found: dict[str, Discovered] = {}
    for group in _groups(kind):
        manager = ExtensionManager(group, invoke_on_load=False, on_load_failure_callback=on_failure)
        for ext in manager.extensions:
            dist, version = dists.get((group, ext.name), (None, None))
            item = Discovered(kind, ext.name, ext.entry_point.value, dist, version)
            item.error = _check_spec(kind, ext.name, ext.plugin)
            item.spec = None if item.error else ext.plugin
            found.setdefault(ext.name, item)
        for ep in importlib.metadata.entry_points(group=group):
            error = failures.get((group, ep.name))
            if error:
                dist, version = dists.get((group, ep.name), (None, None))
                found.setdefault(ep.name, Discovered(kind, ep.name, ep.value, dist, version, error=error))
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
    """The spec of the plugin named ``name`` (or one of its aliases); a PluginError says why there is none."""
    kind = canonical_kind(kind)
    found = discover(kind)
    item = next((d for d in found if d.name == name), None) or next(
        (d for d in found if d.spec is not None and name in d.spec.aliases), None
    )
    if item is None:
        choices = ", ".join(sorted(available(kind))) or "none installed"
        raise PluginError(f"unknown {kind} plugin {name!r} (available: {choices})")
    if not item.enabled:
        raise PluginError(f"{kind} plugin {name!r} is disabled by FW_PLUGINS / FW_DISABLE_PLUGINS")
    if item.error:
        raise PluginError(f"{item.label} is broken: {item.error}")
    return item.spec


# Parser kinds -> what their plugins are called in messages, and the class each implementation must be.
PARSERS = {"tool_parsers": ("tool-call parser", tool_parser.ToolParser),
           "reasoning_parsers": ("reasoning parser", reasoning_parser.ReasoningParser)}


def load_parser(kind: str, name: str) -> type:
    """The class of the ``kind`` parser named ``name`` (``--tool-call-parser`` / ``--reasoning-parser``),
    imported; built per request. A PluginError names the installed parsers when there is none by that name."""
    noun, base = PARSERS[kind]
    installed = available(kind)
    if name not in installed and all(d.name != name for d in discover(kind)):
        raise PluginError(f"unknown {noun} {name!r} (installed: {', '.join(sorted(installed)) or 'none'})")
    spec = get_spec(kind, name)  # says why an installed one cannot be used (disabled, broken)
    impl = spec.load()
    if not (isinstance(impl, type) and issubclass(impl, base)):
        raise PluginError(f"{noun} {name!r} ({spec.impl}) is not a {base.__module__}.{base.__name__}")
    return impl


def impl_problem(spec: PluginSpec) -> str | None:
    """Why ``spec.impl`` does not resolve, naming the plugin's distribution; None when it does (imports it)."""
    try:
        spec.load()
    except PluginError as exc:
        item = next((d for d in discover(spec.kind) if d.name == spec.name), None)
        label = item.label if item else f"{spec.kind} plugin {spec.name!r}"
        cause = exc.__cause__
        return f"{label} is broken: impl {spec.impl!r} does not resolve: {type(cause).__name__}: {cause}"
    return None


def by_priority(specs: Iterable[PluginSpec]) -> list[list[PluginSpec]]:
    """``specs`` grouped by priority, highest first (a group of several is a tie "auto" refuses)."""
    ranked = sorted(specs, key=lambda s: -s.priority)
    return [list(group) for _, group in itertools.groupby(ranked, key=lambda s: s.priority)]


def build(kind: str, check: CheckResult, *args: Any) -> Any:
    """The plugin ``fw.validate.check`` chose for ``kind``, built: its implementation called with the options the
    check parsed, then ``args`` (what the kind's interface takes beside them). A KV connector is two halves, each
    built where it runs: ``kind`` "kv_connector.scheduler" or "kv_connector.worker". None for an empty slot."""
    slot, _, half = kind.partition(".")
    spec = check.selected.get(slot)
    if spec is None:
        return None
    impl = spec.load()
    return (getattr(impl, half) if half else impl)(check.options.get(slot), *args)


def load_driver(kind: str, name: str, options: dict[str, Any] | None = None) -> tuple[Any, Any]:
    """A slot's plugin by name, imported, with ``options`` parsed: (implementation, options). For comm, whose
    communicators ``fw.distributed`` builds (one per group) in every process that joins the world."""
    spec = get_spec(kind, name)
    return spec.load(), spec.parse_options(options)


@cache
def get_plugin_manager():
    """The process-wide pluggy manager with every enabled ``fw.hooks`` plugin registered."""
    import pluggy

    from fw.interfaces import hooks

    pm = pluggy.PluginManager(hooks.PROJECT)
    pm.add_hookspecs(hooks)
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
    """An engine (or `fw plugins check`) starts: tell hooks plugins its configuration, once."""
    get_plugin_manager().hook.fw_configure(config=config)


def unconfigure(config: Any) -> None:
    get_plugin_manager().hook.fw_unconfigure(config=config)


def refresh() -> None:
    """Forget discovered entry points, e.g. after installing a plugin into the running process's environment."""
    from stevedore import ExtensionManager

    ExtensionManager.ENTRY_POINT_CACHE.clear()
    get_plugin_manager.cache_clear()

"""The import rules that keep the plugin API a leaf (issue 33), checked on the source with ``ast``.

- ``fw.interfaces`` imports nothing of fw but itself and ``fw.sdk``; ``fw.sdk`` nothing but itself and
  ``fw.interfaces``. Every import counts, inside functions and under ``TYPE_CHECKING`` too: an annotation
  that names a core class still ties the interface to it.
- A plugin (its package under ``plugins/<kind>/<name>/`` or ``contrib/<dist>/``, not its tests) imports of fw
  only ``fw.interfaces``, ``fw.sdk`` and ``fw.testing``, and no other plugin's package nor the CLI.
- The core imports no plugin and not the CLI, and its modules form no import cycle. Imports inside functions
  count (they are how cycles hide); those under ``TYPE_CHECKING`` do not, as they never run.

``test_the_checker_reports_each_planted_violation`` is the control: a small tree that breaks every rule once,
each break reported, so that this file fails when a rule stops being enforced.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PLUGIN_ALLOWED = ("fw.interfaces", "fw.sdk", "fw.testing")


@dataclass(frozen=True)
class Module:
    name: str  # dotted
    path: Path
    is_package: bool
    kind: str  # "core", "cli" or "plugin"
    package: str  # its top-level package


@dataclass(frozen=True)
class Import:
    target: str  # dotted, resolved against the modules of the tree
    line: int
    type_checking: bool


def _modules_under(base: Path, kind: str) -> list[Module]:
    """Every module of each package directly under ``base`` (a dir with ``__init__.py``), tests excluded."""
    out = []
    for init in sorted(base.glob("*/__init__.py")):
        top = init.parent
        if top.name == "tests":
            continue
        for path in sorted(top.rglob("*.py")):
            rel = path.relative_to(base).with_suffix("")
            if "tests" in rel.parts:
                continue
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            out.append(Module(".".join(parts), path, rel.name == "__init__", kind, top.name))
    return out


def collect(root: Path) -> list[Module]:
    """The core (``core/fw``), the CLI (``cli/``), and every plugin package under ``plugins/*/*/`` and ``contrib/*/``."""
    mods = _modules_under(root / "core", "core") + _modules_under(root / "cli", "cli")
    for dist in sorted([*root.glob("plugins/*/*"), *root.glob("contrib/*")]):
        if dist.is_dir():
            mods += _modules_under(dist, "plugin")
    return mods


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _walk(node: ast.AST, guarded: bool = False):
    """Every Import/ImportFrom node anywhere under ``node``, with whether an ``if TYPE_CHECKING:`` guards it."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child, guarded
        if isinstance(child, ast.If) and _is_type_checking(child.test):
            for stmt in child.body:
                yield from _walk(ast.Module(body=[stmt], type_ignores=[]), True)
            for stmt in child.orelse:
                yield from _walk(ast.Module(body=[stmt], type_ignores=[]), guarded)
        else:
            yield from _walk(child, guarded)


def imports_of(mod: Module, known: set[str]) -> list[Import]:
    tree = ast.parse(mod.path.read_text(encoding="utf-8"), str(mod.path))
    out = []
    for node, guarded in _walk(tree):
        if isinstance(node, ast.Import):
            out += [Import(alias.name, node.lineno, guarded) for alias in node.names]
            continue
        base = node.module or ""
        if node.level:  # relative: against the module's own package
            package = mod.name.split(".") if mod.is_package else mod.name.split(".")[:-1]
            base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
        for alias in node.names:
            sub = f"{base}.{alias.name}"
            out.append(Import(sub if sub in known else base, node.lineno, guarded))
    return out


def _within(target: str, packages: tuple[str, ...]) -> bool:
    return any(target == p or target.startswith(p + ".") for p in packages)


def _layer_problem(mod: Module, target: str, plugin_packages: set[str]) -> str | None:
    top = target.split(".")[0]
    if mod.kind == "plugin":
        if top == "fw" and not _within(target, PLUGIN_ALLOWED):
            return "a plugin imports of fw only fw.interfaces, fw.sdk and fw.testing"
        if (top in plugin_packages or top == "fw_cli") and top != mod.package:
            return "a plugin imports no other plugin's package nor the CLI"
    elif mod.kind == "core":
        if top in plugin_packages or top == "fw_cli":
            return "the core imports no plugin and not the CLI"
        for layer, allowed in (("fw.interfaces", ("fw.interfaces", "fw.sdk")), ("fw.sdk", ("fw.sdk", "fw.interfaces"))):
            if _within(mod.name, (layer,)) and top == "fw" and not _within(target, allowed):
                return f"{layer} imports of fw only {' and '.join(allowed)}"
    return None


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def violations(root: Path) -> list[str]:
    """Every broken rule in the tree at ``root``, one line each (``path:line: module -> target: rule``)."""
    mods = collect(root)
    known = {m.name for m in mods}
    plugin_packages = {m.package for m in mods if m.kind == "plugin"}
    core = {m.name for m in mods if m.kind == "core"}
    graph: dict[str, set[str]] = {name: set() for name in core}
    out = []
    for mod in mods:
        for imp in imports_of(mod, known):
            problem = _layer_problem(mod, imp.target, plugin_packages)
            if problem:
                out.append(f"{mod.path.relative_to(root)}:{imp.line}: {mod.name} -> {imp.target}: {problem}")
            if mod.kind == "core" and imp.target in core and imp.target != mod.name and not imp.type_checking:
                graph[mod.name].add(imp.target)
    out = list(dict.fromkeys(out))  # one line per import statement and target, however many names it takes
    out += [f"import cycle among core modules: {' <-> '.join(c)}" for c in _cycles(graph)]
    return out


def test_the_tree_follows_the_import_rules():
    found = violations(ROOT)
    assert not found, "\n".join(found)


def test_the_checker_sees_the_whole_tree():
    names = {m.name: m.kind for m in collect(ROOT)}
    assert names["fw.interfaces.quant"] == names["fw.sdk.moe"] == "core"
    assert names["fw_cli.main"] == "cli"
    assert names["fw_attention_torch.backend"] == names["fw_sampler_typical.spec"] == "plugin"


PLANTED = {
    "core/fw/__init__.py": "",
    "core/fw/engine.py": "",
    "core/fw/config.py": "",
    "core/fw/interfaces/__init__.py": "",
    "core/fw/interfaces/base.py": "def f():\n    from fw.engine import Engine\n",
    "core/fw/interfaces/typed.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from fw.config import C\n",
    "core/fw/interfaces/fine.py": "from fw.sdk import helpers\nfrom . import base\n",
    "core/fw/sdk/__init__.py": "",
    "core/fw/sdk/helpers.py": "import fw.config\nfrom fw.interfaces import base\n",
    "core/fw/a.py": "import fw.b\n",
    "core/fw/b.py": "def g():\n    from fw import a\n",
    "core/fw/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from fw import d\n",
    "core/fw/d.py": "from fw import c\n",
    "core/fw/uses_plugin.py": "import fw_quant_bar\n",
    "cli/fw_cli/__init__.py": "from fw import engine\n",
    "plugins/quant/foo/fw_quant_foo/__init__.py": (
        "from fw.sdk import helpers\nfrom fw.interfaces import base\nfrom fw_quant_foo import own\n"
        "def load():\n    from fw.engine import Engine\n"
    ),
    "plugins/quant/foo/fw_quant_foo/own.py": "from fw_quant_bar.method import M\n",
    "plugins/quant/foo/tests/test_foo.py": "from fw.engine import Engine\nimport fw_quant_bar\n",
    "plugins/quant/bar/fw_quant_bar/__init__.py": "",
    "plugins/quant/bar/fw_quant_bar/method.py": "from fw.testing import conformance\nimport fw_cli\n",
    "contrib/fw-x/fw_x/__init__.py": "from fw.config import CliOption\n",
}


def test_the_checker_reports_each_planted_violation(tmp_path):
    for rel, text in PLANTED.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    found = violations(tmp_path)
    expected = [
        "core/fw/interfaces/base.py:2: fw.interfaces.base -> fw.engine: fw.interfaces imports",  # inside a function
        "core/fw/interfaces/typed.py:3: fw.interfaces.typed -> fw.config: fw.interfaces imports",  # TYPE_CHECKING
        "core/fw/sdk/helpers.py:1: fw.sdk.helpers -> fw.config: fw.sdk imports",
        "core/fw/uses_plugin.py:1: fw.uses_plugin -> fw_quant_bar: the core imports no plugin",
        "plugins/quant/foo/fw_quant_foo/__init__.py:5: fw_quant_foo -> fw.engine: a plugin imports of fw only",
        "plugins/quant/foo/fw_quant_foo/own.py:1: fw_quant_foo.own -> fw_quant_bar.method: a plugin imports no other",
        "plugins/quant/bar/fw_quant_bar/method.py:2: fw_quant_bar.method -> fw_cli: a plugin imports no other",
        "contrib/fw-x/fw_x/__init__.py:1: fw_x -> fw.config: a plugin imports of fw only",
        "import cycle among core modules: fw.a <-> fw.b",  # closed by an import inside a function
    ]
    for line in expected:
        assert any(f.startswith(line) for f in found), f"not reported: {line}\nreported:\n" + "\n".join(found)
    # Nothing else: plugin tests, allowed imports, relative imports and a TYPE_CHECKING-only loop pass.
    assert len(found) == len(expected), "\n".join(found)

"""The engine boundary (fw.engine.client): outside the engine package, core, cli and plugins reach an engine only
through ``EngineClient`` / ``SyncEngineClient``. Checked over the source with ast (comments and strings do not
count), with planted violations as controls."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENGINE = ROOT / "core" / "fw" / "engine"
# The scheduler and its KV-transfer bookkeeping are the engine core's parts.
INSIDE = (ENGINE, ROOT / "core" / "fw" / "scheduler.py", ROOT / "core" / "fw" / "kv_transfers.py")
ENGINE_NAMES = {"engine", "llm_engine"}  # what callers name an engine or engine client


def _members(path: Path, *classes: str) -> set[str]:
    """The methods and class attributes of these classes in one module, and the ``self.x`` their methods set."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ClassDef) and node.name in classes:
            for item in node.body:
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                    names.add(item.name)
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    names.add(item.target.id)
            names |= {
                item.attr for item in ast.walk(node)
                if isinstance(item, ast.Attribute) and isinstance(item.ctx, ast.Store)
                and isinstance(item.value, ast.Name) and item.value.id == "self"
            }
    return {n for n in names if not n.startswith("__")}


PUBLIC = _members(ENGINE / "client.py", "_EngineFacts", "EngineClient", "SyncEngineClient")
HIDDEN = (_members(ENGINE / "core.py", "LLMEngine") | _members(ENGINE / "async_engine.py", "AsyncEngine")) - PUBLIC
SCHEDULER_MEMBERS = _members(ROOT / "core" / "fw" / "scheduler.py", "Scheduler")


def _last_name(node: ast.expr) -> str:
    """The identifier an expression ends with: ``self.engine`` -> engine, ``llm.llm_engine`` -> llm_engine."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return ""


def violations(source: str, name: str) -> list[str]:
    """What one module reads past the boundary: the scheduler, an engine's hidden members, ``fw.scheduler``."""
    tree = ast.parse(source)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    found = []
    for node in ast.walk(tree):
        where = f"{name}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import | ast.ImportFrom):
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else [
                node.module or "", *(f"{node.module}.{a.name}" for a in node.names)]
            if "fw.scheduler" in modules:
                found.append(f"{where} imports fw.scheduler")
        if not isinstance(node, ast.Attribute):
            continue
        owner = _last_name(node.value)
        if owner.endswith("config"):  # config.scheduler: the configuration's section, not the scheduler
            continue
        parent = parents.get(node)
        if node.attr == "scheduler" and (owner in ENGINE_NAMES or (
                isinstance(parent, ast.Attribute) and parent.attr in SCHEDULER_MEMBERS)):
            found.append(f"{where} reads {ast.unparse(node)}")
        elif node.attr in HIDDEN and owner in ENGINE_NAMES:
            found.append(f"{where} reads {ast.unparse(node)}, which EngineClient hides")
    return found


def outside_modules() -> list[Path]:
    """Core, cli and plugin modules outside the engine package (their tests aside)."""
    files = [*(ROOT / "core" / "fw").rglob("*.py"), *(ROOT / "cli").rglob("*.py"), *(ROOT / "plugins").rglob("*.py")]
    return [
        f for f in files
        if not any(f == inside or inside in f.parents for inside in INSIDE)
        and "tests" not in f.relative_to(ROOT).parts and not f.name.startswith("test_")
    ]


def test_nothing_outside_the_engine_package_reads_past_the_boundary():
    modules = outside_modules()
    assert len(modules) > 50 and ROOT / "cli" / "fw_cli" / "server" / "metrics.py" in modules
    found = [v for f in modules for v in violations(f.read_text(), str(f.relative_to(ROOT)))]
    assert not found, "\n".join(found)


def test_the_router_holds_no_engine():
    """``fw router`` reaches its engines through the servers' HTTP API only: it imports nothing of ``fw``."""
    tree = ast.parse((ROOT / "cli" / "fw_cli" / "router.py").read_text())
    modules = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    modules |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not {m for m in modules if m == "fw" or m.startswith("fw.")}, modules


def test_the_hidden_members_are_the_engines_internals():
    assert {"scheduler", "kv", "executor", "groups", "sampler", "before_forward", "engine"} <= HIDDEN
    assert {"view", "stats", "generate_many", "add_request", "step", "shutdown"}.isdisjoint(HIDDEN)


@pytest.mark.parametrize("planted", [
    "def metrics(engine):\n    return len(engine.scheduler.running)\n",
    "class Server:\n    def idle(self):\n        return not self.engine.engine.has_unfinished_requests()\n",
    "def usage(llm):\n    return llm.llm_engine.kv.usage()\n",
    "def waiting(front):\n    return front.replica.scheduler.waiting\n",
    "from fw.scheduler import Scheduler\n",
    "def patch(engine, f):\n    engine.executor.execute = f\n",
])
def test_a_planted_violation_is_flagged(planted):
    assert violations(planted, "planted.py"), planted


def test_configuration_and_connector_halves_are_not_the_scheduler():
    allowed = (
        "def budget(config, resolved):\n"
        "    return config.scheduler.max_num_seqs, resolved.config.scheduler.enable_chunked_prefill\n"
        "def halves(pair, options):\n    return pair.scheduler(options, 16), pair.scheduler\n"
        "def facts(engine):\n    return engine.view.tokenizer, engine.stats().running, engine.has_unfinished_requests()\n"
    )
    assert violations(allowed, "allowed.py") == []


def test_stats_are_a_frozen_snapshot_replaced_as_the_engine_runs(tiny):
    """/metrics reads ``stats()`` from another thread: a frozen object the engine replaces, never one it changes."""
    import dataclasses

    from fw import LLM, SamplingParams

    engine = LLM(tiny, num_kv_blocks=32, max_model_len=128).llm_engine
    idle = engine.stats()
    assert (idle.running, idle.waiting, idle.kv_cache_usage, idle.kv_connector) == (0, 0, 0.0, None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        idle.running = 1
    engine.add_request({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=4, ignore_eos=True), "r")
    queued = engine.stats()
    assert queued is not idle and (queued.running, queued.waiting) == (0, 1)
    engine.step()
    running = engine.stats()
    assert (running.running, running.waiting) == (1, 0) and running.kv_cache_usage > 0
    assert running.prefix_cache_queries >= 3
    while engine.has_unfinished_requests():
        engine.step()
    assert (engine.stats().running, engine.stats().kv_cache_usage) == (0, 0.0)
    assert (queued.running, queued.waiting) == (0, 1)  # a reader's snapshot never changes under it
    engine.shutdown()

"""Shared fixtures: run the `fw` CLI in a subprocess, and fake installed plugin distributions."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def run_fw(*args: str, env: dict[str, str] | None = None, pythonpath: Path | None = None) -> subprocess.CompletedProcess:
    full_env = {**os.environ, **(env or {})}
    if pythonpath is not None:
        full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(pythonpath), full_env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-m", "fw_cli", *args], capture_output=True, text=True, env=full_env, timeout=300
    )


def make_site(root: Path, dist: str, entry_points: dict[str, dict[str, str]], modules: dict[str, str]) -> Path:
    """A directory that looks like site-packages holding one installed distribution."""
    root.mkdir(parents=True, exist_ok=True)
    info = root / f"{dist.replace('-', '_')}-0.0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.0.1\n")
    lines = []
    for group, eps in entry_points.items():
        lines.append(f"[{group}]")
        lines += [f"{name} = {target}" for name, target in eps.items()]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    for name, source in modules.items():
        (root / f"{name}.py").write_text(textwrap.dedent(source))
    return root


@pytest.fixture
def fw_cli():
    return run_fw


@pytest.fixture
def fake_site(tmp_path):
    def build(dist: str, entry_points: dict[str, dict[str, str]], modules: dict[str, str]) -> Path:
        return make_site(tmp_path / "site", dist, entry_points, modules)

    return build

"""Every plugin in contrib/ builds and passes its own tests in a fresh virtualenv, with AUTHORING.md's commands."""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sysconfig
import venv
from pathlib import Path

import pytest
import tomllib

from conftest import REPO

EXAMPLES = sorted(p.parent for p in (REPO / "contrib").glob("*/pyproject.toml"))


def authoring_commands() -> str:
    """The block of contrib/AUTHORING.md that builds and tests a plugin: what authors run, and CI with them."""
    match = re.search(r"<!-- ci: .*? -->\n```bash\n(.*?)```", (REPO / "contrib" / "AUTHORING.md").read_text(), re.S)
    assert match, "AUTHORING.md lost its marked block of build-and-test commands"
    return match.group(1)


def fresh_venv(path: Path) -> dict[str, str]:
    """A new virtualenv that sees this environment's packages (fw, torch, pytest, hatchling) beneath its own, so
    that nothing is downloaded or copied; the environment variables that activate it."""
    venv.create(path, with_pip=False)
    site_packages = Path(sysconfig.get_paths(vars={"base": str(path), "platbase": str(path)})["purelib"])
    parent = sysconfig.get_paths()["purelib"]
    (site_packages / "parent-environment.pth").write_text(f"import site; site.addsitedir({parent!r})\n")
    return {"VIRTUAL_ENV": str(path), "PATH": f"{path / 'bin'}{os.pathsep}{os.environ['PATH']}"}


def test_examples_are_not_installed_here_and_the_core_never_names_them():
    assert len(EXAMPLES) >= 4
    installed = {d.metadata["Name"] for d in importlib.metadata.distributions()}
    core_text = "".join(p.read_text() for p in (REPO / "core").rglob("*.py"))
    for example in EXAMPLES:
        project = tomllib.loads((example / "pyproject.toml").read_text())["project"]
        assert project["name"] not in installed, f"{project['name']} must not be installed in the test environment"
        # Each example arrives only through its entry points: no core module imports it.
        assert project["name"].replace("-", "_") not in core_text


@pytest.fixture(scope="module")
def example_runs(tmp_path_factory):
    """example_runs(example) -> (return code, stdout, stderr) of AUTHORING.md's commands for ``example``, each run
    in a fresh virtualenv of its own. The first call starts the runs of every example at once (they share nothing
    but the parent environment, which they only read); each test then waits for its own."""
    started = {}

    def start(example: Path) -> None:
        root = tmp_path_factory.mktemp(example.name)
        env = {
            **os.environ,
            **fresh_venv(root / "venv"),
            "PLUGIN": str(example),
            # Build with the hatchling beneath and download nothing: fw-core, the one dependency, is installed.
            "PIP_NO_BUILD_ISOLATION": "0",
            "PIP_NO_INDEX": "1",
            "PIP_DISABLE_PIP_VERSION_CHECK": "1",
        }
        # Output to files, not pipes: a pipe nobody reads yet would stall its run once full.
        with open(root / "stdout", "w") as out, open(root / "stderr", "w") as err:
            proc = subprocess.Popen(["bash", "-euo", "pipefail", "-c", authoring_commands()], env=env, cwd=root,
                                    stdout=out, stderr=err)
        started[example] = (proc, root)

    def result(example: Path) -> tuple[int, str, str]:
        if not started:
            for each in EXAMPLES:
                start(each)
        proc, root = started[example]
        proc.wait(timeout=900)
        return proc.returncode, (root / "stdout").read_text(), (root / "stderr").read_text()

    yield result
    for proc, _ in started.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_example_builds_and_passes_its_tests_in_a_fresh_venv(example, example_runs):
    returncode, stdout, stderr = example_runs(example)
    assert returncode == 0, stdout[-4000:] + stderr[-4000:]

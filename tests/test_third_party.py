"""A third-party plugin from contrib/ installs, lists, takes effect, passes its suite, and uninstalls."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import REPO, run_fw

EXAMPLE = REPO / "contrib" / "fw-sampler-typical"


def pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", *args], check=True, timeout=300)


@pytest.fixture
def tiny_llama(tmp_path):
    from fw.testing.models import make_tiny_model

    return make_tiny_model("LlamaForCausalLM", tmp_path / "llama")


def test_install_use_and_uninstall_the_example(tiny_llama):
    names = [line.split()[0] for line in run_fw("plugins", "list", "--kind", "sampler").stdout.splitlines()[1:]]
    assert "typical" not in names, "the example must not be installed before this test"
    # No core file names the example: it arrives only through its entry point.
    core_text = "".join(p.read_text() for p in (REPO / "core").rglob("*.py"))
    assert "typical" not in core_text
    pip("install", "--no-deps", "--no-build-isolation", str(EXAMPLE))
    try:
        listed = run_fw("plugins", "list", "--kind", "sampler")
        assert "typical" in listed.stdout and "fw-sampler-typical 0.1.0" in listed.stdout
        bad = run_fw("plugins", "check", "--sampler", "typical", "--plugin-option", "sampler.mass=2", "--device", "cpu")
        assert bad.returncode == 1 and "sampler.options: mass: Input should be less than or equal to 1" in bad.stderr
        # Selected, it takes effect: with a tiny mass only the single most typical token survives, so
        # sampling at temperature 1 is deterministic, whatever the seed.
        runs = {
            run_fw("generate", "--model", str(tiny_llama), "--prompt", "Hello", "--max-tokens", "8", "--temperature",
                   "1", "--seed", str(seed), "--num-kv-blocks", "16", "--max-model-len", "128", "--sampler", "typical", "--plugin-option",
                   "sampler.mass=1e-9").stdout
            for seed in (1, 2, 3)
        }
        assert len(runs) == 1 and next(iter(runs)).startswith("Hello")
        default = {
            run_fw("generate", "--model", str(tiny_llama), "--prompt", "Hello", "--max-tokens", "8", "--temperature",
                   "1", "--seed", str(seed), "--num-kv-blocks", "16", "--max-model-len", "128").stdout
            for seed in (1, 2, 3)
        }
        assert len(default) > 1, "the default sampler should vary with the seed"
        suite = subprocess.run([sys.executable, "-m", "pytest", "-q", str(EXAMPLE / "tests"), "-p", "no:cacheprovider"],
                               capture_output=True, text=True, timeout=300)
        assert suite.returncode == 0, suite.stdout + suite.stderr
    finally:
        pip("uninstall", "-y", "fw-sampler-typical")
    after = run_fw("plugins", "check", "--sampler", "typical", "--device", "cpu")
    assert after.returncode == 1 and "unknown sampler plugin 'typical'" in after.stderr

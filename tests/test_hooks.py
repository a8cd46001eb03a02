"""A hooks plugin registered under fw.hooks is called at the documented points."""

from __future__ import annotations

import json
import time

import pytest

from conftest import run_fw
from fw.interfaces.hooks import hookimpl

HOOKS = """
import json, os
from pydantic import BaseModel
from fw.interfaces.hooks import hookimpl
from fw.interfaces.hooks import CliOption

def _log(event, **data):
    with open(os.environ["FW_TEST_HOOK_LOG"], "a") as f:
        f.write(json.dumps({"event": event, **data}) + "\\n")

class AuditSection(BaseModel, extra="forbid"):
    level: int = 1
    reject: bool = False

@hookimpl
def fw_config_sections():
    return {"audit": AuditSection}

@hookimpl
def fw_cli_options():
    return [CliOption("--audit-level", "audit.level", "How loud the audit is.")]

@hookimpl
def fw_configure(config):
    _log("configure", level=config.audit.level)

@hookimpl
def fw_validate(config, requirements):
    _log("validate", device=requirements.device)
    return ["audit says no"] if config.audit.reject else []

@hookimpl
def fw_detect_quant_format(model_path):
    _log("detect", model_path=model_path)
    return None

@hookimpl
def fw_engine_started(engine):
    _log("engine_started", sampler=engine.selected["sampler"])

@hookimpl
def fw_request_added(request_id, prompt_token_ids):
    _log("request_added", n=len(prompt_token_ids))

@hookimpl
def fw_logits_processors(sampling_params):
    def ban_all_but_seven(output_token_ids, logits):
        keep = logits[7].clone()
        logits.fill_(float("-inf"))
        logits[7] = keep
        return logits
    return [ban_all_but_seven]

@hookimpl
def fw_step_stats(stats):
    _log("step", step=stats.step, prefill=stats.num_prefill_tokens, decode=stats.num_decode_tokens,
         scheduled=stats.num_scheduled, tokens=stats.num_scheduled_tokens)

@hookimpl
def fw_request_finished(request_id, output):
    _log("request_finished", token_ids=output.outputs[0].token_ids)

@hookimpl
def fw_unconfigure(config):
    _log("unconfigure")
"""


def events(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_hooks_plugin_contributes_config_and_flags(fake_site, tmp_path):
    site = fake_site("fw-audit", {"fw.hooks": {"audit": "fw_audit_hooks"}}, {"fw_audit_hooks": HOOKS})
    log = tmp_path / "log.jsonl"
    env = {"FW_TEST_HOOK_LOG": str(log), "FW_AUDIT__REJECT": "false"}
    result = run_fw("config", "show", "--audit-level", "3", env=env, pythonpath=site)
    assert result.returncode == 0, result.stderr
    assert "audit:" in result.stdout and "level: 3  # --audit-level" in result.stdout
    assert "reject: false  # env FW_AUDIT__REJECT" in result.stdout
    listed = run_fw("plugins", "list", "--kind", "hooks", pythonpath=site)
    assert "audit" in listed.stdout and "fw-audit" in listed.stdout


def test_hooks_called_at_startup_and_validation(fake_site, tmp_path):
    site = fake_site("fw-audit", {"fw.hooks": {"audit": "fw_audit_hooks"}}, {"fw_audit_hooks": HOOKS})
    log = tmp_path / "log.jsonl"
    env = {"FW_TEST_HOOK_LOG": str(log)}
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": 64,
                                                   "num_attention_heads": 4}))
    result = run_fw("plugins", "check", "--device", "cpu", "--model", str(model), "--audit-level", "2", env=env,
                    pythonpath=site)
    assert result.returncode == 0, result.stderr
    assert [e["event"] for e in events(log)] == ["configure", "detect", "validate"]
    assert events(log)[0]["level"] == 2 and events(log)[1]["model_path"] == str(model)
    rejected = run_fw("plugins", "check", "--device", "cpu", "--model", str(model),
                      env={**env, "FW_AUDIT__REJECT": "1"}, pythonpath=site)
    assert rejected.returncode == 1 and "audit says no" in rejected.stderr
    disabled = run_fw("plugins", "check", "--device", "cpu", "--model", str(model),
                      env={**env, "FW_DISABLE_PLUGINS": "audit"}, pythonpath=site)
    assert disabled.returncode == 0


def test_misspelled_hook_is_an_error(fake_site):
    site = fake_site("fw-typo", {"fw.hooks": {"typo": "fw_typo_hooks"}},
                     {"fw_typo_hooks": "from fw import hookimpl\n@hookimpl\ndef fw_configur(config):\n    pass\n"})
    result = run_fw("plugins", "check", "--device", "cpu", pythonpath=site)
    assert result.returncode != 0 and "fw_configur" in result.stderr


def test_engine_hooks_run_at_their_points(fake_site, tmp_path):
    from fw.testing.models import make_tiny_model

    site = fake_site("fw-audit", {"fw.hooks": {"audit": "fw_audit_hooks"}}, {"fw_audit_hooks": HOOKS})
    model = make_tiny_model("LlamaForCausalLM", tmp_path / "llama")
    log = tmp_path / "log.jsonl"
    result = run_fw("generate", "--model", str(model), "--prompt", "Hello there", "--max-tokens", "3", "--ignore-eos",
                    "--num-kv-blocks", "16", "--max-model-len", "64", "--device", "cpu",
                    env={"FW_TEST_HOOK_LOG": str(log)}, pythonpath=site)
    assert result.returncode == 0, result.stderr
    seen = events(log)
    names = [e["event"] for e in seen]
    assert names == ["configure", "detect", "validate", "engine_started", "request_added", "step", "step", "step",
                     "request_finished", "unconfigure"]
    # The logits processor took effect: only token 7 could be sampled.
    assert seen[names.index("request_finished")]["token_ids"] == [7, 7, 7]
    prompt = seen[names.index("request_added")]["n"]
    steps = [{k: e[k] for k in ("step", "prefill", "decode", "scheduled", "tokens")} for e in seen if e["event"] == "step"]
    assert steps == [
        {"step": 0, "prefill": prompt, "decode": 0, "scheduled": 1, "tokens": prompt},
        {"step": 1, "prefill": 0, "decode": 1, "scheduled": 1, "tokens": 1},
        {"step": 2, "prefill": 0, "decode": 1, "scheduled": 1, "tokens": 1},
    ]


@pytest.fixture
def register(request):
    """Register a hooks plugin object in this process for one test."""
    from fw import plugins

    def add(plugin):
        name = plugins.get_plugin_manager().register(plugin)
        request.addfinalizer(lambda: plugins.get_plugin_manager().unregister(name=name))
        return plugin

    return add


class Recorder:
    def __init__(self):
        self.events = []

    @hookimpl
    def fw_configure(self, config):
        self.events.append(("configure", config.scheduler.max_num_seqs))

    @hookimpl
    def fw_engine_started(self, engine):
        self.events.append(("started", engine.config.scheduler.max_num_seqs))

    @hookimpl
    def fw_step_stats(self, stats, engine):
        self.events.append(("step", engine.config.scheduler.max_num_seqs))

    @hookimpl
    def fw_unconfigure(self, config):
        self.events.append(("unconfigure", config.scheduler.max_num_seqs))


def test_two_engines_in_one_process_each_see_their_own_configure(tiny, register):
    from fw import LLM, SamplingParams

    early = register(Recorder())
    engine = {"num_kv_blocks": 16, "max_model_len": 128, "device": "cpu"}
    first = LLM(tiny, max_num_seqs=3, **engine)
    # Registered after the first engine started: it sees the second engine only, never a replay of the first.
    late = register(Recorder())
    second = LLM(tiny, max_num_seqs=5, **engine)
    params = SamplingParams(max_tokens=1)
    first.generate(["Hello"], params, use_tqdm=False)
    second.generate(["Hello"], params, use_tqdm=False)
    first.shutdown()
    second.shutdown()
    assert early.events == [("configure", 3), ("started", 3), ("configure", 5), ("started", 5), ("step", 3),
                            ("step", 5), ("unconfigure", 3), ("unconfigure", 5)]
    assert late.events == [("configure", 5), ("started", 5), ("step", 3), ("step", 5), ("unconfigure", 3),
                           ("unconfigure", 5)]


def test_step_stats_time_first_use_compilation_apart_from_the_forward_pass(tiny, register, monkeypatch, tmp_path):
    from torch.utils import cpp_extension

    from fw import LLM, SamplingParams
    from fw.sdk import native

    class Stats:
        def __init__(self):
            self.seen = []

        @hookimpl
        def fw_step_stats(self, stats):
            self.seen.append(stats)

    recorded = register(Stats())
    build = cpp_extension.load

    def slow_build(**kwargs):  # a kernel that takes 2 s to build; the real ones build as they do
        return time.sleep(2) if kwargs["name"] == "fw_test_slow_build" else build(**kwargs)

    monkeypatch.setattr(cpp_extension, "load", slow_build)
    monkeypatch.setenv("FW_NATIVE", "1")
    monkeypatch.delenv("FW_NATIVE_BUILD", raising=False)  # kernels build in the step that first uses them
    llm = LLM(tiny, num_kv_blocks=16, max_model_len=128, device="cpu")
    runner = llm.llm_engine.executor.runner
    forward = runner.execute
    # The model builds its kernel on first use, inside the forward pass, as fw's CPU kernels do.
    source = tmp_path / "x.cpp"
    source.write_text("// builds slowly\n")
    monkeypatch.setattr(runner, "execute", lambda inputs: native.load("fw_test_slow_build", source) and forward(inputs))
    llm.generate(["Hello"], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    llm.shutdown()
    first, second = recorded.seen
    # The build is counted in its step, apart from the forward pass it interrupted.
    assert first.compile_seconds >= 2 and first.forward_seconds + first.compile_seconds <= first.step_seconds
    assert second.compile_seconds < first.compile_seconds and second.forward_seconds > 0  # built once

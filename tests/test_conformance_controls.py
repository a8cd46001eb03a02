"""Each conformance suite fails a deliberately broken plugin of its kind (controls/), on the tests meant to catch it."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from conftest import REPO, make_site

CONTROLS = REPO / "tests" / "controls"
KINDS = ("attention", "quant", "comm", "kv_connector", "sampler", "checkpoint_format", "tool_parsers", "reasoning_parsers",
         "spec_proposers")
# Suite class -> the tests its broken plugin must fail; every other test of the class must pass (or skip).
MUST_FAIL = {
    "TestAttention": {"test_paged_attention_matches_dense"},
    "TestQuant": {"test_linear_layers_match_the_dequantized_weights", "test_captured_decode_steps_give_the_eager_tokens"},
    "TestComm": {"test_collectives_on_two_cpu_processes"},
    "TestKVConnector": {"test_nothing_is_offered_before_anything_is_saved",
                        "test_saved_prompt_kv_loads_bit_exact_into_a_fresh_consumer"},
    "TestSampler": {"test_greedy_rows_take_the_argmax"},
    "TestSpecProposer": {"test_proposals_respect_k_and_the_vocabulary", "test_greedy_output_unchanged_through_an_engine"},
    "TestCheckpointFormat": {"test_weights_match_the_plain_model"},
    **{suite: {"test_samples_stream_as_they_parse_in_any_two_pieces_or_one_character_at_a_time",
               "test_samples_stream_as_they_parse_in_random_chunks", "test_any_text_streams_as_it_parses"}
       for suite in ("TestToolParser", "TestReasoningParser")},
    "TestHooks": {"test_hooks_keep_their_contracts", "test_runs_with_engines"},
}


def test_every_suite_fails_its_broken_plugin(tmp_path):
    entry_points = {f"fw.{kind}": {"broken": f"broken_plugins:{kind.upper()}"} for kind in KINDS}
    site = make_site(tmp_path / "site", "fw-broken-controls", {**entry_points, "fw.hooks": {"broken": "broken_hooks"}}, {})
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(site), str(CONTROLS), os.environ.get("PYTHONPATH")]))}
    outcomes: dict[str, dict[str, str]] = {}
    stdout = ""
    # The broken hooks plugin, registered process-wide, would break every engine the other suites start: it
    # runs in a process of its own.
    for select, extra in (("TestHooks", {}), ("not TestHooks", {"FW_DISABLE_PLUGINS": "hooks:broken"})):
        run = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "-k", select,
             str(CONTROLS / "suites.py")],
            capture_output=True, text=True, env={**env, **extra}, cwd=tmp_path, timeout=600,
        )
        stdout += run.stdout[-3000:] + run.stderr[-3000:]
        for outcome, cls, test in re.findall(r"^(PASSED|FAILED|SKIPPED|ERROR) \S*suites\.py::(\w+)::(\w+)", run.stdout,
                                             re.M):
            outcomes.setdefault(cls, {})[test] = outcome
    assert set(outcomes) == set(MUST_FAIL), stdout
    for cls, must_fail in MUST_FAIL.items():
        failed = {test for test, outcome in outcomes[cls].items() if outcome in ("FAILED", "ERROR")}
        assert failed == must_fail, f"{cls}: failed {sorted(failed)}, expected {sorted(must_fail)}\n{stdout}"

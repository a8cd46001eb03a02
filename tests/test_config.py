"""Configuration composition: defaults < files < FW_ environment < flags, with sources."""

from __future__ import annotations

import pytest

from conftest import run_fw
from fw.config import ConfigError, load_config


@pytest.fixture
def two_files(tmp_path):
    a = tmp_path / "a.yaml"
    a.write_text(
        "model:\n  dtype: bfloat16\nscheduler:\n  max_num_seqs: 4\n  max_num_batched_tokens: 1024\n"
        "sampler: default\n"
    )
    b = tmp_path / "b.toml"
    b.write_text("[scheduler]\nmax_num_batched_tokens = 4096\n[cache]\nblock_size = 32\nenable_prefix_caching = false\n")
    return str(a), str(b)


def shown(output: str) -> dict[str, tuple[str, str]]:
    """`fw config show` lines -> {leaf key path: (value, source)}."""
    out, stack = {}, []
    for line in output.splitlines():
        depth = (len(line) - len(line.lstrip())) // 2
        stack = stack[:depth]
        key, _, rest = line.strip().partition(":")
        if not rest.strip():
            stack.append(key)
            continue
        value, _, source = rest.strip().partition("  # ")
        out[".".join([*stack, key])] = (value, source)
    return out


def test_files_env_and_flags_merge_with_sources(two_files):
    a, b = two_files
    result = run_fw(
        "config", "show", "--config", a, "--config", b, "--max-num-seqs", "8",
        env={"FW_CACHE__BLOCK_SIZE": "64", "FW_SCHEDULER__MAX_NUM_SEQS": "6"},
    )
    assert result.returncode == 0, result.stderr
    values = shown(result.stdout)
    assert values["scheduler.max_num_seqs"] == ("8", "--max-num-seqs")  # flag beats env and file
    assert values["scheduler.max_num_batched_tokens"] == ("4096", b)  # later file beats earlier
    assert values["model.dtype"] == ('"bfloat16"', a)
    assert values["cache.block_size"] == ("64", "env FW_CACHE__BLOCK_SIZE")  # env beats files
    assert values["cache.enable_prefix_caching"] == ("false", b)
    assert values["sampler.name"] == ('"default"', a)
    assert values["scheduler.enable_chunked_prefill"] == ("true", "default")


def test_invalid_values_name_the_field_and_source(two_files, tmp_path):
    a, _ = two_files
    result = run_fw("config", "show", "--config", a, "--max-num-seqs", "0")
    assert result.returncode == 2
    assert "scheduler.max_num_seqs = '0' (from --max-num-seqs): Input should be greater than 0" in result.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text("cache:\n  block_size: lots\n  not_a_field: 1\n")
    result = run_fw("config", "show", "--config", str(bad))
    assert result.returncode == 2
    assert f"cache.block_size = 'lots' (from {bad})" in result.stderr
    assert "cache.not_a_field" in result.stderr and "Extra inputs are not permitted" in result.stderr
    result = run_fw("config", "show", env={"FW_PARALLEL__TENSOR_PARALLEL_SIZE": "-1"})
    assert "parallel.tensor_parallel_size = '-1' (from env FW_PARALLEL__TENSOR_PARALLEL_SIZE)" in result.stderr


def test_bad_choice_names_the_flag_and_the_valid_choices():
    result = run_fw("config", "show", "--dtype", "fp7")
    assert result.returncode == 2
    assert "--dtype" in result.stderr and "'auto', 'float32', 'bfloat16', 'float16'" in result.stderr


def test_missing_or_unknown_config_file(tmp_path):
    assert "no such file" in run_fw("config", "show", "--config", str(tmp_path / "x.yaml")).stderr
    ini = tmp_path / "x.ini"
    ini.write_text("[a]\n")
    assert "unknown format .ini" in run_fw("config", "show", "--config", str(ini)).stderr


def test_plugin_options_and_api_key_are_not_echoed():
    resolved = load_config(
        cli={"sampler": {"name": "default", "options": {"k": "1"}}, "server": {"api_key": "s3cret"}},
        cli_flags={"sampler.options.k": "--plugin-option"},
    )
    assert resolved.config.sampler.options == {"k": "1"}
    assert resolved.source("sampler.options.k") == "--plugin-option"
    assert resolved.config.server.api_key.get_secret_value() == "s3cret"
    assert "s3cret" not in repr(resolved.config)
    with pytest.raises(ConfigError, match="expected KIND.OPTION=VALUE"):
        from fw.config import parse_plugin_options

        parse_plugin_options(["mass=0.9"])


def test_plugin_options_alone_keep_the_slot_default_name():
    resolved = load_config(cli={"quant": {"options": {"dequantize": "true"}}})
    assert resolved.config.quant.name == "auto" and resolved.config.quant.options == {"dequantize": "true"}
    assert resolved.source("quant.name") == "default"


def test_misspelled_keys_name_the_file_and_the_key(tmp_path):
    bad = tmp_path / "layered.yaml"
    bad.write_text("steplgo:\n  path: /tmp/x\nschedular:\n  max_num_seqs: 4\ncache:\n  block_sise: 32\n")
    result = run_fw("config", "show", "--config", str(bad))
    assert result.returncode == 2
    assert f"steplgo (from {bad}): Extra inputs are not permitted" in result.stderr
    assert f"schedular (from {bad}): Extra inputs are not permitted (did you mean 'scheduler'?)" in result.stderr
    assert f"cache.block_sise = 32 (from {bad}): Extra inputs are not permitted (did you mean 'block_size'?)" \
        in result.stderr

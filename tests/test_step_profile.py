"""`fw bench latency --profile`: where a decode step goes, by part (fw.engine.step_profile). Shares, never timings."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

ARGS = ["--input-len", "8", "--output-len", "5", "--num-kv-blocks", "64", "--max-model-len", "64", "--num-iters", "1",
        "--profile"]


def bench(model: str, *args: str) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, "-m", "fw_cli", "bench", "latency", "--model", model, *ARGS, *args],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    return result


@pytest.mark.parametrize("eager", [False, True])
def test_the_profile_splits_decode_steps_into_parts_that_add_up(tiny, eager):
    result = bench(tiny, "--batch-size", "3", "--json", *(["--enforce-eager"] if eager else []))
    profile = json.loads(result.stdout)["profile"]
    assert profile["steps"] == 5 - 1  # the decode steps after each request's first token
    assert profile["captured"] is not eager
    parts = {row["part"]: row for row in profile["parts"]}
    assert all(row["ms_per_step"] >= 0 and row["share"] >= 0 for row in parts.values())
    assert sum(row["share"] for row in parts.values()) == pytest.approx(1.0)
    assert sum(row["ms_per_step"] for row in parts.values()) == pytest.approx(profile["step_ms"])
    for part in ("attention TorchAttention", "LM head", "embedding", "sampling", "RMSNorm",
                 "Python and small ops (forward)", "engine: scheduling, outputs"):
        assert part in parts, (part, list(parts))
    assert any(part.startswith("linear ") for part in parts)
    assert parts["sampling"]["ms_per_step"] > 0 and parts["attention TorchAttention"]["ms_per_step"] > 0


def test_the_profile_names_the_kernel_each_linear_layer_chose(tiny):
    # bf16: dense.linear chooses its kernels by measurement; the table names the operation and the candidate.
    result = bench(tiny, "--dtype", "bfloat16")
    lines = result.stdout.split("decode step profile: 4 steps, ")[1].splitlines()
    assert lines[1].split() == ["part", "ms/step", "share"]
    rows = {line.rsplit(None, 2)[0].strip(): line.rsplit(None, 2)[1:] for line in lines[2:] if line.strip()}
    assert any(part.startswith("linear dense.linear/") for part in rows), rows
    assert sum(float(share.rstrip("%")) for _, share in rows.values()) == pytest.approx(100, abs=0.1 * len(rows))

"""The Triton attention plugin beyond the conformance suite (tests/test_conformance.py): its record with and
without Triton's interpreter, the head sizes and GQA groups the suite does not use, its MLA against the torch
backend's, and whole models end to end. On a CPU everything runs in the interpreter (conftest.py), in
float32."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from conftest import fw_greedy, run_fw
from fw.testing.conformance import AttentionConformance
from fw.testing.models import make_tiny_model

triton = pytest.importorskip("triton", reason="triton is not installed (pip install triton)")
import triton.language as tl  # noqa: E402

from fw_attention_triton.kernel import _e4m3_to_float  # noqa: E402


def _record(interpret: str | None) -> list:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret is not None:
        env["TRITON_INTERPRET"] = interpret
    code = (
        "import sys\n"
        "from fw_attention_triton.spec import SPEC\n"
        "c = SPEC.capabilities\n"
        "print([sorted(c.devices), sorted(c.dtypes), SPEC.priority, 'torch' in sys.modules, 'triton' in sys.modules])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    return eval(out)


def test_record_follows_the_interpreter():
    """Compiled: CUDA in every float dtype, between torch (10) and the vendor kernels. Interpreted: the CPU too,
    float32 only, below torch so that "auto" never picks it. Neither imports torch or Triton to list."""
    assert _record(None) == [["cuda"], ["bfloat16", "float16", "float32"], 12, False, False]
    assert _record("1") == [["cpu", "cuda"], ["float32"], 5, False, False]


def test_refused_on_a_cpu_without_the_interpreter(tmp_path):
    path = make_tiny_model("Qwen2ForCausalLM", tmp_path / "qwen2")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-m", "fw_cli", "plugins", "check", "--attention", "triton", "--device", "cpu",
         "--model", str(path), "--block-size", "8"],
        capture_output=True, text=True, env=env, timeout=300,
    )
    assert result.returncode != 0
    assert "attention plugin 'triton' needs device cuda, got cpu" in result.stderr
    assert "does not support block size 8 (supports [16, 32, 64, 128])" in result.stderr


@pytest.mark.parametrize(
    "head_size, heads, block_size",
    [(80, (14, 2), 16), (96, (8, 8), 32), (128, (4, 1), 16), (256, (2, 2), 32)],
    ids=["80-group7", "96-mha", "128-mqa", "256"],
)
def test_head_sizes_and_groups(head_size, heads, block_size):
    """Head sizes that are not powers of two (padded tiles), a group of 7 (Qwen2-0.5B's 14 over 2: a tile's rows
    not filled by whole tokens), plain MHA and MQA, each with a sliding window and a soft cap."""
    suite = type("Shape", (AttentionConformance,), {"plugin": "triton", "head_size": head_size, "num_heads": heads})()
    suite._check(torch.float32, block_size, 8, soft_cap=5.0)


def test_fp8_cache_decoded_by_hand(monkeypatch):
    """GPUs below compute capability 8.9 have no float8_e4m3fn in Triton: the kernel reads the bytes and decodes
    them itself, to the same values."""
    from fw_attention_triton import backend

    monkeypatch.setattr(backend, "fp8_native", lambda device: False)
    suite = type("Bits", (AttentionConformance,), {"plugin": "triton"})()
    suite._check(torch.float32, 16, None, "fp8")
    suite._check_mla(torch.float32, 16, "fp8")


@triton.jit
def _decode(src, dst, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(dst + i, _e4m3_to_float(tl.load(src + i)))


def test_e4m3_decoding_covers_every_byte():
    every = torch.arange(256, dtype=torch.uint8)
    finite = ~torch.isnan(every.view(torch.float8_e4m3fn).float())
    out = torch.empty(256)
    _decode[(1,)](every, out, 256)
    torch.testing.assert_close(out[finite], every.view(torch.float8_e4m3fn).float()[finite], rtol=0, atol=0)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8", "int8"])
def test_mla_matches_the_torch_backend(kv_cache_dtype):
    """The kernel's absorbed MLA, prefill and decode, against the torch backend's (expanded prefill, absorbed
    decode) on the same cache contents: the schedules of tests/test_deepseek.py."""
    from test_deepseek import LENGTHS, SCHEDULES, run_mla

    from fw_attention_triton.backend import TritonAttention

    for schedule in ("mixed", "decode"):
        expected = run_mla(SCHEDULES[schedule], kv_cache_dtype, block=16)
        got = run_mla(SCHEDULES[schedule], kv_cache_dtype, backend=TritonAttention(), block=16)
        for rid in LENGTHS:
            torch.testing.assert_close(got[rid], expected[rid], rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    return make_tiny_model("Qwen2ForCausalLM", tmp_path_factory.mktemp("triton") / "qwen2")


def test_greedy_tokens_equal_the_torch_backend(qwen2):
    """A tiny Qwen2 in float32: prompts prefilled in chunks of 8 tokens beside decodes, as the engine batches."""
    settings = {"max_num_batched_tokens": 8, "block_size": 16}
    assert fw_greedy(qwen2, attention="triton", **settings) == fw_greedy(qwen2, attention="torch", **settings)


def test_serve_command_line_takes_triton(qwen2):
    result = run_fw("plugins", "check", "--attention", "triton", "--device", "cpu", "--model", str(qwen2))
    assert result.returncode == 0, result.stderr
    assert "attention: triton  (chosen by name)" in result.stdout


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("arch", ["Qwen2ForCausalLM", "DeepseekV2ForCausalLM"])
def test_cuda_greedy_tokens_equal_the_torch_backend(tmp_path, arch):
    """Compiled Triton (scripts/gpu-check.sh), float32: standard attention and MLA, prefill chunks and decodes."""
    path = make_tiny_model(arch, tmp_path / "model")
    settings = {"device": "cuda", "max_num_batched_tokens": 8}
    assert fw_greedy(path, attention="triton", **settings) == fw_greedy(path, attention="torch", **settings)

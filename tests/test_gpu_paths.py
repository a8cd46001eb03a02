"""The paths the CPU tests cover, run on a CUDA GPU against the CPU (scripts/gpu-check.sh runs them): fp8 weights
(also block-scaled, through the Triton GEMM; W8A8 also through torch._scaled_mm), GPTQ / AWQ integer weights (the
torch and Triton products) and quantized KV caches through the torch attention backend, end to end."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fw import LLM, SamplingParams
from fw.testing.models import make_tiny_model
from fw_quant_fp8 import testing as fp8
from fw_quant_gptq import testing as intq

PATHS = [("none", "auto"), ("fp8", "auto"), ("none", "fp8"), ("none", "int8")]


# Quantized checkpoints: (name, writer settings, the product forced per run through FW_KERNELS).
INT_PATHS = [("gptq", {"layout": "gptq", "act_order": True, "symmetric": False}, "int.linear=triton"),
             ("awq", {"layout": "awq"}, "int.linear=triton"),
             ("gptq", {"layout": "gptq", "bits": 8}, "int.linear=torch"),
             ("fp8-block", {"kind": "block", "block": (32, 48)}, "fp8.linear=triton"),
             ("fp8-w8a8", {"activations": "dynamic"}, "fp8.linear=triton")]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return str(make_tiny_model("Qwen2ForCausalLM", tmp_path_factory.mktemp("gpu") / "qwen2"))


@pytest.fixture(scope="module", params=range(len(INT_PATHS)), ids=[f"{p[0]}-{p[2]}" for p in INT_PATHS])
def int_model(request, model, tmp_path_factory):
    name, settings, kernels = INT_PATHS[request.param]
    writer = fp8.write_checkpoint if name.startswith("fp8") else intq.write_checkpoint
    path = writer(Path(model), tmp_path_factory.mktemp("int") / name, **settings)
    return str(path), kernels


def generate(model: str, device: str, quant: str, kv_cache_dtype: str):
    llm = LLM(model, device=device, quantization=quant, kv_cache_dtype=kv_cache_dtype, attention="torch",
              num_kv_blocks=64, max_model_len=128)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    out = llm.generate(["Hello world, this is", "x"], params)
    llm.shutdown()
    return [(o.outputs[0].token_ids, [d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids,
                                                                     strict=True)]) for o in out]


@pytest.mark.parametrize(("quant", "kv_cache_dtype"), PATHS)
def test_each_path_runs_on_the_cpu(model, quant, kv_cache_dtype):
    """The CPU half of the comparison below, so that the GPU test's own setup is exercised everywhere."""
    assert all(len(tokens) == 12 for tokens, _ in generate(model, "cpu", quant, kv_cache_dtype))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(("quant", "kv_cache_dtype"), PATHS)
def test_cuda_computes_what_the_cpu_computes(model, quant, kv_cache_dtype):
    # float32 throughout (the tiny model's dtype, no TF32 by default): only summation order differs
    cpu, cuda = generate(model, "cpu", quant, kv_cache_dtype), generate(model, "cuda", quant, kv_cache_dtype)
    for (tokens_cpu, lp_cpu), (tokens_cuda, lp_cuda) in zip(cpu, cuda, strict=True):
        assert tokens_cuda == tokens_cpu
        assert lp_cuda == pytest.approx(lp_cpu, abs=1e-3)


def test_each_integer_path_runs_on_the_cpu(int_model):
    path, _ = int_model
    assert all(len(tokens) == 12 for tokens, _ in generate(path, "cpu", None, "auto"))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_integer_products_compute_what_the_cpu_computes(int_model, monkeypatch):
    path, kernels = int_model
    cpu = generate(path, "cpu", None, "auto")
    monkeypatch.setenv("FW_KERNELS", kernels)
    cuda = generate(path, "cuda", None, "auto")
    for (tokens_cpu, lp_cpu), (tokens_cuda, lp_cuda) in zip(cpu, cuda, strict=True):
        assert tokens_cuda == tokens_cpu
        assert lp_cuda == pytest.approx(lp_cpu, abs=1e-3)

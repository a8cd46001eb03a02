"""The paths the CPU tests cover, run on a CUDA GPU against the CPU (scripts/gpu-check.sh runs them): fp8 weights
and quantized KV caches through the torch attention backend, end to end."""

from __future__ import annotations

import pytest
import torch

from fw import LLM, SamplingParams
from fw.testing.models import make_tiny_model

PATHS = [("none", "auto"), ("fp8", "auto"), ("none", "fp8"), ("none", "int8")]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return str(make_tiny_model("Qwen2ForCausalLM", tmp_path_factory.mktemp("gpu") / "qwen2"))


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

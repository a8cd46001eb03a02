"""Decode-step fast paths of float32 models: the native layer kernels in float32, and a GGUF head kept in the
file's Q8_0 blocks. Each must give what the plain path gives."""

from __future__ import annotations

import shutil

import gguf
import numpy as np
import pytest
import test_gguf as gguf_tests
import torch
from gguf import GGMLQuantizationType as Q

from fw.layers.layernorm import RMSNorm
from fw.layers.rotary import RotaryEmbedding
from fw.sdk import native_ops
from fw.sdk.activation import silu_and_mul
from fw.testing.models import make_tiny_model
from fw_quant_gguf.format import GGUFFormat
from fw_quant_gguf.method import GGUFMethod, quantize_q8_0
from fw_quant_gguf.spec import GGUFOptions


@pytest.fixture
def float32_kernels():
    if not native_ops.usable(torch.empty(1)):
        if shutil.which("c++") or shutil.which("g++"):
            pytest.fail("a C++ compiler is present, yet the native layer kernels did not build (see the log)")
        pytest.skip("no C++ compiler: the native kernels cannot be built here (the torch path serves)")


def _both(monkeypatch, fn):
    """``fn()`` on the native kernels, then on the torch path."""
    fast = fn()
    with monkeypatch.context() as m:
        m.setattr(native_ops, "usable", lambda x: False)
        return fast, fn()


@pytest.mark.parametrize("with_residual", [False, True])
def test_float32_native_rms_norm_matches_torch(float32_kernels, monkeypatch, with_residual):
    gen = torch.Generator().manual_seed(0)
    norm = RMSNorm(100, 1e-6, params_dtype=torch.float32)
    norm.weight.data.copy_(1 + 0.1 * torch.randn(100, generator=gen))
    x = 3 * torch.randn(37, 100, generator=gen)
    residual = torch.randn(37, 100, generator=gen) if with_residual else None
    fast, ref = _both(monkeypatch, lambda: norm(x, residual))
    torch.testing.assert_close(fast, ref, atol=1e-5, rtol=1e-5)


def test_float32_native_rotary_and_silu_match_torch(float32_kernels, monkeypatch):
    gen = torch.Generator().manual_seed(1)
    rope = RotaryEmbedding(64, {"rope_type": "default", "rope_theta": 1e6}, 4096)
    positions = torch.tensor([0, 1, 5, 900, 4000])
    qkv = torch.randn(5, 8 * 64, generator=gen)

    def rotate():
        q, k, _ = qkv.clone().split([256, 128, 128], dim=-1)
        return rope(positions, q.view(5, 4, 64), k.view(5, 2, 64))

    fast, ref = _both(monkeypatch, rotate)
    assert fast[0].stride(0) == 512  # rotated in place inside the fused projection's output
    torch.testing.assert_close(fast, ref, atol=1e-5, rtol=1e-5)
    x = 4 * torch.randn(9, 600, generator=gen)
    torch.testing.assert_close(*_both(monkeypatch, lambda: silu_and_mul(x)), atol=1e-5, rtol=1e-5)


def test_q8_0_requantization_gives_ggml_blocks():
    w = np.random.default_rng(0).standard_normal((7, 96)).astype(np.float32)
    w[3, :32] = 0  # an all-zero block: scale 0
    blocks = gguf.quants.quantize(w, Q.Q8_0)
    table = torch.from_numpy(gguf.quants.dequantize(blocks, Q.Q8_0).reshape(w.shape))
    assert torch.equal(quantize_q8_0(table), torch.from_numpy(blocks))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("embed_type", [Q.Q8_0, Q.F16, Q.Q6_K, Q.Q4_K])
@pytest.mark.parametrize("tied", [True, False])
def test_gguf_head_keeps_its_blocks(tmp_path, embed_type, tied, dtype):
    """A model whose head (tied table or output) came from Q8_0 or a K-quant computes its logits on the file's
    blocks, as its float32 head would, also where the table is held in bf16 (``--dtype bfloat16``); a float table
    keeps the float head. Hidden size 256: one K-quant super-block a row."""
    src = make_tiny_model("LlamaForCausalLM", tmp_path / "llama", tie_word_embeddings=tied, hidden_size=256)
    part = "embed_tokens" if tied else "lm_head"
    path = gguf_tests.write_gguf(src, tmp_path / "tiny.gguf", Q.Q8_0, {part: embed_type})
    model = gguf_tests.load_gguf(path, dtype)
    head = model.lm_head
    assert (head.quantized is not None) == (embed_type != Q.F16)
    name = "model.embed_tokens.weight" if tied else "lm_head.weight"
    table = dict(gguf_tests.dequantized_gguf(path, None))[name]  # the file's weights in float32
    hidden = torch.randn(5, model.config.hidden_size, generator=torch.Generator().manual_seed(2)).to(dtype)
    logits = head(hidden)
    assert logits.dtype == torch.float32
    if embed_type != Q.F16 or dtype == torch.float32:
        torch.testing.assert_close(logits, hidden.float() @ table.T, atol=1e-4, rtol=1e-4)
    if embed_type == Q.F16:
        return
    # The blocks are the file's own, of its type; blocks that do not decode to the table (here: read one byte
    # off) are refused.
    held = model.model.embed_tokens.weight if tied else table.to(dtype)
    config = GGUFFormat().config(str(path))["quantization_config"]
    found = GGUFMethod(GGUFOptions(), config)._file_head(held)
    assert found is not None and found[0] == embed_type
    config["head"]["offset"] += 1
    assert GGUFMethod(GGUFOptions(), config)._file_head(held) is None

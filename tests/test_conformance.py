"""Every built-in plugin passes the same conformance suite a third-party author runs."""

from functools import partial

import pytest

from fw.interfaces.attention import MLADims
from fw.testing.conformance import (
    AttentionConformance,
    CommConformance,
    KVConnectorConformance,
    QuantConformance,
    QuantFixture,
    SamplerConformance,
    plain_checkpoint,
)
from fw_quant_fp8 import testing as fp8
from fw_quant_fp8.numerics import INT8
from fw_quant_gptq import testing as gptq


class TestTorchAttention(AttentionConformance):
    plugin = "torch"


class TestFlashInferAttention(AttentionConformance):
    plugin = "flashinfer"


class TestFlashInferMLAAttention(AttentionConformance):
    plugin = "flashinfer_mla"
    mla = MLADims(512, 64, 128, 128)  # DeepSeek-V2/V3's, the kernel's only ones
    num_heads = (16, 1)  # DeepSeek-V3's 128 heads over 8 GPUs


class TestFlashAttnAttention(AttentionConformance):
    plugin = "flash_attn"


class TestTritonAttention(AttentionConformance):
    """On a CPU in Triton's interpreter (conftest.py), float32 only."""

    plugin = "triton"

    def test_captured_decode_steps_give_the_eager_tokens(self, tmp_path_factory) -> None:
        pytest.skip("on a CPU Triton runs in its interpreter, for its kernels' tests: an engine's step there takes "
                    "seconds, and decode steps are captured on the CPU only")


class TestUnquantized(QuantConformance):
    plugin = "none"


class TestFp8(QuantConformance):
    plugin = "fp8"
    # Weight-only, so that the layers compute with exactly the dequantized weights (W8A8 is tested against
    # references in test_quant_fp8.py). FP8 e4m3 keeps a random Gaussian layer within about 2.5%.
    options = {"activations": "none"}
    fixtures = {
        "none": QuantFixture(plain_checkpoint, fp8.rounded_at_load, 0.04),
        "compressed-tensors-fp8": QuantFixture(partial(fp8.write_checkpoint, activations=None), fp8.dequantized, 0.04),
        "fp8": QuantFixture(partial(fp8.write_checkpoint, kind="fp8", activations="static"), fp8.dequantized, 0.04),
    }


class TestFp8Blocks(TestFp8):
    # DeepSeek-V3 blocks, small enough that the tiny model's matrices hold several, and partial ones.
    fixtures = {**TestFp8.fixtures, "fp8": QuantFixture(partial(fp8.write_checkpoint, kind="block", block=(32, 48)),
                                                       fp8.dequantized, 0.04)}


class TestInt8(QuantConformance):
    plugin = "int8"
    # Weight-only, as TestFp8. Per-channel int8 keeps a random Gaussian layer within about 0.6%.
    options = {"activations": "none"}
    fixtures = {
        "none": QuantFixture(plain_checkpoint, partial(fp8.rounded_at_load, element=INT8), 0.01),
        "compressed-tensors-int8": QuantFixture(partial(fp8.write_checkpoint, activations=None, element=INT8),
                                                fp8.dequantized, 0.01),
    }


def _int(tolerance: float, **layout) -> QuantFixture:
    return QuantFixture(partial(gptq.write_checkpoint, **layout), gptq.dequantized, tolerance)


class TestGptq(QuantConformance):
    plugin = "gptq"
    # Round-to-nearest 4-bit keeps a random Gaussian layer within about 10%, 8-bit within 0.6%.
    fixtures = {"gptq": _int(0.12, layout="gptq", act_order=True),
                "pack-quantized": _int(0.12, layout="pack-quantized", symmetric=False, group=-1)}


class TestGptq8Bit(TestGptq):
    fixtures = {"gptq": _int(0.01, layout="gptq", bits=8, symmetric=False, group=64),
                "pack-quantized": _int(0.01, layout="pack-quantized", bits=8, act_order=True)}


class TestAwq(QuantConformance):
    plugin = "awq"
    fixtures = {"awq": _int(0.12, layout="awq", group=64)}


class TestTorchComm(CommConformance):
    plugin = "torch"


class TestDeepEPComm(CommConformance):
    plugin = "deepep"


class DirectoryConnector(KVConnectorConformance):
    """Connectors that keep their store in a directory: the test's own, not the default under /tmp."""

    def connector_options(self, role, tmp_path):
        return {**super().connector_options(role, tmp_path), "path": str(tmp_path)}


class TestDiskKVConnector(DirectoryConnector):
    plugin = "disk"


class TestOffloadKVConnector(DirectoryConnector):
    plugin = "offload"


class TestDefaultSampler(SamplerConformance):
    plugin = "default"

"""The int8 quant plugin against references we did not write: transformers + compressed-tensors load the same
compressed-tensors checkpoints (weights decompressed by them, activations fake-quantized by compressed-tensors'
own forward), and the W8A8 kernel's integer rounding against compressed-tensors' formula, tie for tie."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_quant_fp8 import FUSED, ct_reference

from conftest import assert_experts_match, assert_layers_match_modules, fw_greedy, hf_greedy, load_layers
from fw import model_registry
from fw.sdk.checkpoint import iter_safetensors
from fw.sdk.errors import ModelLoadError
from fw.testing.conformance import HooksConformance
from fw.testing.models import make_tiny_model
from fw_quant_fp8 import hooks as fp8_hooks
from fw_quant_fp8 import int8 as method
from fw_quant_fp8 import int8_hooks as hooks
from fw_quant_fp8 import testing as writer
from fw_quant_fp8.int8 import Int8Method
from fw_quant_fp8.numerics import INT8, dequantize, quantize_input
from fw_quant_fp8.spec import Fp8Options
from fw_quant_none.method import Unquantized


def int8_method(path, **options):
    return Int8Method(Fp8Options(**options), model_registry.read_hf_config(str(path)).get("quantization_config"))


def int8_pairs(model):
    """(fw layer, its checkpoint module names) for every INT8 linear layer of ``model``."""
    for name, layer in model.named_modules():
        if hasattr(layer, "linear_method") and layer.weight.dtype == torch.int8:
            stem, _, leaf = name.rpartition(".")
            yield layer, [f"{stem}.{m}" for m in FUSED.get(leaf, (leaf,))]


def fw_weight(layer):
    return dequantize(layer.weight, layer.weight_scale, None, torch.float32)


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    return make_tiny_model("LlamaForCausalLM", tmp_path_factory.mktemp("int8") / "plain")


@pytest.fixture(scope="module", params=[("channel", "dynamic"), ("tensor", "static"), ("channel", None)],
                ids=["w8a8-dynamic", "w8a8-static", "w8a16"])
def ct_checkpoint(request, plain, tmp_path_factory):
    weights, activations = request.param
    path = writer.write_checkpoint(plain, tmp_path_factory.mktemp("ct") / "ct", weights=weights,
                                   activations=activations, element=INT8)
    return path, ct_reference(path)


class TestInt8HooksConformance(HooksConformance):
    plugin = "int8"


def test_detects_int8_compressed_tensors_only(ct_checkpoint):
    path, _ = ct_checkpoint
    config = json.loads((path / "config.json").read_text())
    assert config["quantization_config"]["format"] == "int-quantized"
    assert hooks.fw_detect_quant_format(str(path), config) == "compressed-tensors-int8"
    assert fp8_hooks.fw_detect_quant_format(str(path), config) is None
    packed = json.loads(json.dumps(config))
    packed["quantization_config"]["format"] = "pack-quantized"  # fw-quant-gptq's
    assert hooks.fw_detect_quant_format(str(path), packed) is None
    assert hooks.fw_detect_quant_format(str(path), None) is None


def test_compressed_tensors_layers_match_the_reference(ct_checkpoint):
    path, reference = ct_checkpoint
    model = load_layers(path, int8_method(path))
    pairs = list(int8_pairs(model))
    assert len(pairs) == 4 * 2  # every linear layer of both decoder layers
    # Decoded weights exactly transformers + compressed-tensors'; integer dot products are exact, the reference's
    # float32 sums round.
    assert_layers_match_modules(pairs, reference, fw_weight, 2e-6)


def test_compressed_tensors_greedy_tokens_match_the_reference(ct_checkpoint):
    path, reference = ct_checkpoint
    assert fw_greedy(path) == hf_greedy(reference, path)


def test_w8a8_layers_run_integer_products_and_w8a16_widening_ones(ct_checkpoint):
    path, _ = ct_checkpoint
    w8a8 = "input_activations" in json.dumps(json.loads((path / "config.json").read_text())["quantization_config"])
    for layer, names in int8_pairs(load_layers(path, int8_method(path))):
        ops = {product.op for _, product in layer.linear_method.runs}
        assert ops == {"int8.linear.a8" if w8a8 else "int8.linear"}, names


NATIVE_W8A8 = {"fw": "no C++ compiler for the native kernels", "fw-vnni": "this CPU has no AVX-512 VNNI",
               "fw-amx": "this CPU has no AMX-INT8, or Linux does not grant it"}


def _native_candidate(name: str, rows: int, width: int, dtype: torch.dtype):
    candidate = method.W8A8.candidates[name]
    if not candidate.supports((rows, width, None, str(dtype).removeprefix("torch."), "cpu")):
        pytest.skip(NATIVE_W8A8[name])
    return candidate


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# 101: the vector loops' scalar and masked tails; AMX tiles take 64 input features at a time
@pytest.mark.parametrize("name, width", [("fw", 96), ("fw", 101), ("fw-vnni", 96), ("fw-vnni", 101), ("fw-amx", 128)])
def test_native_w8a8_rounds_activations_exactly_as_the_formula(dtype, name, width):
    """With an identity weight the product is the quantized activation itself: every integer the kernel rounded
    to, ties, clamps at -128 and the dtype's own division included, equals compressed-tensors' formula."""
    candidate = _native_candidate(name, width, width, dtype)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, width, generator=gen)
    x[1, :8] = torch.tensor([-1.0, 1.0, 0.5, -0.5, 1.5 / 127.5, 2.5 / 127.5, -3.5 / 127.5, 0.0])  # ties
    x[1, -3:] = torch.tensor([-2.5 / 127.5, 0.5 / 127.5, 4.5 / 127.5])  # ties in the tail
    x[2] = 0.0  # a zero row: the scale becomes the dtype's eps
    x = x.to(dtype)
    identity = method.W8A8Rows(torch.eye(width, dtype=torch.int8), torch.ones(width, 1), None)
    expected = quantize_input(x, None, None, INT8)
    assert torch.equal(candidate.run(candidate.prepare(identity), x), expected)
    static = method.W8A8Rows(identity.weight, identity.scale, None, torch.tensor(0.004))
    assert torch.equal(candidate.run(candidate.prepare(static), x), quantize_input(x, torch.tensor(0.004), None, INT8))
    # A control: rounding half away from zero instead of to even gives other integers.
    assert not torch.equal(torch.round(x.float() / (x.float().abs().amax(-1, keepdim=True) / 127.5)),
                           ((x.float() / (x.float().abs().amax(-1, keepdim=True) / 127.5)) + 0.5).floor())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(NATIVE_W8A8))
def test_native_w8a8_products_are_the_exact_integer_dots(dtype, name):
    """Every output is sum(q w) in integers times the two scales, rounded once (then the bias added, rounded
    again): weights at -128 and 127, rows of 1 to 33 activations (register groups; AMX's groups of 16, in pairs),
    widths with a tail (those AMX takes); every native kernel gives these same floats."""
    candidate = _native_candidate(name, 48, 4864, dtype)
    for width in (64, 200, 4864):
        if not candidate.supports((48, width, None, str(dtype).removeprefix("torch."), "cpu")):
            continue
        gen = torch.Generator().manual_seed(width)
        weight = torch.randint(-128, 128, (48, width), dtype=torch.int8, generator=gen)
        weight[0, :4] = torch.tensor([-128, -128, 127, 127], dtype=torch.int8)
        scale = torch.rand(48, 1, generator=gen) / 100
        for input_scale in (None, torch.tensor(0.02)):
            rows = method.W8A8Rows(weight, scale, None, input_scale)
            state = candidate.prepare(rows)
            for m in (1, 3, 8, 9, 17, 33):
                x = (torch.randn(m, width, generator=gen) * 3).to(dtype)
                x_scale = (INT8.scale(x.abs().amax(-1, keepdim=True)) if input_scale is None
                           else input_scale.to(dtype).reshape(1, 1).expand(m, 1))
                dot = INT8.round(x / x_scale).to(torch.int64) @ weight.to(torch.int64).T
                expected = (dot.float() * x_scale.float() * scale.reshape(1, -1)).to(dtype)
                assert torch.equal(candidate.run(state, x), expected), (width, m, input_scale)
                # The bias added by the kernel, in x's dtype, as `expected + bias` rounds it
                bias = torch.randn(48, generator=gen).to(dtype)
                assert torch.equal(candidate.run(state, x, bias), expected + bias), (width, m, input_scale)


def test_the_vnni_candidate_runs_where_the_cpu_has_vnni():
    """Kernel choice times ``fw-vnni`` exactly where the CPU has AVX-512 VNNI (a wrong ``supports`` would crash or
    leave the faster product out)."""
    fw = method.W8A8.candidates["fw"]
    key = (64, 896, None, "bfloat16", "cpu")
    if not fw.supports(key):
        pytest.skip("no C++ compiler for the native kernels")
    flags = set(cpuinfo.read_text().split()) if (cpuinfo := Path("/proc/cpuinfo")).exists() else set()
    assert method.W8A8.candidates["fw-vnni"].supports(key) == ({"avx512_vnni", "avx512bw"} <= flags)
    assert not method.W8A8.candidates["fw-vnni"].supports((64, 896, None, "float16", "cpu"))
    # AMX-INT8 tiles where the CPU has them and Linux grants them (5.16 and later), on the shapes tiles take
    linux = tuple(int(v) for v in re.match(r"(\d+)\.(\d+)", os.uname().release).groups())
    amx = {"amx_tile", "amx_int8"} <= flags and linux >= (5, 16)
    assert method.W8A8.candidates["fw-amx"].supports(key) == amx
    assert not method.W8A8.candidates["fw-amx"].supports((64, 900, None, "bfloat16", "cpu"))
    assert not method.W8A8.candidates["fw-amx"].supports((72, 896, None, "bfloat16", "cpu"))


# --- online quantization of plain checkpoints -----------------------------------------------------------------


def test_online_weights_round_trip_within_half_a_step(plain):
    model = load_layers(plain, Int8Method(Fp8Options()))
    originals = dict(iter_safetensors(plain))
    pairs = list(int8_pairs(model))
    assert len(pairs) == 8
    for layer, names in pairs:
        w = torch.cat([originals[f"{n}.weight"] for n in names])
        scale = layer.weight_scale
        assert scale.shape == (w.shape[0], 1)
        # Half a step, plus float32's rounding of amax / 127.5 (the row's largest value sits at 127.5 steps, clamped to 127).
        assert ((fw_weight(layer) - w).abs() <= scale * (0.5 + 1e-4)).all(), names


def test_online_serves_w8a16_by_default_and_w8a8_when_asked(plain):
    tokens = fw_greedy(plain, quant="int8")
    assert [len(t) for t in tokens] == [16, 16]
    w8a8 = load_layers(plain, Int8Method(Fp8Options(activations="dynamic")))
    w8a16 = load_layers(plain, Int8Method(Fp8Options()))
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
    a, b = (m.get_submodule("model.layers.0.self_attn.qkv_proj") for m in (w8a8, w8a16))
    with torch.no_grad():
        w8a8_out = F.linear(quantize_input(x, None, None, INT8), fw_weight(a))
        assert torch.allclose(a(x), w8a8_out, rtol=1e-5, atol=1e-6)
        assert torch.allclose(b(x), F.linear(x, fw_weight(b)), rtol=1e-5, atol=1e-6)
        assert not torch.allclose(a(x), b(x), rtol=1e-5, atol=1e-6)  # the activations really were rounded


# --- experts ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["MixtralForCausalLM", "Qwen3MoeForCausalLM"])
def test_int8_experts_match_their_dequantized_reference(arch, tmp_path):
    path = writer.write_checkpoint(make_tiny_model(arch, tmp_path / "plain"), tmp_path / "int8", activations=None,
                                   element=INT8)
    model = load_layers(path, int8_method(path))
    reference = load_layers(path, Unquantized(), writer.dequantized(path))
    for block in assert_experts_match(model, reference):
        assert block.experts.w13_weight.dtype == torch.int8
    assert len(fw_greedy(path)[0]) == 16


# --- the LM head, rounded only when asked ----------------------------------------------------------------------


@pytest.mark.parametrize("plugin, activations", [("int8", "auto"), ("fp8", "auto"), ("int8", "dynamic")])
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_lm_head_is_rounded_per_row_only_when_asked(plugin, activations, tied, tmp_path):
    from fw_quant_fp8.method import Fp8Method
    from fw_quant_fp8.numerics import E4M3, quantize_rows

    method, options, element = {"int8": (Int8Method, Fp8Options, INT8), "fp8": (Fp8Method, Fp8Options, E4M3)}[plugin]
    path = make_tiny_model("Qwen2ForCausalLM", tmp_path / "plain", tie_word_embeddings=tied)
    table = dict(iter_safetensors(path))["model.embed_tokens.weight" if tied else "lm_head.weight"]
    assert load_layers(path, method(options())).lm_head.quantized is None  # the default keeps it in float
    model = load_layers(path, method(options(lm_head=True, activations=activations)))
    hidden = torch.randn(3, table.shape[1], generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model.compute_logits(hidden)
    assert logits.dtype == torch.float32
    rounded = dequantize(*quantize_rows(table, element), None, torch.float32)
    inputs = hidden if activations == "auto" else quantize_input(hidden, None, None, element)
    torch.testing.assert_close(logits, F.linear(inputs, rounded), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(logits, F.linear(hidden, table), rtol=1e-5, atol=1e-5)  # it really was rounded
    if tied:  # the lookup still reads the float table
        assert torch.equal(model.model.embed_tokens.weight, table)
    else:  # the float head is gone: its memory is the point
        assert not hasattr(model.lm_head, "weight")
    tokens = fw_greedy(path, quant=plugin, plugin_options={"quant": {"lm_head": True, "activations": activations}})
    assert [len(t) for t in tokens] == [16, 16]


@pytest.mark.parametrize("activations", ["auto", "dynamic"])
def test_layers_lm_head_rounds_the_head_of_a_float_model_and_nothing_else(activations, plain, tmp_path):
    """An opt-in 8-bit head for a bf16 model: ``quant.layers=lm_head`` rounds the head per row, as ``lm_head``
    does, and leaves every other linear layer in the model's float weights."""
    from fw_quant_fp8.numerics import quantize_rows

    table = dict(iter_safetensors(plain))["lm_head.weight"]
    model = load_layers(plain, int8_method(plain, layers="lm_head", activations=activations))
    reference = load_layers(plain, Unquantized())
    linears = [(name, layer) for name, layer in model.named_modules() if hasattr(layer, "linear_method")]
    assert linears and not any(layer.weight.dtype == torch.int8 for _, layer in linears)
    float_layers = dict(reference.named_modules())
    for name, layer in linears:
        assert torch.equal(layer.weight, float_layers[name].weight), name
    hidden = torch.randn(3, table.shape[1], generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model.compute_logits(hidden)
    inputs = hidden if activations == "auto" else quantize_input(hidden, None, None, INT8)
    torch.testing.assert_close(logits, F.linear(inputs, dequantize(*quantize_rows(table, INT8), None, torch.float32)),
                               rtol=1e-5, atol=1e-5)
    tokens = fw_greedy(plain, quant="int8", plugin_options={"quant": {"layers": "lm_head", "activations": activations}})
    assert [len(t) for t in tokens] == [16, 16]
    # A checkpoint already quantized has no float layers to keep: the option is refused, naming itself
    ct = writer.write_checkpoint(plain, tmp_path / "ct", weights="channel", activations=None, element=INT8)
    with pytest.raises(ModelLoadError, match="quant.layers=lm_head"):
        int8_method(ct, layers="lm_head")

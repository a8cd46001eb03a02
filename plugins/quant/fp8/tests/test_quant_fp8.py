"""The fp8 quant plugin against references we did not write.

compressed-tensors checkpoints: transformers + compressed-tensors load the same files (weights decompressed by
them, activations fake-quantized by compressed-tensors' own forward). vLLM/AutoFP8 and DeepSeek block checkpoints,
which transformers cannot run on a CPU: the formats' formulas, written here in float64 (weights) and float32
(activation scales, as every implementation computes them). Greedy tokens: transformers on the reference weights,
with the reference activation quantization hooked in front of every quantized module.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from conftest import assert_experts_match, assert_layers_match_modules, fw_greedy, hf_greedy, load_layers
from fw import model_registry
from fw.sdk.checkpoint import iter_safetensors
from fw.testing.conformance import HooksConformance
from fw.testing.models import make_tiny_model
from fw_quant_fp8 import hooks, numerics
from fw_quant_fp8 import testing as fp8
from fw_quant_fp8.method import Fp8Method
from fw_quant_fp8.spec import Fp8Options
from fw_quant_none.method import Unquantized

FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def fp8_method(path, **options):
    return Fp8Method(Fp8Options(**options), model_registry.read_hf_config(str(path)).get("quantization_config"))


def fused_pairs(model):
    """(fw layer, its checkpoint module names) for every FP8 linear layer of ``model``."""
    for name, layer in model.named_modules():
        if hasattr(layer, "linear_method") and layer.weight.dtype == numerics.FP8:
            stem, _, leaf = name.rpartition(".")
            yield layer, [f"{stem}.{m}" for m in FUSED.get(leaf, (leaf,))]


def fw_weight(layer):
    method = layer.linear_method
    scale = getattr(layer, method.scheme.scale_name)
    return numerics.dequantize(layer.weight, scale, method.scheme.group(), torch.float32)


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    return make_tiny_model("LlamaForCausalLM", tmp_path_factory.mktemp("fp8") / "plain")


# --- compressed-tensors: transformers + compressed-tensors as the reference -------------------------------------


def ct_reference(path):
    """transformers' model of a compressed-tensors FP8 checkpoint: weights decompressed by transformers and
    compressed-tensors, and compressed-tensors' quantized forward (input fake-quantization) on every module its
    config quantizes."""
    import transformers
    from compressed_tensors.quantization.lifecycle.forward import set_forward_quantized

    compressed = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, quantization_config=transformers.CompressedTensorsConfig(dequantize=True))
    for name, module in compressed.named_modules():
        scheme = getattr(module, "quantization_scheme", None)
        if scheme is None:
            continue
        target = model.get_submodule(name)
        target.quantization_scheme, target.quantization_status = scheme, module.quantization_status
        if hasattr(module, "input_scale"):
            target.input_scale = module.input_scale
        set_forward_quantized(target)
    return model.eval()


@pytest.fixture(scope="module", params=[("channel", "dynamic"), ("tensor", "static")], ids=["dynamic", "static"])
def ct_checkpoint(request, plain, tmp_path_factory):
    weights, activations = request.param
    path = fp8.write_checkpoint(plain, tmp_path_factory.mktemp("ct") / "ct", weights=weights, activations=activations)
    return path, ct_reference(path)


class TestFp8HooksConformance(HooksConformance):
    plugin = "fp8"


def test_detects_fp8_compressed_tensors_only(ct_checkpoint):
    path, _ = ct_checkpoint
    config = json.loads((path / "config.json").read_text())
    assert hooks.fw_detect_quant_format(str(path), config) == "compressed-tensors-fp8"
    int8 = json.loads(json.dumps(config))
    int8["quantization_config"]["config_groups"]["group_0"]["weights"].update(type="int")
    assert hooks.fw_detect_quant_format(str(path), int8) is None
    assert hooks.fw_detect_quant_format(str(path), None) is None


def test_compressed_tensors_layers_match_the_reference(ct_checkpoint):
    path, reference = ct_checkpoint
    model = load_layers(path, fp8_method(path))
    pairs = list(fused_pairs(model))
    assert len(pairs) == 4 * 2  # every linear layer of both decoder layers
    # Decoded weights: exactly transformers + compressed-tensors' decompression.
    assert_layers_match_modules(pairs, reference, fw_weight, 2e-6)


def test_compressed_tensors_greedy_tokens_match_the_reference(ct_checkpoint):
    path, reference = ct_checkpoint
    assert fw_greedy(path) == hf_greedy(reference, path)


# --- vLLM/AutoFP8 and DeepSeek blocks: the formats' formulas as the reference ----------------------------------


def formula_weight(tensors, module, block):
    """W = q * scale in float64: a scalar ``weight_scale``, or ``weight_scale_inv`` per [b0, b1] block."""
    q = tensors[f"{module}.weight"].to(torch.float64)
    if block is None:
        return q * tensors[f"{module}.weight_scale"].to(torch.float64)
    s = tensors[f"{module}.weight_scale_inv"].to(torch.float64)
    rows, cols = q.shape
    return q * s.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]


def formula_input(x, input_scale, group):
    """Activations through e4m3: a static scale, else absmax / 448 per token (per ``group`` features of it)."""
    if group:
        return torch.cat([formula_input(part, None, None) for part in x.split(group, dim=-1)], dim=-1)
    s = input_scale if input_scale is not None else x.abs().amax(-1, keepdim=True) / 448
    return (x / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s


FORMATS = {"fp8-dynamic": ("fp8", "dynamic"), "fp8-static": ("fp8", "static"), "block": ("block", "dynamic")}


@pytest.fixture(scope="module", params=list(FORMATS))
def formula_checkpoint(request, tmp_path_factory):
    kind, activations = FORMATS[request.param]
    root = tmp_path_factory.mktemp(request.param)
    # Large enough for several 128x128 blocks and partial ones (the MLP is 320 wide).
    plain = make_tiny_model("Qwen2ForCausalLM", root / "plain", hidden_size=256, intermediate_size=320,
                            head_dim=64) if kind == "block" else make_tiny_model("Qwen2ForCausalLM", root / "plain")
    return fp8.write_checkpoint(plain, root / "fp8", kind=kind, activations=activations)


def test_fp8_and_block_layers_match_the_formula(formula_checkpoint):
    path = formula_checkpoint
    qc = json.loads((path / "config.json").read_text())["quantization_config"]
    block = qc.get("weight_block_size")
    tensors = dict(iter_safetensors(path))
    model = load_layers(path, fp8_method(path))
    gen = torch.Generator().manual_seed(0)
    pairs = list(fused_pairs(model))
    assert len(pairs) == 8
    for layer, names in pairs:
        weights = [formula_weight(tensors, n, block) for n in names]
        # The float64 product is exact; float32 (fw, vLLM, transformers) rounds it once.
        assert torch.equal(fw_weight(layer), torch.cat(weights).float()), names
        x = 3 * torch.randn(7, layer.spec.input_size, generator=gen)
        expected = torch.cat([
            F.linear(formula_input(x, tensors.get(f"{n}.input_scale"), block and block[1]).double(), w)
            for n, w in zip(names, weights, strict=True)], dim=-1)
        expected = expected + (layer.bias.double() if layer.bias is not None else 0)
        with torch.no_grad():
            error = ((layer(x).double() - expected).norm() / expected.norm()).item()
        assert error < 2e-6, f"{names}: relative error {error:.3g}"


def hooked_reference(path, tmp_path, block):
    """transformers on the formula's weights, each quantized module's input through ``formula_input``."""
    import transformers

    tensors = dict(iter_safetensors(path))
    plain = tmp_path / "reference"
    plain.mkdir()
    config = json.loads((path / "config.json").read_text())
    config.pop("quantization_config")
    (plain / "config.json").write_text(json.dumps(config))
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(str(plain)),
                                                          dtype=torch.float32)
    state = {n: t for n, t in tensors.items() if t.dtype != numerics.FP8 and not n.endswith("scale")
             and not n.endswith("scale_inv")}
    for name, tensor in tensors.items():
        if tensor.dtype == numerics.FP8:
            module = name.removesuffix(".weight")
            state[name] = formula_weight(tensors, module, block).float()
            input_scale = tensors.get(f"{module}.input_scale")
            model.get_submodule(module).register_forward_pre_hook(
                lambda m, args, s=input_scale: (formula_input(args[0], s, block and block[1]),))
    model.load_state_dict(state, strict=False)
    return model.eval()


def test_fp8_and_block_greedy_tokens_match_the_reference(formula_checkpoint, tmp_path):
    path = formula_checkpoint
    block = json.loads((path / "config.json").read_text())["quantization_config"].get("weight_block_size")
    reference = hooked_reference(path, tmp_path, block)
    assert fw_greedy(path) == hf_greedy(reference, path)


# --- online quantization of plain checkpoints -----------------------------------------------------------------


def test_online_weights_round_trip_within_e4m3_error(plain):
    model = load_layers(plain, Fp8Method(Fp8Options()))
    originals = dict(iter_safetensors(plain))
    for layer, names in fused_pairs(model):
        w = torch.cat([originals[f"{n}.weight"] for n in names])
        scale = layer.weight_scale
        # e4m3: 3 mantissa bits, so half a step is 2^-4 of the value; below 2^-6 (subnormals) steps are 2^-9 of scale.
        bound = torch.maximum(w.abs() * 2**-4, scale * 2**-10) * (1 + 1e-6)
        assert ((fw_weight(layer) - w).abs() <= bound).all(), names
        assert scale.shape == (w.shape[0], 1)


def test_online_serves_w8a16_by_default_and_w8a8_when_asked(plain):
    tokens = fw_greedy(plain, quant="fp8")
    assert [len(t) for t in tokens] == [16, 16]
    w8a8 = load_layers(plain, Fp8Method(Fp8Options(activations="dynamic")))
    w8a16 = load_layers(plain, Fp8Method(Fp8Options()))
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
    a, b = (m.get_submodule("model.layers.0.self_attn.qkv_proj") for m in (w8a8, w8a16))
    with torch.no_grad():
        assert torch.allclose(a(x), F.linear(formula_input(x, None, None), fw_weight(a)), rtol=1e-5, atol=1e-6)
        assert torch.allclose(b(x), F.linear(x, fw_weight(b)), rtol=1e-5, atol=1e-6)


# --- experts ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["MixtralForCausalLM", "Qwen3MoeForCausalLM"])
@pytest.mark.parametrize("weights", ["channel", "tensor"])
def test_fp8_experts_match_their_dequantized_reference(arch, weights, tmp_path):
    path = fp8.write_checkpoint(make_tiny_model(arch, tmp_path / "plain"), tmp_path / "fp8", weights=weights,
                                activations=None)
    model = load_layers(path, fp8_method(path))
    reference = load_layers(path, Unquantized(), fp8.dequantized(path))
    for block in assert_experts_match(model, reference):
        assert block.experts.w13_weight.dtype == numerics.FP8
    assert len(fw_greedy(path)[0]) == 16



@pytest.mark.parametrize("element", ["fp8", "int8"])
@pytest.mark.parametrize("shape, group", [((96, 64), None), ((100, 200), 64), ((40, 130), 48)])
def test_triton_gemm_in_the_interpreter(element, shape, group):
    """The CUDA kernel's arithmetic, run by Triton's interpreter on the CPU in float32 (conftest.py), with
    every FP8 byte widened exactly."""
    pytest.importorskip("triton", reason="triton is not installed (pip install triton)")
    if torch.cuda.is_available():
        pytest.skip("the interpreter check is the CPU's; CUDA runs it in tests/test_gpu_paths.py")
    from fw_quant_fp8.triton_gemm import gemm8

    gen = torch.Generator().manual_seed(0)
    elements = {"fp8": numerics.E4M3, "int8": numerics.INT8}
    weight, scale = numerics.quantize_rows(torch.randn(*shape, generator=gen), elements[element])
    if group:  # block scales: one per row and group of input features
        scale = scale * torch.rand(shape[0], -(-shape[1] // group), generator=gen)
    x = torch.randn(5, shape[1], generator=gen)
    expected = x.double() @ numerics.dequantize(weight, scale, group, torch.float64).T
    got = gemm8(x, weight, scale, group)
    assert ((got.double() - expected).norm() / expected.norm()).item() < 1e-6
    if element == "fp8":  # all 256 bytes but NaN, subnormals included
        every = torch.arange(256, dtype=torch.uint8).view(numerics.FP8).float().nan_to_num(0.0).to(numerics.FP8)
        assert torch.equal(gemm8(torch.eye(32), every.view(8, 32), torch.ones(8, 1), None).T, every.view(8, 32).float())


# --- the bf16-pair product (AVX-512 BF16) -----------------------------------------------------------------------


@pytest.mark.parametrize("element", ["fp8", "int8"])
def test_bf16_pair_product_takes_every_weight_value_exactly(element):
    """``fw-bf16`` reads each e4m3 byte as a bf16 through two byte tables and its sign (an int8 one by conversion):
    with one weight row per byte value (subnormals, zeros and both signs; NaN left out) and x a one-hot row, each
    output is that weight itself, times its row scale, exactly; rows of several tokens and a width with a tail
    agree with float64 to float32's summation error."""
    from fw_quant_fp8 import int8, method

    int8_weights = element == "int8"
    op, dtype = (int8.WEIGHT_ONLY, torch.int8) if int8_weights else (method.PRODUCT, torch.float8_e4m3fn)
    candidate = op.candidates["fw-bf16"]
    if not candidate.supports((1, 128, None, "bfloat16", "cpu")):
        pytest.skip("this CPU has no AVX-512 BF16 and VBMI (or no C++ compiler)")
    values = torch.tensor([b for b in range(256) if int8_weights or b & 0x7F != 0x7F], dtype=torch.uint8)
    width = 130  # two 64-weight chunks and a tail of 2
    weight = torch.zeros(len(values), width, dtype=torch.uint8)
    weight[:, 67] = values  # in the second chunk's second half: the interleaved order is exercised
    scale = torch.full((len(values), 1), 0.5)
    x = torch.zeros(1, width, dtype=torch.bfloat16)
    x[0, 67] = 1.0
    out = torch.ops.fw_quant_fp8.gemv_bf16(x, weight, scale, None, True, int8_weights)
    assert torch.equal(out[0], values.view(dtype).float() * 0.5)
    gen = torch.Generator().manual_seed(0)
    weight = torch.randint(0, 256, (40, width), dtype=torch.uint8, generator=gen)
    if not int8_weights:
        weight[(weight & 0x7F) == 0x7F] = 0
    rows = method.QuantizedRows(weight.view(dtype), torch.rand(40, 1, generator=gen), None)
    for m in (1, 3, 9):
        x = torch.randn(m, width, generator=gen).bfloat16()
        expected = x.double() @ (rows.weight.double() * rows.scale.double()).T
        logits = torch.ops.fw_quant_fp8.gemv_bf16(x, weight, rows.scale, None, True, int8_weights)
        torch.testing.assert_close(logits.double(), expected, rtol=1e-6, atol=1e-6 * expected.abs().max().item())
        # The linear layers' bf16 output, the bias added in the kernel: rounded twice, as .to(bf16) + bias did
        bias = torch.randn(40, generator=gen).bfloat16()
        out = candidate.run(candidate.prepare(rows), x, bias)
        assert out.dtype == torch.bfloat16 and torch.equal(out, logits.bfloat16() + bias)
        assert torch.equal(candidate.run(candidate.prepare(rows), x), logits.bfloat16())


@pytest.mark.parametrize("element", ["fp8", "int8"])
@pytest.mark.parametrize("kernel", ["fw-tiles", "fw-amx"])
def test_tile_products_take_every_weight_value_exactly_in_its_column(element, kernel):
    """``fw-tiles`` and ``fw-amx`` widen weight rows into bf16 tiles (16 input-feature pairs x 16 columns): with one
    weight row per byte value and x one-hot rows at several features, every output is its own weight times the row
    scale, exactly (one nonzero product each), so a misplaced feature or column would show. 40 rows: five 8-row
    register tiles (fw-tiles), two 32-row AMX tiles padded (fw-amx); 48 columns: one group of three blocks
    (fw-tiles), a last AMX pair of one block."""
    from fw_quant_fp8 import int8, method

    op, dtype = (method.PRODUCT, torch.float8_e4m3fn) if element == "fp8" else (int8.WEIGHT_ONLY, torch.int8)
    candidate = op.candidates[kernel]
    if not candidate.supports((256, 128, None, "bfloat16", "cpu")):
        needs = "AMX-BF16 (with AVX-512 BF16 and VBMI)" if kernel == "fw-amx" else "AVX-512 BF16 and VBMI"
        pytest.skip(f"{kernel}: this CPU has no {needs}, Linux does not grant it, or no C++")
    values = torch.arange(256, dtype=torch.uint8)
    if element == "fp8":
        values[(values & 0x7F) == 0x7F] = 0  # NaN left out
    for columns in (256, 48):
        weight = torch.zeros(columns, 128, dtype=torch.uint8)
        features = [0, 5, 67, 127]
        for f in features:  # a different byte in each feature, so features cannot stand in for each other
            weight[:, f] = values.roll(f)[:columns]
        rows = method.QuantizedRows(weight.view(dtype), torch.full((columns, 1), 0.5), None)
        x = torch.zeros(40, 128, dtype=torch.bfloat16)
        for i in range(40):
            x[i, features[i % len(features)]] = 1.0
        out = candidate.run(candidate.prepare(rows), x)
        expected = (weight[:, [features[i % len(features)] for i in range(40)]].T.contiguous()
                    .view(dtype).float() * 0.5).bfloat16()
        assert torch.equal(out, expected), columns


def test_bf16_pair_product_runs_only_where_it_is_exact_and_built():
    """bf16 activations, a scale per row, and a CPU with AVX-512 BF16 and VBMI: float32 activations would be
    rounded, block scales are not read."""
    from fw_quant_fp8 import method

    widening = method.PRODUCT.candidates["fw"]
    candidate = method.PRODUCT.candidates["fw-bf16"]
    key = (64, 896, None, "bfloat16", "cpu")
    if not widening.supports(key):
        pytest.skip("no C++ compiler for the native kernels")
    flags = set(cpuinfo.read_text().split()) if (cpuinfo := Path("/proc/cpuinfo")).exists() else set()
    assert candidate.supports(key) == ({"avx512_bf16", "avx512vbmi"} <= flags)
    assert not candidate.supports((64, 896, None, "float32", "cpu"))
    assert not candidate.supports((64, 896, 128, "bfloat16", "cpu"))
    # int8 weights take the same kernels; AMX tiles where Linux (5.16 and later) grants them, 64 features a tile
    from fw_quant_fp8 import int8

    assert int8.WEIGHT_ONLY.candidates["fw-bf16"].supports(key) == candidate.supports(key)
    linux = tuple(int(v) for v in re.match(r"(\d+)\.(\d+)", os.uname().release).groups())
    amx = candidate.supports(key) and {"amx_tile", "amx_bf16"} <= flags and linux >= (5, 16)
    for op in (method.PRODUCT, int8.WEIGHT_ONLY):
        assert op.candidates["fw-amx"].supports(key) == amx
        assert op.candidates["fw-tiles"].supports(key) == candidate.supports(key)
        for name in ("fw-amx", "fw-tiles"):
            assert not op.candidates[name].supports((64, 900, None, "bfloat16", "cpu"))

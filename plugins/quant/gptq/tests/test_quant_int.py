"""The gptq and awq quant plugins (GPTQ, AWQ and compressed-tensors pack-quantized integer weights) against
references we did not write.

- Layouts: known packed words from the formats' documentation; decoding a checkpoint with a wrong nibble order
  or zero offset is a control that must fail the same comparison.
- compressed-tensors: transformers + compressed-tensors decompress the same files (exactly, in the checkpoint's
  half precision, which is how the reference computes them); logits and greedy tokens against transformers.
- GPTQ and AWQ: here against the float model of the decoded weights; against GPTQModel's own checkpoints and
  loader where ``FW_QUANT_REFERENCE`` points at them (``benchmarks/quant_refs``; marked ``reference``).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from test_models import PagedRunner, reference_logits

from conftest import assert_experts_match, fw_greedy, hf_greedy, load_layers
from fw import LLM, SamplingParams, model_registry
from fw.model_loader import load_model
from fw.models.base import HFConfig, ModelContext
from fw.models.moe import SparseMoeBlock
from fw.sdk.checkpoint import iter_safetensors
from fw.sdk.errors import ModelLoadError
from fw.sdk.linear import int_block_rounded, int_blocks
from fw.testing.conformance import HooksConformance
from fw.testing.models import make_tiny_model
from fw_attention_torch.backend import TorchAttention
from fw_quant_gptq import formats, hooks, packed
from fw_quant_gptq import testing as intq
from fw_quant_gptq.method import IntMethod
from fw_quant_gptq.spec import IntOptions
from fw_quant_none.method import Unquantized

FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}

# layout, bits, group, symmetric, act-order: every variant the plugins load.
VARIANTS = {
    "gptq-4-sym-g32": ("gptq", 4, 32, True, False),
    "gptq-4-asym-g64-actorder": ("gptq", 4, 64, False, True),
    "gptq-8-asym-g32-actorder": ("gptq", 8, 32, False, True),
    "gptq-8-sym-channel": ("gptq", 8, -1, True, False),
    "awq-4-g64": ("awq", 4, 64, False, False),
    "awq-4-g32": ("awq", 4, 32, False, False),
    "ct-4-sym-g32": ("pack-quantized", 4, 32, True, False),
    "ct-4-asym-channel": ("pack-quantized", 4, -1, False, False),
    "ct-8-sym-channel": ("pack-quantized", 8, -1, True, False),
    "ct-8-asym-g32-actorder": ("pack-quantized", 8, 32, False, True),
}


def write(plain: Path, out: Path, variant: str) -> Path:
    layout, bits, group, symmetric, act_order = VARIANTS[variant]
    return intq.write_checkpoint(plain, out, layout=layout, bits=bits, group=group, symmetric=symmetric,
                                 act_order=act_order)


def int_method(path, **options):
    return IntMethod(IntOptions(**options), model_registry.read_hf_config(str(path))["quantization_config"])


def fw_layers(model):
    """(fw layer, its checkpoint module names, its float32 weight) for every integer linear layer."""
    for name, layer in model.named_modules():
        runs = getattr(getattr(layer, "linear_method", None), "runs", None)
        if runs is not None:
            stem, _, leaf = name.rpartition(".")
            weight = torch.cat([packed.matrix(product.weight) for _, product in runs])
            yield layer, [f"{stem}.{m}" for m in FUSED.get(leaf, (leaf,))], weight


def float_copy(path: Path, out: Path) -> Path:
    """The checkpoint with its integer weights decoded into float32: what the reference models run."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    save_file(dict(intq.dequantized(path)), str(out / "model.safetensors"))
    config = json.loads((path / "config.json").read_text())
    del config["quantization_config"]
    (out / "config.json").write_text(json.dumps(config))
    for extra in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (path / extra).is_file():
            shutil.copy(path / extra, out / extra)
    return out


def hf_model(path, **kwargs):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, **kwargs).eval()


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    return make_tiny_model("LlamaForCausalLM", tmp_path_factory.mktemp("int") / "plain")


# --- layouts ------------------------------------------------------------------------------------------------------


def test_known_packed_words():
    values = torch.arange(8, dtype=torch.uint8)
    word = lambda t: t.item() & 0xFFFFFFFF  # noqa: E731
    assert word(formats.pack(values.view(1, 8), 4, 1, formats.AWQ_NIBBLE)) == 0x75316420  # AWQ: columns 0..7
    assert word(formats.pack(values.view(8, 1), 4, 0)) == 0x76543210  # GPTQ: rows 0..7
    assert word(formats.pack(values[:4].view(4, 1), 8, 0)) == 0x03020100  # GPTQ 8-bit: rows 0..3
    signed = torch.arange(-8, 8) + 8  # compressed-tensors stores signed values plus 2^(bits-1)
    ct = formats.pack(signed.to(torch.uint8).view(1, 16), 4, 1)
    assert [w & 0xFFFFFFFF for w in ct.view(-1).tolist()] == [0x76543210, 0xFEDCBA98]
    # GPTQ v1 zero points: every field minus one, as one subtraction per word (symmetric 4-bit: 8s -> 0x77777777).
    eights = formats.pack(torch.full((1, 8), 8, dtype=torch.uint8), 4, 1)
    assert word(formats.shift_words(eights, -formats.V1_ONES[4])) == 0x77777777
    zeros = torch.tensor([[0, 15, 0, 3, 0, 0, 7, 1]], dtype=torch.uint8)  # a zero borrows from the next field
    stored = formats.shift_words(formats.pack(zeros, 4, 1), -formats.V1_ONES[4])
    assert torch.equal(formats.unpack(formats.shift_words(stored, formats.V1_ONES[4]), 4, 1), zeros)
    for dim, order in ((0, None), (1, None), (1, formats.AWQ_NIBBLE)):
        q = torch.randint(0, 16, (32, 16), dtype=torch.uint8)
        assert torch.equal(formats.unpack(formats.pack(q, 4, dim, order), 4, dim, order), q)


@pytest.mark.parametrize("variant", ["gptq-4-asym-g64-actorder", "awq-4-g64", "ct-4-asym-channel"])
def test_decoding_recovers_the_written_integers_and_wrong_decodings_fail(plain, tmp_path, variant, monkeypatch):
    """The writer's own integers come back exactly; a wrong nibble order or zero offset does not."""
    layout, bits, group, symmetric, act_order = VARIANTS[variant]
    module = "model.layers.0.self_attn.q_proj"
    weight = dict(iter_safetensors(plain))[f"{module}.weight"]
    g_idx = intq.group_index(module, weight.shape[1], group, act_order)
    q, zero, scale = intq.quantize(weight, bits, g_idx, symmetric)
    expected = scale.float()[:, g_idx] * (q.float() - zero[:, g_idx])
    tensors = dict(iter_safetensors(write(plain, tmp_path, variant)))
    leaves = {k.rpartition(".")[2]: v for k, v in tensors.items() if k.startswith(module + ".")}
    scheme = formats.Schemes(json.loads((tmp_path / "config.json").read_text())["quantization_config"])(module)
    assert torch.equal(intq.weight_of(scheme, leaves), expected)
    # Controls: zeros read without GPTQ v1's +1; AWQ's words read in sequential nibble order; zero points ignored.
    from dataclasses import replace

    if layout == "awq":
        monkeypatch.setattr(formats, "AWQ_NIBBLE", tuple(range(8)))
        wrong = scheme
    else:
        wrong = replace(scheme, **({"layout": "gptq_v2"} if layout == "gptq" else {"symmetric": True}))
    assert not torch.equal(intq.weight_of(wrong, leaves), expected)


def test_awq_in_gptq_nibble_order_is_a_different_weight(plain, tmp_path):
    """The control for AWQ's interleaved order alone: the same words read sequentially differ."""
    path = write(plain, tmp_path, "awq-4-g64")
    words = dict(iter_safetensors(path))["model.layers.0.mlp.up_proj.qweight"]
    assert not torch.equal(formats.unpack(words, 4, 1, formats.AWQ_NIBBLE), formats.unpack(words, 4, 1))


# --- every variant: layers decode exactly and compute with exactly those weights ---------------------------------


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_layers_hold_exactly_the_decoded_weights(plain, tmp_path, variant):
    path = write(plain, tmp_path / "q", variant)
    reference = dict(intq.dequantized(path))
    model = load_layers(path, int_method(path))
    layers = list(fw_layers(model))
    assert len(layers) == 4 * 2  # qkv, o, gate_up, down of both decoder layers
    gen = torch.Generator().manual_seed(0)
    for layer, names, weight in layers:
        expected_weight = torch.cat([reference[f"{n}.weight"] for n in names])
        assert torch.equal(weight, expected_weight), names
        x = torch.randn(5, layer.spec.input_size, generator=gen)
        with torch.no_grad():
            got = layer(x)
        expected = x.double() @ expected_weight.double().T
        if layer.bias is not None:
            expected += layer.bias.double()
        error = ((got.double() - expected).norm() / expected.norm()).item()
        assert error < 1e-5, f"{names}: relative error {error:.3g}"


def fw_logprobs(path, tokens: list[int], dtype: torch.dtype = torch.float32, **options) -> torch.Tensor:
    """fw's prefill log-probabilities of ``tokens`` on the integer checkpoint, paged attention."""
    config = model_registry.read_hf_config(str(path))
    ctx = ModelContext(dtype=dtype, quant=int_method(path, **options), attention=TorchAttention())
    model = load_model(model_registry.resolve(config).load(), HFConfig(config), ctx, iter_safetensors(path))
    return torch.log_softmax(PagedRunner(model, dtype).step({0: tokens})[0].float(), -1)


TOKENS = [5, 77, 300, 12, 9, 401, 33, 250, 18]


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen2ForCausalLM"])
@pytest.mark.parametrize("variant", ["gptq-4-asym-g64-actorder", "gptq-8-sym-channel", "awq-4-g64"])
def test_gptq_and_awq_logprobs_and_greedy_tokens_match_transformers(arch, variant, tmp_path):
    """fw on the integer checkpoint against transformers on its decoded float weights, in float32."""
    path = write(make_tiny_model(arch, tmp_path / "plain"), tmp_path / "q", variant)
    reference = hf_model(float_copy(path, tmp_path / "float"))
    expected = torch.log_softmax(reference_logits(reference, TOKENS), -1)
    assert (fw_logprobs(path, TOKENS) - expected).abs().max().item() < 1e-4
    assert fw_greedy(path) == hf_greedy(reference, path)


def test_auto_dtype_serves_the_float32_path_and_bfloat16_stays_close(plain, tmp_path):
    """The default path (dtype auto: the checkpoint's float32 here) and bfloat16 run the integer kernels."""
    path = write(plain, tmp_path / "q", "gptq-4-sym-g32")
    assert fw_greedy(path, dtype="auto") == fw_greedy(path)
    # bf16 keeps 8 significant bits: within test_models' bf16 tolerance of the float32 log-probabilities.
    error = (fw_logprobs(path, TOKENS, torch.bfloat16).float() - fw_logprobs(path, TOKENS)).abs().max().item()
    assert error < 0.1


# --- compressed-tensors: transformers + compressed-tensors as the reference -----------------------------------


CT_VARIANTS = ["ct-4-sym-g32", "ct-4-asym-channel", "ct-8-sym-channel", "ct-8-asym-g32"]
VARIANTS["ct-8-asym-g32"] = ("pack-quantized", 8, 32, False, False)
# compressed-tensors 0.20 reads no weight_g_idx (its actorder "group" is gone): the act-order variant is checked
# against the decoded weights above, as vLLM reads it.


@pytest.mark.parametrize("variant", CT_VARIANTS)
def test_pack_quantized_matches_compressed_tensors(plain, tmp_path, variant):
    import transformers

    path = write(plain, tmp_path / "q", variant)
    reference = hf_model(path, quantization_config=transformers.CompressedTensorsConfig(dequantize=True))
    model = load_layers(path, int_method(path))
    gen = torch.Generator().manual_seed(0)
    for layer, names, weight in fw_layers(model):
        ref_modules = [reference.get_submodule(n) for n in names]
        ref_weight = torch.cat([m.weight for m in ref_modules])
        assert torch.equal(weight, ref_weight), names
        x = torch.randn(3, layer.spec.input_size, generator=gen)
        with torch.no_grad():
            expected = torch.cat([m(x) for m in ref_modules], dim=-1)
            got = layer(x)
        assert ((got - expected).norm() / expected.norm()).item() < 1e-5, names  # float32 sums, another order
    expected = torch.log_softmax(reference_logits(reference, TOKENS), -1)
    assert (fw_logprobs(path, TOKENS) - expected).abs().max().item() < 1e-4
    assert fw_greedy(path) == hf_greedy(reference, path)


def test_detects_pack_quantized_compressed_tensors_only(plain, tmp_path):
    path = write(plain, tmp_path / "q", "ct-4-sym-g32")
    config = json.loads((path / "config.json").read_text())
    assert hooks.fw_detect_quant_format(str(path), config) == "pack-quantized"
    float_quantized = json.loads(json.dumps(config))
    float_quantized["quantization_config"]["format"] = "float-quantized"
    assert hooks.fw_detect_quant_format(str(path), float_quantized) is None
    assert hooks.fw_detect_quant_format(str(path), None) is None


class TestGptqHooksConformance(HooksConformance):
    plugin = "gptq"


# --- experts ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["MixtralForCausalLM", "Qwen2MoeForCausalLM"])
@pytest.mark.parametrize("variant", ["gptq-4-asym-g64-actorder", "awq-4-g32", "ct-8-sym-channel"])
def test_integer_experts_match_their_dequantized_reference(arch, variant, tmp_path):
    path = write(make_tiny_model(arch, tmp_path / "plain"), tmp_path / "q", variant)
    model = load_layers(path, int_method(path))
    reference = load_layers(path, Unquantized(), intq.dequantized(path))
    for block in assert_experts_match(model, reference):
        assert len(block.experts.moe_method.experts) == block.experts.spec.num_experts
    assert fw_greedy(path) == fw_greedy(float_copy(path, tmp_path / "float"))


# --- what is refused, by name ----------------------------------------------------------------------------------


@pytest.mark.parametrize("config, words", [
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, ["bits", "3"]),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"},
     ["checkpoint_format", "marlin"]),
    ({"quant_method": "gptq", "bits": 4, "group_size": 0}, ["group_size", "0"]),
    ({"quant_method": "gptq", "bits": 4, "dynamic": {r"+:.*down_proj": {"bits": 2}}}, ["bits", "2"]),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": False, "version": "gemm"}, ["zero_point"]),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemv"},
     ["version", "gemv"]),
    ({"quant_method": "awq", "bits": 8, "group_size": 128, "zero_point": True}, ["bits", "8"]),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {"targets": ["Linear"],
      "weights": {"num_bits": 4, "type": "int", "strategy": "tensor"}}}}, ["strategy", "tensor"]),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {"targets": ["Linear"],
      "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32},
      "input_activations": {"num_bits": 8, "type": "int"}}}}, ["input_activations"]),
    ({}, ["quantization_config"]),
])
def test_unsupported_variants_are_refused_by_name(config, words):
    with pytest.raises(ModelLoadError) as err:
        IntMethod(None, config)
    assert all(w in str(err.value) for w in words), str(err.value)


def test_gptq_dynamic_overrides_and_exclusions(plain, tmp_path):
    """GPTQModel's per-module ``dynamic`` settings: "-:" leaves a module in float, others override its scheme."""
    schemes = formats.Schemes({"quant_method": "gptq", "bits": 4, "group_size": 32,
                               "dynamic": {r"-:.*\.o_proj": {}, r"+:.*down_proj": {"bits": 8, "group_size": 64}}})
    assert schemes("model.layers.0.self_attn.o_proj") is None
    assert schemes("model.layers.0.mlp.down_proj") == formats.Scheme("gptq", 8, 64)
    assert schemes("model.layers.0.mlp.up_proj") == formats.Scheme("gptq", 4, 32)
    assert schemes("model.layers.0.mlp.gate") is None  # MoE routers stay in float


# --- kernels ------------------------------------------------------------------------------------------------------


def _random_weight(bits, n, k, group, act_order, seed=0):
    gen = torch.Generator().manual_seed(seed)
    g_idx = torch.arange(k) // group
    if act_order:
        g_idx = g_idx[torch.randperm(k, generator=gen)]
    groups = int(g_idx.max()) + 1
    q = torch.randint(0, 1 << bits, (n, k), generator=gen, dtype=torch.uint8)
    zero = torch.randint(0, 1 << bits, (n, groups), generator=gen).float()
    scale = (0.01 * torch.rand(n, groups, generator=gen)).half()
    exact = scale.double()[:, g_idx] * (q.double() - zero.double()[:, g_idx])
    return packed.repack(bits, q, zero, scale, g_idx), exact


@pytest.mark.parametrize("bits, group, act_order", [(4, 32, False), (4, 64, True), (8, 32, True), (8, 128, False)])
def test_every_product_computes_the_exact_weights_in_float32(bits, group, act_order):
    w, exact = _random_weight(bits, 72, 160, group, act_order)
    assert torch.equal(packed.matrix(w).double(), exact)  # decoding is exact in float32
    key = packed.key(w, torch.float32)
    names = {c.name for c in packed.PRODUCT.supported(key)}
    if shutil.which("c++") and os.environ.get("FW_NATIVE", "1") != "0":
        assert "fw" in names
    for candidate in packed.PRODUCT.supported(key):
        for rows in (1, 3, 8, 9, 40):
            x = torch.randn(rows, 160, dtype=torch.float64)
            xs = x if w.perm is None else x[:, w.perm]
            got = candidate.run(candidate.prepare(w), xs.float())
            expected = x @ exact.T
            error = ((got.double() - expected).norm() / expected.norm()).item()
            assert error < 1e-6, (candidate.name, rows, error)


# Groups of whole 128s at 4 bits take fw-vnni512's four-block kernel (the last group short at 256), the others its
# pairs' kernel; 1 and 2 rows run four and two weight rows a tile (74 output rows leave a tail of two), 3 and 9 one.
@pytest.mark.parametrize("bits, group, k", [(4, 32, 160), (8, 64, 160), (4, 128, 384), (4, 256, 384)])
def test_int8_activations_are_exactly_the_emulated_rounding(bits, group, k):
    """activations=int8: the native kernel's integer products equal the float product of the rounded activations."""
    w, exact = _random_weight(bits, 74, k, group, False)
    x = torch.randn(9, k)
    x[0, :32] = 0  # an all-zero block keeps a zero scale
    xq, dx = int_blocks(x)
    assert xq.abs().max() <= 127 and bool((dx[0, 0] == 0) and (xq[0, :32] == 0).all())
    rounded = (xq.double().view(9, -1, 32) * dx.double()[..., None]).view(9, k)
    assert ((rounded - x).abs() <= dx.repeat_interleave(32, 1) / 2 + 1e-7).all()
    expected = rounded @ exact.T
    for candidate in packed.PRODUCT_A8.supported(packed.key(w, torch.float32)):
        for rows in (1, 2, 3, 9):
            got = candidate.run(candidate.prepare(w), x[:rows])
            error = ((got.double() - expected[:rows]).norm() / expected[:rows].norm()).item()
            assert error < 1e-6, (candidate.name, rows, error)


def test_int8_activations_option_stays_close_to_the_exact_path(plain, tmp_path):
    path = write(plain, tmp_path / "q", "gptq-4-sym-g32")
    exact, int8 = fw_logprobs(path, TOKENS), fw_logprobs(path, TOKENS, activations="int8")
    assert 0 < (int8 - exact).abs().max().item() < 0.05  # the rounding changes the numbers, a little
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=0)
    runs = []
    for options in ({}, {"quant": {"activations": "int8"}}):  # the option reaches the layers from LLM(...)
        llm = LLM(str(path), dtype="float32", num_kv_blocks=32, max_model_len=128, device="cpu",
                  plugin_options=options)
        try:
            out = llm.generate([{"prompt_token_ids": TOKENS}], params, use_tqdm=False)[0].outputs[0]
        finally:
            llm.shutdown()
        runs.append(out.logprobs[0][out.token_ids[0]].logprob)
    assert runs[0] != runs[1] and runs[0] == pytest.approx(runs[1], abs=0.05)


@pytest.mark.parametrize("bits, group, act_order", [(4, 32, False), (4, 64, True), (8, 32, False)])
def test_triton_gemm_in_the_interpreter(bits, group, act_order):
    """The CUDA kernel's arithmetic, run by Triton's interpreter on the CPU in float32 (conftest.py)."""
    pytest.importorskip("triton", reason="triton is not installed (pip install triton)")
    if torch.cuda.is_available():
        pytest.skip("the interpreter check is the CPU's; CUDA runs it in tests/test_gpu_paths.py")
    from fw_quant_gptq.triton_gemm import int_gemm

    w, exact = _random_weight(bits, 40, 96, group, act_order)
    x = torch.randn(5, 96, dtype=torch.float64)
    xs = x if w.perm is None else x[:, w.perm]
    got = int_gemm(xs.float(), w)
    expected = x @ exact.T
    assert ((got.double() - expected).norm() / expected.norm()).item() < 1e-6


# --- the tools that write these checkpoints (benchmarks/quant_refs; FW_QUANT_REFERENCE=<its output folder>) ------


# Two checkpoints GPTQModel wrote and read (act-order asymmetric GPTQ, AWQ), committed with what it computed, so
# that every run checks fw against the real tools; FW_QUANT_REFERENCE adds every variant made on the machine.
COMMITTED = Path(__file__).parent / "data" / "quant_refs"


def _reference_checkpoints() -> list:
    committed = sorted(p.parent for p in COMMITTED.glob("*/reference.safetensors"))
    root = os.environ.get("FW_QUANT_REFERENCE")
    made = sorted(p.parent for p in Path(root).glob("*/reference.safetensors")) if root else []
    return committed + [pytest.param(p, marks=pytest.mark.reference) for p in made]


def _sha256(t: torch.Tensor) -> str:
    import hashlib

    return hashlib.sha256(t.float().contiguous().numpy().tobytes()).hexdigest()


def fw_weights(model) -> dict[str, torch.Tensor]:
    """Every integer matrix of an fw model by checkpoint module name, float32 in the checkpoint's order."""
    out = {}
    for layer, names, weight in fw_layers(model):
        out.update(zip(names, weight.split(list(layer.spec.output_sizes)), strict=True))
    for _, block in model.named_modules():
        if isinstance(block, SparseMoeBlock) and hasattr(block.experts.moe_method, "experts"):
            spec = block.experts.spec
            for e, (w13, w2) in enumerate(block.experts.moe_method.experts):
                gate, up = torch.cat([packed.matrix(p.weight) for _, p in w13]).split(spec.intermediate_size)
                out.update(zip([f"{spec.checkpoint_prefix}.{e}.{p}" for p in spec.projections],
                               (gate, up, packed.matrix(w2[0][1].weight)), strict=True))
    return out


def _fw_name(module: str, arch: str) -> str:
    """GPTQModel writes Mixtral's experts in transformers 5's names; fw's MoESpec keeps the original ones."""
    if arch != "MixtralForCausalLM" or ".mlp.experts." not in module:
        return module
    stem, _, projection = module.rpartition(".")
    stem = stem.replace(".mlp.experts.", ".block_sparse_moe.experts.")
    return f"{stem}.{dict(gate_proj='w1', up_proj='w3', down_proj='w2')[projection]}"


@pytest.mark.parametrize("path", _reference_checkpoints(), ids=lambda p: p.name)
def test_checkpoints_written_and_read_by_the_reference_tools(path):
    from safetensors import safe_open
    from safetensors.torch import load_file

    reference = load_file(str(path / "reference.safetensors"))
    metadata = safe_open(str(path / "reference.safetensors"), "pt").metadata()
    config = json.loads((path / "config.json").read_text())["quantization_config"]
    if config.get("lm_head"):
        with pytest.raises(ModelLoadError, match="lm_head"):
            int_method(path)
        return
    # Decoded weights: exactly the reference's dequantization (GPTQModel's torch kernels).
    weights = fw_weights(load_layers(path, int_method(path)))
    arch = json.loads((path / "config.json").read_text())["architectures"][0]
    # Committed fixtures keep each dequantized weight's SHA-256 (of its float32 bytes) instead of the weight.
    hashes = {k.removesuffix(".weight"): _sha256(v) for k, v in reference.items() if k.endswith(".weight")}
    expected = {_fw_name(k, arch): v for k, v in (hashes or json.loads(metadata["weight_sha256"])).items()}
    assert {name: _sha256(w) for name, w in weights.items()} == expected
    prompts = [reference[f"input_ids.{i}"].tolist() for i in range(2)]
    # GPTQModel's GPTQ layers compute in float32 like fw; its AWQ layers cast their input to float16.
    half = "float16" in metadata.get("linear_compute", "")
    for i, ids in enumerate(prompts):
        error = (fw_logprobs(path, ids) - reference[f"logprobs.{i}"].float()).abs().max().item()
        print(f"{path.name} prompt {i}: max |fw - reference| log-probability {error:.2e}")
        assert error < (1e-2 if half else 1e-4)
    llm = LLM(str(path), dtype="float32", num_kv_blocks=32, max_model_len=128, device="cpu")
    try:
        greedy = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], greedy, use_tqdm=False)
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == [reference[f"greedy.{i}"].tolist() for i in range(2)]


# --- the LM head, rounded to 8 or 4 bits only when asked ------------------------------------------------------


@pytest.mark.parametrize("activations, bits", [("none", 8), ("int8", 8), ("int8", 4)])
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_lm_head_is_rounded_only_when_asked(activations, bits, tied, tmp_path):
    plain = make_tiny_model("Qwen2ForCausalLM", tmp_path / "plain", tie_word_embeddings=tied)
    path = intq.write_checkpoint(plain, tmp_path / "gptq")
    config = model_registry.read_hf_config(str(path))["quantization_config"]
    table = dict(iter_safetensors(plain))["model.embed_tokens.weight" if tied else "lm_head.weight"]
    assert load_layers(path, IntMethod(IntOptions(), config)).lm_head.quantized is None  # the default: float
    options = {"lm_head": True, "activations": activations, "lm_head_bits": bits}
    model = load_layers(path, IntMethod(IntOptions(**options), config))
    hidden = torch.randn(3, table.shape[1], generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model.compute_logits(hidden)
    assert logits.dtype == torch.float32
    # Symmetric in groups of 32 here (64 input features: not a multiple of 128), levels -127..127 or -7..7.
    groups = table.reshape(table.shape[0], -1, 32)
    scale = groups.abs().amax(-1, keepdim=True) / ((1 << (bits - 1)) - 1)
    rounded = ((groups / scale).round() * scale).reshape(table.shape)
    inputs = hidden if activations == "none" else int_block_rounded(hidden)
    torch.testing.assert_close(logits, inputs @ rounded.T, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(logits, hidden @ table.T, rtol=1e-5, atol=1e-5)  # it really was rounded
    if tied:  # the lookup still reads the float table
        assert torch.equal(model.model.embed_tokens.weight, table)
    else:  # the float head is gone: its memory is the point
        assert not hasattr(model.lm_head, "weight")
    tokens = fw_greedy(path, quant="gptq", plugin_options={"quant": options})
    assert [len(t) for t in tokens] == [16, 16]


def test_lm_head_bits_needs_a_rounded_head():
    with pytest.raises(ValidationError, match="set lm_head=true"):
        IntOptions(lm_head_bits=4)
    with pytest.raises(ValidationError, match="8 or 4, not 3"):
        IntOptions(lm_head=True, lm_head_bits=3)

"""fp8 KV-cache scales from the checkpoint (compressed-tensors' kv_cache_scheme, vLLM/AutoFP8/TGI names).

A copy of a tiny bf16 Llama gets per-layer K and V scales; under --kv-cache-dtype fp8 the layers' specs carry
them, the cache holds fp8(K / k_scale), and every read (prefill and the CPU's native decode) multiplies them back.
Any other cache dtype loads the same checkpoint and ignores them.
"""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_kv_cache_dtype import TOLERANCE, _logits, _runner

from fw import model_registry
from fw.model_loader import load_model
from fw.models.base import HFConfig, ModelContext
from fw.sdk.checkpoint import iter_safetensors
from fw.sdk.errors import ModelLoadError
from fw.step_inputs import StepInputs
from fw.testing.models import make_tiny_model
from fw_attention_torch.backend import TorchAttention
from fw_quant_none.method import Unquantized

# What llm-compressor writes for an fp8 KV cache (QuantizationModifier(kv_cache_scheme=...)) with no weight groups.
SCHEME = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
# Per layer (K, V), powers of two so that bf16 holds them exactly; K and V divided by them stay inside fp8's range
# (448), which test_the_cache_stores_k_and_v_divided_by_the_scales checks.
SCALES = [(2**-6, 2**-5), (2**-7, 2**-4)]
IDS = torch.randint(3, 500, (40,), generator=torch.Generator().manual_seed(1)).tolist()


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    return make_tiny_model("LlamaForCausalLM", tmp_path_factory.mktemp("kvs") / "plain", dtype="bfloat16")


def with_scales(plain, dst, scales=SCALES, style="k_scale", scheme=SCHEME):
    """A copy of ``plain`` with per-layer scales named as ``style`` and, unless None, compressed-tensors'
    ``kv_cache_scheme`` (a KV-cache-only config: its weights stay plain)."""
    shutil.copytree(plain, dst)
    tensors = load_file(dst / "model.safetensors")
    for i, (k, v) in enumerate(scales):
        attn = f"model.layers.{i}.self_attn"
        if style == "k_scale":  # newer compressed-tensors: one-element tensors in the model dtype
            tensors[f"{attn}.k_scale"] = torch.tensor([k], dtype=torch.bfloat16)
            tensors[f"{attn}.v_scale"] = torch.tensor([v], dtype=torch.bfloat16)
        elif style == "output_scale":  # older compressed-tensors: the k/v projections' output scales
            tensors[f"{attn}.k_proj.output_scale"] = torch.tensor([k])
            tensors[f"{attn}.v_proj.output_scale"] = torch.tensor([v])
        else:  # AutoFP8 / TGI: one scalar for both
            assert k == v
            tensors[f"{attn}.kv_scale"] = torch.tensor(k)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    if scheme is not None:
        config = json.loads((dst / "config.json").read_text())
        config["quantization_config"] = {
            "quant_method": "compressed-tensors",
            "format": "dense",
            "config_groups": {},
            "ignore": [],
            "quantization_status": "compressed",
            "kv_cache_scheme": scheme,
        }
        (dst / "config.json").write_text(json.dumps(config))
    return dst


def specs(runner):
    return [(s.k_scale, s.v_scale) for s in runner.model.attention_specs()]


def test_a_kv_cache_only_compressed_tensors_config_is_a_plain_checkpoint(plain, tmp_path):
    from fw.config import load_config
    from fw.platform import DeviceInfo
    from fw.validate import check

    config = json.loads((with_scales(plain, tmp_path / "ckpt") / "config.json").read_text())
    result = check(load_config(cli={}).config, DeviceInfo("cpu"), config)
    assert result.ok and result.selected["quant"].name == "none"
    config["quantization_config"]["config_groups"] = {"g": {"targets": ["Linear"], "weights": {"num_bits": 4}}}
    assert check(load_config(cli={}).config, DeviceInfo("cpu"), config).requirements.quant_format


@pytest.mark.parametrize("style", ["k_scale", "output_scale", "kv_scale"])
def test_fp8_layers_take_the_checkpoint_scales(plain, tmp_path, style):
    scales = [(2**-6, 2**-6), (2**-4, 2**-4)] if style == "kv_scale" else SCALES
    scheme = None if style == "kv_scale" else SCHEME  # TGI's kv_scale checkpoints have no quantization_config
    runner = _runner(with_scales(plain, tmp_path / style, scales, style, scheme), "fp8")
    assert specs(runner) == scales
    assert specs(_runner(plain, "fp8")) == [(1.0, 1.0)] * 2


def test_the_cache_stores_k_and_v_divided_by_the_scales(plain, tmp_path):
    runner = _runner(with_scales(plain, tmp_path / "ckpt"), "fp8")
    seen = []  # (K, V) as each attention layer received them, [T, kv_heads * head_size]
    for layer in runner.model.model.layers:
        layer.self_attn.attn.register_forward_pre_hook(lambda _, args: seen.append((args[1].clone(), args[2].clone())))
    runner.execute(StepInputs(IDS[:32], [0], [32], [[5, 2]], [], [31], []))
    for cache, (k, v), scales in zip(runner.kv_caches, seen, SCALES, strict=True):
        for part, x, scale in zip(cache, (k, v), scales, strict=True):
            stored = torch.cat([part[5], part[2]])  # blocks 5 and 2 hold positions 0-15 and 16-31
            x = x.view(stored.shape).float()
            assert (x / scale).abs().max() < 448, "the scale saturates: pick a larger one for this check"
            expected = (x / scale).to(torch.float8_e4m3fn)
            assert torch.equal(stored.view(torch.uint8), expected.view(torch.uint8))
            assert not torch.equal(stored.view(torch.uint8), x.to(torch.float8_e4m3fn).view(torch.uint8))


def test_every_read_path_multiplies_the_scales_back(plain, tmp_path):
    """32 prefill positions, then decodes (the native kernel on the CPU): a read that dropped a scale would be off
    by its factor of 16-128, far outside fp8's error."""
    reference = _logits(_runner(plain, "auto"), IDS)
    scaled = _logits(_runner(with_scales(plain, tmp_path / "ckpt"), "fp8"), IDS)
    max_tol, mean_tol = TOLERANCE["fp8"]
    diff = (scaled - reference).abs()
    assert diff.max() <= max_tol and diff.mean() <= mean_tol, (diff.max().item(), diff.mean().item())


def test_a_saturating_scale_changes_the_logits(plain, tmp_path):
    """The control: K / 2^-14 exceeds 448 almost everywhere and saturates, so the checkpoint's scale is used."""
    tiny = with_scales(plain, tmp_path / "tiny", scales=[(2**-14, 2**-14)] * 2)
    unscaled = _logits(_runner(plain, "fp8"), IDS)
    saturated = _logits(_runner(tiny, "fp8"), IDS)
    assert (saturated - unscaled).abs().max() > 10 * TOLERANCE["fp8"][0]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_other_cache_dtypes_load_the_checkpoint_and_ignore_its_scales(plain, tmp_path, kv_cache_dtype):
    # Scales that would be invalid under fp8 do not matter either: nothing reads them.
    scales = [(2**-6, 2**-5), (0.0, -1.0)]
    runner = _runner(with_scales(plain, tmp_path / "ckpt", scales), kv_cache_dtype)
    assert specs(runner) == [(1.0, 1.0)] * 2
    assert torch.equal(_logits(runner, IDS), _logits(_runner(plain, kv_cache_dtype), IDS))


@pytest.mark.parametrize(
    ("scales", "scheme", "message"),
    [
        ([(2**-6, 2**-5), (0.0, 1.0)], SCHEME, r"model.layers.1.self_attn.k_scale = 0.0: .* positive and finite"),
        ([(2**-6, float("nan")), (1.0, 1.0)], SCHEME, r"model.layers.0.self_attn.v_scale = nan"),
        (SCALES, {**SCHEME, "type": "int"}, r"kv_cache_scheme has type 'int': .*per-tensor 8-bit float"),
        (SCALES, {**SCHEME, "strategy": "channel", "symmetric": False}, r"strategy 'channel', symmetric False"),
    ],
)
def test_fp8_refuses_scales_it_cannot_use(plain, tmp_path, scales, scheme, message):
    with pytest.raises(ModelLoadError, match=message):
        _runner(with_scales(plain, tmp_path / "ckpt", scales, scheme=scheme), "fp8")


def test_a_per_head_scale_is_refused(plain, tmp_path):
    path = with_scales(plain, tmp_path / "ckpt")
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.0.self_attn.k_scale"] = torch.full((2, 1, 1), 0.5)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"self_attn.k_scale has shape \(2, 1, 1\): .* one scale per layer"):
        _runner(path, "fp8")


def test_a_layer_without_scales_keeps_1_with_a_warning(plain, tmp_path, caplog):
    path = with_scales(plain, tmp_path / "ckpt")
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.self_attn.v_scale"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with caplog.at_level(logging.WARNING, logger="fw.model_loader"):
        runner = _runner(path, "fp8")
    assert specs(runner) == [SCALES[0], (SCALES[1][0], 1.0)]
    assert "no KV-cache scale for K or V of model.layers.1.self_attn.attn" in caplog.text


@pytest.mark.parametrize("arch", ["MixtralForCausalLM", "Qwen3ForCausalLM"])
def test_vllm_and_modelopt_names_reach_every_architecture(tmp_path, arch):
    """vLLM's own names (self_attn.attn.k_scale) and ModelOpt's (k_proj.k_scale) too, on MoE and q/k-norm models."""
    path = make_tiny_model(arch, tmp_path / arch)
    config = HFConfig.from_file(path / "config.json")
    names = {0: ("attn.k_scale", "attn.v_scale"), 1: ("k_proj.k_scale", "v_proj.v_scale")}
    extra = [
        (f"model.layers.{i}.self_attn.{name}", torch.tensor([scale]))
        for i, pair in names.items()
        for name, scale in zip(pair, SCALES[i], strict=True)
    ]
    ctx = ModelContext(dtype=torch.float32, quant=Unquantized(), attention=TorchAttention())
    model_cls = model_registry.resolve(config.to_dict()).load()
    model = load_model(model_cls, config, ctx, [*iter_safetensors(path), *extra], kv_cache_dtype="fp8")
    assert [(s.k_scale, s.v_scale) for s in model.attention_specs()] == SCALES

"""The quant contract for routed experts: a plugin's ``MoEMethod`` holds a checkpoint's quantized experts.

A test-local format stands in for a W8A16 checkpoint: every linear and expert matrix stored as ``weight`` (int8)
and ``weight_scale`` (float32, one per output row). Tiny Mixtral- and Qwen-MoE-shaped models load it through the
layers' weight loaders and must compute what fw's unquantized model computes on the dequantized weights.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from fw import model_registry
from fw.interfaces.quant import LinearMethod, LinearSpec, MoEMethod, MoESpec, QuantMethod
from fw.layers.moe import FusedMoE
from fw.model_loader import load_model
from fw.models.base import HFConfig, ModelContext
from fw.models.moe import SparseMoeBlock
from fw.sdk.activation import silu_and_mul
from fw.sdk.checkpoint import iter_safetensors
from fw.sdk.moe import run_experts
from fw.testing.models import make_tiny_model
from fw_quant_none.method import Unquantized

# Architecture -> (its first MoE block's name in the checkpoint, and in fw), and its experts' projection names.
ARCHITECTURES = {
    "MixtralForCausalLM": ("model.layers.0.block_sparse_moe", "model.layers.0.mlp", ("w1", "w3", "w2")),
    "Qwen2MoeForCausalLM": ("model.layers.0.mlp", "model.layers.0.mlp", ("gate_proj", "up_proj", "down_proj")),
    "Qwen3MoeForCausalLM": ("model.layers.1.mlp", "model.layers.1.mlp", ("gate_proj", "up_proj", "down_proj")),
}


def _int8_param(shape: tuple[int, ...]) -> nn.Parameter:
    param = nn.Parameter(torch.empty(shape, dtype=torch.int8), requires_grad=False)
    param.output_dim, param.input_dim = 0, 1  # of one [out, in] matrix
    return param


def _scale_param(shape: tuple[int, ...]) -> nn.Parameter:
    param = nn.Parameter(torch.empty(shape, dtype=torch.float32), requires_grad=False)
    param.output_dim, param.input_dim = 0, None  # one per output row: split with the rows, never by input
    return param


class Int8Linear(LinearMethod):
    def create_weights(self, layer: nn.Module, spec: LinearSpec) -> None:
        rows = sum(spec.output_sizes)
        layer.register_parameter("weight", _int8_param((rows, spec.input_size)))
        layer.register_parameter("weight_scale", _scale_param((rows,)))

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        out = F.linear(x, layer.weight.to(x.dtype)) * layer.weight_scale.to(x.dtype)
        return out if bias is None else out + bias


class Int8Experts(MoEMethod):
    def create_weights(self, layer: nn.Module, spec: MoESpec) -> None:
        e, h, i = spec.num_experts, spec.hidden_size, spec.intermediate_size
        layer.register_parameter("w13_weight", _int8_param((e, 2 * i, h)))
        layer.register_parameter("w13_weight_scale", _scale_param((e, 2 * i)))
        layer.register_parameter("w2_weight", _int8_param((e, h, i)))
        layer.register_parameter("w2_weight_scale", _scale_param((e, h)))

    def apply(self, layer, x, topk_weights, topk_ids):
        def expert(e: int, rows: torch.Tensor) -> torch.Tensor:
            gate_up = F.linear(rows, layer.w13_weight[e].to(rows.dtype)) * layer.w13_weight_scale[e]
            return F.linear(silu_and_mul(gate_up), layer.w2_weight[e].to(rows.dtype)) * layer.w2_weight_scale[e]

        return run_experts(x, topk_weights, topk_ids, layer.w13_weight.shape[0], expert)


class Int8Checkpoint(QuantMethod):
    """Records the specs it is given, so that the test can check what a plugin learns about each layer."""

    def __init__(self) -> None:
        super().__init__()
        self.specs: dict[str, LinearSpec | MoESpec] = {}

    def get_linear_method(self, spec: LinearSpec) -> LinearMethod:
        self.specs[spec.prefix] = spec
        return Int8Linear()

    def get_moe_method(self, spec: MoESpec) -> MoEMethod:
        self.specs[spec.prefix] = spec
        return Int8Experts()


def write_int8(plain: Path, out: Path) -> Path:
    """The plain checkpoint with every matrix of the decoder layers as int8 rows and their scales."""
    tensors = {}
    for name, tensor in iter_safetensors(plain):
        if ".layers." in name and tensor.dim() == 2:
            scale = tensor.abs().amax(dim=1) / 127
            tensors[name] = (tensor / scale[:, None]).round().to(torch.int8)
            tensors[f"{name}_scale"] = scale
        else:
            tensors[name] = tensor
    out.mkdir()
    save_file(tensors, out / "model.safetensors")
    config = json.loads((plain / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "int8-test"}}))
    return out


def dequantized(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    tensors = dict(iter_safetensors(path))
    for name, tensor in tensors.items():
        if tensor.dtype == torch.int8:
            yield name, tensor.float() * tensors[f"{name}_scale"][:, None]
        elif not name.endswith("_scale"):
            yield name, tensor


def load(path: Path, quant: QuantMethod, weights) -> nn.Module:
    config = model_registry.read_hf_config(str(path))
    ctx = ModelContext(dtype=torch.float32, quant=quant, attention=None)  # no attention: blocks are run alone
    return load_model(model_registry.resolve(config).load(), HFConfig(config), ctx, weights)


@pytest.fixture(scope="module", params=list(ARCHITECTURES))
def int8_checkpoint(request, tmp_path_factory) -> tuple[str, Path]:
    root = tmp_path_factory.mktemp(request.param)
    return request.param, write_int8(make_tiny_model(request.param, root / "plain"), root / "int8")


def test_quantized_experts_match_the_dequantized_reference(int8_checkpoint):
    _, path = int8_checkpoint
    model = load(path, Int8Checkpoint(), iter_safetensors(path))
    reference = load(path, Unquantized(), dequantized(path))
    blocks = [(n, m) for n, m in model.named_modules() if isinstance(m, SparseMoeBlock)]
    assert blocks
    gen = torch.Generator().manual_seed(0)
    for name, block in blocks:
        assert block.experts.w13_weight.dtype == torch.int8
        x = torch.randn(16, block.experts.spec.hidden_size, generator=gen)
        with torch.no_grad():
            got, expected = block(x), reference.get_submodule(name)(x)
        error = ((got - expected).norm() / expected.norm()).item()
        assert error < 1e-5, f"{name}: relative error {error:.3g}"


def test_plugins_learn_the_checkpoint_names(int8_checkpoint):
    arch, path = int8_checkpoint
    block, fw_block, projections = ARCHITECTURES[arch]
    quant = Int8Checkpoint()
    load(path, quant, iter_safetensors(path))
    experts = quant.specs[f"{fw_block}.experts"]
    assert (experts.checkpoint_prefix, experts.projections) == (f"{block}.experts", projections)
    assert quant.specs[f"{fw_block}.gate"].checkpoint_names == (f"{block}.gate",)
    qkv = quant.specs["model.layers.0.self_attn.qkv_proj"]
    assert qkv.checkpoint_names == tuple(f"model.layers.0.self_attn.{m}_proj" for m in "qkv")
    assert qkv.shard_ids == ("q", "k", "v") and qkv.output_is_parallel and not qkv.input_is_parallel


class _Rank1Of2:
    rank, world_size = 1, 2


def test_second_rank_holds_its_half_of_each_expert_and_scale(monkeypatch):
    monkeypatch.setattr("fw.layers.moe.get_tp_group", lambda: _Rank1Of2())
    hidden, width = 8, 6
    layer = FusedMoE(2, 1, hidden, width, renormalize=False, quant=Int8Checkpoint(), params_dtype=torch.float32,
                     prefix="experts", checkpoint_prefix="experts", projections=("w1", "w3", "w2"))
    gen = torch.Generator().manual_seed(0)
    full = {w: torch.randint(-127, 128, (width, hidden) if w != "w2" else (hidden, width), generator=gen,
                             dtype=torch.int8) for w in ("w1", "w3", "w2")}
    scales = {w: torch.rand(t.shape[0], generator=gen) for w, t in full.items()}
    for which in full:
        stem = "w2_" if which == "w2" else "w13_"
        for leaf, tensor in (("weight", full[which]), ("weight_scale", scales[which])):
            param = getattr(layer, stem + leaf)
            param.weight_loader(param, tensor, (1, which))
    half = slice(width // 2, width)
    assert torch.equal(layer.w13_weight[1], torch.cat([full["w1"][half], full["w3"][half]]))
    assert torch.equal(layer.w13_weight_scale[1], torch.cat([scales["w1"][half], scales["w3"][half]]))
    assert torch.equal(layer.w2_weight[1], full["w2"][:, half])
    assert torch.equal(layer.w2_weight_scale[1], scales["w2"])  # per output row of down: not split


def test_a_quantized_tensor_never_loads_silently_into_a_float_parameter(tmp_path):
    """A plugin without a method for a layer (here: none, on fp8 experts) must fail, not drop the scales."""
    plain = make_tiny_model("MixtralForCausalLM", tmp_path / "plain")
    tensors = dict(iter_safetensors(plain))
    name = next(n for n in tensors if ".experts.0.w1." in n)
    tensors[name] = tensors[name].to(torch.float8_e4m3fn)
    save_file(tensors, plain / "model.safetensors")
    with pytest.raises(ValueError, match=r"a float8_e4m3fn checkpoint tensor cannot load into a float32 parameter"):
        load(plain, Unquantized(), iter_safetensors(plain))

"""Linear layers and experts with integer weights: parameters named after the checkpoint tensors' leaves
(``formats``), decoded and repacked into fw's layout once loaded (``packed``).

A fused layer (q/k/v, gate/up) loads its sub-matrices side by side in each packed tensor (the layer's loader
scales offsets for packed dimensions); each sub-matrix keeps its own ``g_idx``. Adjacent sub-matrices with the
same ``g_idx`` (under act-order the same input permutation, which GPTQ gives matrices that share an input)
become one product.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from fw.interfaces.quant import LinearMethod, LinearSpec, MoEMethod, MoESpec, QuantMethod
from fw.sdk.activation import silu_and_mul
from fw.sdk.errors import ModelLoadError
from fw.sdk.linear import UnquantizedLinearMethod
from fw.sdk.moe import UnquantizedMoEMethod, run_experts
from fw_quant_gptq.formats import Scheme, Schemes, decode, in_features
from fw_quant_gptq.packed import LOGITS, Product, repack, round_rows, select_product


def _leaves(scheme: Scheme, out: int, width: int) -> dict[str, tuple[tuple[int, ...], torch.dtype, int, int | None]]:
    """The checkpoint tensors of ``out`` stacked output rows over ``width`` input features: leaf -> (shape,
    dtype, output_dim, input_dim)."""
    per, groups = 32 // scheme.bits, scheme.groups(width)
    grouped = None if scheme.group == -1 else 0  # per-channel scales are not split with the input features
    for what, size in (("output features", out), ("input features", width)):
        if size % per:
            raise ModelLoadError(f"{size} {what} are not whole {per}-value words of {scheme.bits}-bit weights")
    if scheme.layout in ("gptq", "gptq_v2"):
        return {"qweight": ((width // per, out), torch.int32, 1, 0),
                "qzeros": ((groups, out // per), torch.int32, 1, grouped),
                "scales": ((groups, out), torch.float32, 1, grouped)}
    if scheme.layout == "awq":
        return {"qweight": ((width, out // per), torch.int32, 1, 0),
                "qzeros": ((groups, out // per), torch.int32, 1, grouped),
                "scales": ((groups, out), torch.float32, 1, grouped)}
    leaves = {"weight_packed": ((out, width // per), torch.int32, 0, 1),
              "weight_scale": ((out, groups), torch.float32, 0, None if grouped is None else 1)}
    if not scheme.symmetric:
        leaves["weight_zero_point"] = ((out // per, groups), torch.int32, 0, None if grouped is None else 1)
    return leaves


def _g_idx_leaf(scheme: Scheme) -> str | None:
    """The leaf holding each sub-matrix's group of every input feature: GPTQ always stores one (in order
    without act-order), compressed-tensors under act-order."""
    if scheme.layout == "pack-quantized":
        return "weight_g_idx" if scheme.act_order else None
    return "g_idx" if scheme.layout in ("gptq", "gptq_v2") else None


def _param(shape: tuple[int, ...], dtype: torch.dtype, output_dim: int | None, input_dim: int | None) -> nn.Parameter:
    param = nn.Parameter(torch.zeros(shape, dtype=dtype), requires_grad=False)
    param.output_dim, param.input_dim = output_dim, input_dim
    return param


def _ignored(param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
    """``weight_shape``: the shapes are the layer's own."""


def _register(layer: nn.Module, stem: str, scheme: Scheme, out: int, width: int, subs: int, experts: int | None,
              g_idx_loader: Any) -> list[str]:
    """Register the checkpoint parameters (``experts`` stacked in front, if any); returns the packed leaves."""
    lead = () if experts is None else (experts,)
    leaves = _leaves(scheme, out, width)
    for leaf, (shape, dtype, output_dim, input_dim) in leaves.items():
        layer.register_parameter(stem + leaf, _param(lead + shape, dtype, output_dim, input_dim))
    g_leaf = _g_idx_leaf(scheme)
    if g_leaf:
        param = _param((*lead, subs, width), torch.int32, None, None)
        param.weight_loader = g_idx_loader
        layer.register_parameter(stem + g_leaf, param)
    if scheme.layout == "pack-quantized":
        param = _param((*lead, subs, 2), torch.int64, None, None)
        param.weight_loader = _ignored
        layer.register_parameter(stem + "weight_shape", param)
    return list(leaves)


def _products(layer: nn.Module, stem: str, scheme: Scheme, leaves: list[str], sizes: tuple[int, ...],
              dtype: torch.dtype, int8: bool, expert: int | None = None) -> list[tuple[slice, Product]]:
    """Decode one (stacked) matrix's parameters and repack each run of sub-matrices with one ``g_idx``."""
    def tensor(leaf: str) -> torch.Tensor:
        data = getattr(layer, stem + leaf).data
        return data if expert is None else data[expert]

    packed = {leaf: tensor(leaf) for leaf in leaves}
    width = in_features(scheme, packed)
    q, zero, scale = decode(scheme, packed, width)
    plain = torch.arange(width, device=q.device) // (width if scheme.group == -1 else scheme.group)
    runs: list[list[Any]] = []  # [first row, end row, g_idx]
    start = 0
    for i, size in enumerate(sizes):
        # Without act-order the groups are in order: the stored g_idx (of every rank's features) is not read.
        g_idx = tensor(_g_idx_leaf(scheme))[i].long() if scheme.act_order else plain
        if runs and torch.equal(runs[-1][2], g_idx):
            runs[-1][1] += size
        else:
            runs.append([start, start + size, g_idx])
        start += size
    return [(slice(lo, hi), Product(repack(scheme.bits, q[lo:hi], zero[lo:hi], scale[lo:hi], g), dtype, int8))
            for lo, hi, g in runs]


def _drop(layer: nn.Module, stem: str, scheme: Scheme, leaves: list[str]) -> None:
    """Free the checkpoint tensors once repacked (a bias stays)."""
    extra = [_g_idx_leaf(scheme), "weight_shape" if scheme.layout == "pack-quantized" else None]
    for leaf in leaves + [e for e in extra if e]:
        delattr(layer, stem + leaf)


class IntLinearMethod(LinearMethod):
    def __init__(self, scheme: Scheme, int8: bool) -> None:
        self.scheme, self.int8 = scheme, int8

    def create_weights(self, layer: nn.Module, spec: LinearSpec) -> None:
        scheme = self.scheme
        if scheme.act_order and spec.input_is_parallel and spec.tp_size > 1:
            raise ModelLoadError(f"{spec.prefix}: act-order (desc_act) weights split by input features over "
                                 "tensor-parallel ranks are not supported; use tensor parallel size 1")
        self.sizes, self.dtype = spec.output_sizes, spec.params_dtype

        def load_g_idx(param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
            param.data[spec.shard_index(shard_id)].copy_(loaded)

        self.leaves = _register(layer, "", scheme, sum(spec.output_sizes), spec.input_size, len(spec.output_sizes),
                                None, load_g_idx)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        self.runs = _products(layer, "", self.scheme, self.leaves, self.sizes, self.dtype, self.int8)
        _drop(layer, "", self.scheme, self.leaves)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        outs = [product(x, None if bias is None else bias[rows]) for rows, product in self.runs]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)


class IntMoEMethod(MoEMethod):
    """Routed experts: ``w13_<leaf>`` (gate rows, then up rows) and ``w2_<leaf>`` stacked per expert."""

    def __init__(self, scheme: Scheme, int8: bool) -> None:
        self.scheme, self.int8 = scheme, int8

    def create_weights(self, layer: nn.Module, spec: MoESpec) -> None:
        scheme, e, h, i = self.scheme, spec.num_experts, spec.hidden_size, spec.intermediate_size
        if scheme.act_order and spec.tp_size > 1:
            raise ModelLoadError(f"{spec.prefix}: act-order experts over tensor-parallel ranks are not supported")
        self.dtype, self.intermediate = spec.params_dtype, i

        def load_g_idx(param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple[int, str]) -> None:
            expert, which = shard_id
            param.data[expert, 1 if which == "w3" else 0].copy_(loaded)

        self.leaves = {stem: _register(layer, stem, scheme, out, width, subs, e, load_g_idx)
                       for stem, out, width, subs in (("w13_", 2 * i, h, 2), ("w2_", h, i, 1))}

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        experts = next(iter(layer.parameters(recurse=False))).shape[0]
        i = self.intermediate
        self.experts = [
            (_products(layer, "w13_", self.scheme, self.leaves["w13_"], (i, i), self.dtype, self.int8, e),
             _products(layer, "w2_", self.scheme, self.leaves["w2_"], (layer.spec.hidden_size,), self.dtype,
                       self.int8, e))
            for e in range(experts)
        ]
        for stem, leaves in self.leaves.items():
            _drop(layer, stem, self.scheme, leaves)

    def apply(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
              ) -> torch.Tensor:
        def expert(e: int, rows: torch.Tensor) -> torch.Tensor:
            w13, w2 = self.experts[e]
            gate_up = torch.cat([product(rows) for _, product in w13], dim=-1) if len(w13) > 1 else w13[0][1](rows)
            return w2[0][1](silu_and_mul(gate_up))

        return run_experts(x, topk_weights, topk_ids, len(self.experts), expert)


class IntMethod(QuantMethod):
    """GPTQ, AWQ and compressed-tensors pack-quantized checkpoints: which layout each layer has comes from
    ``quantization_config``; layers it leaves in float use fw-quant-none's method."""

    def __init__(self, options: Any = None, quant_config: dict[str, Any] | None = None) -> None:
        super().__init__(options, quant_config)
        if not self.quant_config:
            raise ModelLoadError("integer weights need a checkpoint with a quantization_config (gptq, awq or "
                                 "compressed-tensors pack-quantized); this plugin does not quantize at load")
        self.schemes = Schemes(self.quant_config)
        self.int8 = options is not None and options.activations == "int8"

    def get_linear_method(self, spec: LinearSpec) -> LinearMethod:
        scheme = self.schemes.common(spec.checkpoint_names, spec.prefix)
        return UnquantizedLinearMethod() if scheme is None else IntLinearMethod(scheme, self.int8)

    def get_moe_method(self, spec: MoESpec) -> MoEMethod:
        names = tuple(f"{spec.checkpoint_prefix}.{e}.{p}" for e in range(spec.num_experts) for p in spec.projections)
        scheme = self.schemes.common(names, spec.prefix)
        return UnquantizedMoEMethod() if scheme is None else IntMoEMethod(scheme, self.int8)

    def get_logits_method(self, weight: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor] | None:
        if self.options is None or not self.options.lm_head:
            return None
        rows = round_rows(weight, self.options.lm_head_bits)
        if not self.int8:  # weight-only: float32 logits from the hidden states as they are (packed.LOGITS)
            return select_product(rows, weight.dtype, op=LOGITS)
        product = Product(rows, torch.float32, True)
        return lambda hidden: product(hidden.float())

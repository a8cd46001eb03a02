"""Helpers for linear methods: the tensor-parallel split, integer block rounding, placing a checkpoint tensor, and
the unquantized method itself.

A quant plugin's ``LinearMethod`` uses them beside ``fw.sdk.dense`` (the float products); the core's linear
layers (``fw.layers.linear``) place their own checkpoint tensors with ``load_linear_shard`` too. The ``none`` quant
plugin is ``UnquantizedLinearMethod`` for every layer; other plugins use it for the layers a checkpoint leaves in
float, as ``fw.sdk.moe.UnquantizedMoEMethod`` for experts.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fw.interfaces.quant import LinearMethod, LinearSpec
from fw.sdk import dense
from fw.sdk.weights import load_shard


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) is not divisible by the tensor-parallel size ({denominator})")
    return numerator // denominator


def int_blocks(x: torch.Tensor, block: int = 32, dtype: torch.dtype = torch.int8) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [rows, K] as integer blocks of ``block`` values with one float32 scale each (absmax / the dtype's
    largest value), as llama.cpp rounds activations to int8 for its integer products: (xq [rows, K] in ``dtype``,
    dx float32 [rows, K / block]). The quant plugins' integer-activation kernels round the same way; this is their
    references' rounding."""
    levels = torch.iinfo(dtype).max
    blocks = x.float().reshape(x.shape[0], x.shape[1] // block, block)
    dx = blocks.abs().amax(-1) / levels
    xq = (blocks / torch.where(dx > 0, dx, 1.0)[..., None]).round().clamp(-levels, levels).to(dtype)  # half to even
    return xq.reshape(x.shape).contiguous(), dx.contiguous()


def int_block_rounded(x: torch.Tensor, block: int = 32, dtype: torch.dtype = torch.int8) -> torch.Tensor:
    """``x`` (any leading dimensions) in float32 as ``int_blocks`` rounds it."""
    xq, dx = int_blocks(x.reshape(-1, x.shape[-1]), block, dtype)
    return (xq.float().view(*dx.shape, block) * dx[..., None]).view(x.shape)


def load_linear_shard(spec: LinearSpec, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
    """Place one checkpoint tensor into a linear layer's parameter by its ``output_dim`` / ``input_dim``: the
    layers' own loader, and public for a quant plugin's loader that converts a tensor before placing it."""
    idx = spec.shard_index(shard_id)
    load_shard(
        param.data,
        loaded,
        output_dim=getattr(param, "output_dim", None),
        input_dim=getattr(param, "input_dim", None),
        output_sizes=spec.output_sizes,
        index=idx,
        output_rank=spec.shard_rank(idx) if spec.output_is_parallel else None,
        input_rank=spec.tp_rank if spec.input_is_parallel else None,
        what=f"{spec.prefix}, shard {shard_id}",
    )


class UnquantizedLinearMethod(LinearMethod):
    """One ``weight [out, in]`` parameter in the model dtype, the fused sub-matrices stacked along ``out``."""

    def create_weights(self, layer: nn.Module, spec: LinearSpec) -> None:
        weight = nn.Parameter(
            torch.empty(sum(spec.output_sizes), spec.input_size, dtype=spec.params_dtype), requires_grad=False
        )
        weight.output_dim, weight.input_dim = 0, 1
        layer.register_parameter("weight", weight)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return dense.linear(x, layer.weight, bias)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        dense.pack_parameter(layer)

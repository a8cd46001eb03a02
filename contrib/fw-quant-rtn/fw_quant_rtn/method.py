"""int8 weight-only linear layers.

Loading follows the core's weight-loader contract: ``create_weights`` registers a plain ``[out, in]`` weight
carrying ``output_dim`` / ``input_dim``, sized from the layer's ``LinearSpec``, so the layer's own loader places
each checkpoint tensor (fused q/k/v and gate/up shards, tensor-parallel slices) into it. Once it is full, ``process_weights_after_loading``
replaces it with int8 rows and one scale per row. Skipped layers keep the float weight and use the core's
public dense helpers, so they get the CPU's packed fast path like the built-in ``none`` plugin.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fw.interfaces.quant import LinearMethod, LinearSpec, QuantMethod
from fw.sdk import dense


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output row: (int8 ``[out, in]``, float32 scale ``[out]``); weight ~ q * scale[:, None]."""
    weight = weight.detach().float()
    scale = weight.abs().amax(dim=1).clamp(min=1e-12) / 127
    return (weight / scale[:, None]).round().to(torch.int8), scale


class RtnLinearMethod(LinearMethod):
    def create_weights(self, layer: nn.Module, spec: LinearSpec) -> None:
        shape = (sum(spec.output_sizes), spec.input_size)
        weight = nn.Parameter(torch.empty(shape, dtype=spec.params_dtype), requires_grad=False)
        weight.output_dim, weight.input_dim = 0, 1  # rows are outputs (split by column-parallel layers), columns inputs
        layer.register_parameter("weight", weight)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        dtype = layer.weight.dtype
        qweight, scale = quantize_rows(layer.weight)
        del layer.weight
        layer.register_buffer("qweight", qweight, persistent=False)
        layer.register_buffer("scale", scale.to(dtype), persistent=False)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        out = F.linear(x, layer.qweight.to(x.dtype)) * layer.scale
        return out if bias is None else out + bias


class DenseLinearMethod(RtnLinearMethod):
    """Skipped layers: the same float weight, kept, and packed for the CPU's fast kernels by ``fw.sdk.dense``."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        dense.pack_parameter(layer)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return dense.linear(x, layer.weight, bias)


class RtnMethod(QuantMethod):
    def get_linear_method(self, spec: LinearSpec) -> LinearMethod:
        # By checkpoint name: a fused layer (q/k/v) stays in float when any of its matrices is skipped.
        skipped = any(name.rpartition(".")[2] in self.options.skip for name in spec.checkpoint_names)
        return DenseLinearMethod() if skipped else RtnLinearMethod()

from __future__ import annotations

import torch
from torch import nn

from fw.interfaces.quant import LinearMethod, LinearSpec, QuantMethod
from fw.layers import dense


class UnquantizedLinearMethod(LinearMethod):
    """One ``weight [out, in]`` parameter, the fused sub-matrices stacked along ``out``."""

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


class Unquantized(QuantMethod):
    def get_linear_method(self, spec: LinearSpec) -> LinearMethod:
        # Stateless, so every layer can share one instance.
        return _LINEAR


_LINEAR = UnquantizedLinearMethod()

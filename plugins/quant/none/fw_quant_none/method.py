from __future__ import annotations

import torch
from torch import nn

from fw.interfaces.quant import LinearMethod, QuantMethod
from fw.layers import dense


class UnquantizedLinearMethod(LinearMethod):
    """One ``weight [out, in]`` parameter, the fused sub-matrices stacked along ``out``."""

    def create_weights(
        self, layer: nn.Module, input_size: int, output_sizes: list[int], params_dtype: torch.dtype
    ) -> None:
        weight = nn.Parameter(torch.empty(sum(output_sizes), input_size, dtype=params_dtype), requires_grad=False)
        weight.output_dim, weight.input_dim = 0, 1
        layer.register_parameter("weight", weight)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return dense.linear(x, layer.weight, bias)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        dense.pack_parameter(layer)


class Unquantized(QuantMethod):
    def get_linear_method(self, prefix: str) -> LinearMethod:
        # Stateless, so every layer can share one instance.
        return _LINEAR


_LINEAR = UnquantizedLinearMethod()

"""RMSNorm, optionally fused with the residual add that precedes it in a pre-norm decoder."""

from __future__ import annotations

import torch
from torch import nn

from fw.sdk import native_ops
from fw.sdk.weights import default_weight_loader


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, *, params_dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=params_dtype), requires_grad=False)
        self.weight.weight_loader = default_weight_loader

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # Statistics in float32; cast back before the weight multiply, as the reference models do,
        # so that bf16 results round the same way.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``norm(x)``; with ``residual``, ``(norm(x + residual), x + residual)``."""
        if native_ops.usable(x) and x.dtype == self.weight.dtype:
            if residual is None:
                return torch.ops.fw_layers.rms_norm(x, self.weight, self.eps)
            return torch.ops.fw_layers.add_rms_norm(x, residual, self.weight, self.eps)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

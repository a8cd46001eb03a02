"""FP8 e4m3 numerics: rounding weights, widening them back, and the activation quantization of W8A8 schemes.

Everything follows compressed-tensors' reference formulas: scale = absmax / 448 (a zero scale becomes the
dtype's eps), q = float8(clamp(x / scale, -448, 448)), and q * scale back. Weight scales are held in float32 as
``[rows, groups]`` (groups = 1 for channel and tensor scales); widening computes ``q * scale`` in float32, which
is exact for bf16 and float32 scales and then rounds once to the target dtype, as the reference does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448


def _nonzero(scale: torch.Tensor) -> torch.Tensor:
    return torch.where(scale == 0, torch.finfo(scale.dtype).eps, scale)


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per output row: (float8 ``[out, in]``, float32 scale ``[out, 1]``), weight ~ q * scale."""
    weight = weight.float()
    scale = _nonzero(weight.abs().amax(dim=-1, keepdim=True) / FP8_MAX)
    return (weight / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def expand_scale(scale: torch.Tensor, in_features: int, group: int | None) -> torch.Tensor:
    """``[rows, groups]`` scales, each for ``group`` input features (the last group may be short; None: one group
    per row), as one per weight column."""
    if group is None:
        return scale
    return scale.repeat_interleave(group, dim=-1)[..., :in_features]


def dequantize(weight: torch.Tensor, scale: torch.Tensor, group: int | None, dtype: torch.dtype) -> torch.Tensor:
    """``weight * scale`` in ``dtype``, for float8 ``[rows, in]`` and float32 ``[rows, groups]`` scales."""
    return (weight.float() * expand_scale(scale, weight.shape[-1], group)).to(dtype)


def quantize_input(x: torch.Tensor, scale: torch.Tensor | None = None, group: int | None = None) -> torch.Tensor:
    """``x`` through FP8 and back, in its own dtype: with a static per-tensor ``scale``, or dynamic scales per token
    (per ``group`` input features of each token when given; the last group may be short)."""
    width = x.shape[-1]
    if group is not None:  # zeros pad the last group: they change no maximum
        x = F.pad(x, (0, -width % group)).unflatten(-1, (-1, group))
    scale = _nonzero(x.abs().amax(dim=-1, keepdim=True) / FP8_MAX) if scale is None else scale.to(x.dtype)
    q = (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).to(x.dtype) * scale
    return q if group is None else q.flatten(-2)[..., :width]

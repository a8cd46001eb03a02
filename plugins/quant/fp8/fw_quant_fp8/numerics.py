"""8-bit numerics: rounding weights, widening them back, and the activation quantization of W8A8 schemes.

Everything follows compressed-tensors' reference formulas for symmetric 8-bit types: scale = absmax / (range / 2)
(448 for FP8 e4m3, 127.5 for int8; a zero scale becomes the dtype's eps), q = round(clamp(x / scale, lo, hi)),
and q * scale back. Weight scales are held in float32 as ``[rows, groups]`` (groups = 1 for channel and tensor
scales); widening computes ``q * scale`` in float32, which is exact for bf16 and float32 scales and then rounds
once to the target dtype, as the reference does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448


@dataclass(frozen=True)
class Element:
    """A symmetric 8-bit element type as compressed-tensors describes it (``type``, ``num_bits: 8``)."""

    dtype: torch.dtype
    type: str  # compressed-tensors' name: "float" or "int"
    lo: float
    hi: float

    def scale(self, amax: torch.Tensor) -> torch.Tensor:
        """The scale that maps ``amax`` to the edge of the range, in ``amax``'s dtype."""
        return _nonzero(amax / ((self.hi - self.lo) / 2))

    def round(self, scaled: torch.Tensor) -> torch.Tensor:
        """Values already divided by their scale, as this type (clamped first, as the reference does)."""
        scaled = scaled.clamp(self.lo, self.hi)
        return (scaled if self.type == "float" else scaled.round()).to(self.dtype)


E4M3 = Element(FP8, "float", -FP8_MAX, FP8_MAX)
INT8 = Element(torch.int8, "int", -128.0, 127.0)


def _nonzero(scale: torch.Tensor) -> torch.Tensor:
    return torch.where(scale == 0, torch.finfo(scale.dtype).eps, scale)


def quantize_rows(weight: torch.Tensor, element: Element = E4M3) -> tuple[torch.Tensor, torch.Tensor]:
    """Per output row: (``element`` ``[out, in]``, float32 scale ``[out, 1]``), weight ~ q * scale."""
    weight = weight.float()
    scale = element.scale(weight.abs().amax(dim=-1, keepdim=True))
    return element.round(weight / scale), scale


def expand_scale(scale: torch.Tensor, in_features: int, group: int | None) -> torch.Tensor:
    """``[rows, groups]`` scales, each for ``group`` input features (the last group may be short; None: one group
    per row), as one per weight column."""
    if group is None:
        return scale
    return scale.repeat_interleave(group, dim=-1)[..., :in_features]


def dequantize(weight: torch.Tensor, scale: torch.Tensor, group: int | None, dtype: torch.dtype) -> torch.Tensor:
    """``weight * scale`` in ``dtype``, for 8-bit ``[rows, in]`` and float32 ``[rows, groups]`` scales."""
    return (weight.float() * expand_scale(scale, weight.shape[-1], group)).to(dtype)


def quantize_input(x: torch.Tensor, scale: torch.Tensor | None = None, group: int | None = None,
                   element: Element = E4M3) -> torch.Tensor:
    """``x`` through ``element`` and back, in its own dtype: with a static per-tensor ``scale``, or dynamic scales
    per token (per ``group`` input features of each token when given; the last group may be short)."""
    width = x.shape[-1]
    if group is not None:  # zeros pad the last group: they change no maximum
        x = F.pad(x, (0, -width % group)).unflatten(-1, (-1, group))
    scale = element.scale(x.abs().amax(dim=-1, keepdim=True)) if scale is None else scale.to(x.dtype)
    q = element.round(x / scale).to(x.dtype) * scale
    return q if group is None else q.flatten(-2)[..., :width]

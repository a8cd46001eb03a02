"""Rotary position embeddings, neox style (rotate-half), as Hugging Face Llama applies them.

DeepSeek rotates interleaved pairs (x0, x1), (x2, x3), ... instead: with
``interleaved`` the input is de-interleaved first (evens, then odds) and
rotated the neox way, the same result as transformers' in that layout. Query
and key come out in the same layout, so their products are unchanged.

Inverse frequencies follow transformers' ``rope_type`` definitions (default,
linear, llama3, yarn) so that scaled-context checkpoints reproduce their
reference logits. cos/sin are computed on the fly from the step's positions:
for T tokens that is a [T, head_size / 2] outer product, cheaper than keeping
a table for every possible position.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from fw.sdk import native_ops

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def _base_inv_freq(head_size: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, head_size, 2, dtype=torch.float32) / head_size))


def _llama3(inv_freq: torch.Tensor, p: Mapping[str, Any]) -> torch.Tensor:
    # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_len = p["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


def _yarn(head_size: int, p: Mapping[str, Any], max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    theta = p["rope_theta"]
    old_len = p["original_max_position_embeddings"]
    factor = p.get("factor") or max_position_embeddings / old_len

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        if p.get("mscale") and p.get("mscale_all_dim"):
            attention_factor = mscale(factor, p["mscale"]) / mscale(factor, p["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)

    def correction_dim(rotations: float) -> float:
        # The dimension whose wavelength fits `rotations` times into the original context.
        return head_size * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(p.get("beta_fast") or 32), correction_dim(p.get("beta_slow") or 1)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_size - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_size // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, head_size, 2, dtype=torch.float32) / head_size)
    inv_freq = 1.0 / (factor * pos_freqs) * ramp + 1.0 / pos_freqs * (1 - ramp)
    return inv_freq, float(attention_factor)


def compute_inv_freq(
    head_size: int, rope_parameters: Mapping[str, Any], max_position_embeddings: int
) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [head_size / 2] float32, scale applied to cos and sin)."""
    rope_type = rope_parameters.get("rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope_type {rope_type!r} (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    if rope_type == "yarn":
        return _yarn(head_size, rope_parameters, max_position_embeddings)
    inv_freq = _base_inv_freq(head_size, rope_parameters["rope_theta"])
    if rope_type == "linear":
        inv_freq = inv_freq / rope_parameters["factor"]
    elif rope_type == "llama3":
        inv_freq = _llama3(inv_freq, rope_parameters)
    return inv_freq, 1.0


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(nn.Module):
    def __init__(
        self,
        head_size: int,
        rope_parameters: Mapping[str, Any],
        max_position_embeddings: int,
        *,
        interleaved: bool = False,
    ) -> None:
        super().__init__()
        self.interleaved = interleaved
        # A plain attribute rather than a buffer: model.to(dtype) must not round the frequencies.
        self.inv_freq, self.attention_scaling = compute_inv_freq(head_size, rope_parameters, max_position_embeddings)
        # Every layer of a step rotates by the same positions tensor (the model runner builds a new one per
        # step): the native path computes its cos/sin once per step, not once per layer.
        self._step: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q [T, heads, head_size] and k [T, kv_heads, head_size] by their token's position."""
        if self.interleaved:
            q = torch.cat((q[..., 0::2], q[..., 1::2]), dim=-1)
            k = torch.cat((k[..., 0::2], k[..., 1::2]), dim=-1)
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        if native_ops.usable(q) and q.stride(-2) == q.shape[-1] and k.stride(-2) == k.shape[-1]:
            if self._step is None or self._step[0] is not positions:
                freqs = positions.float()[:, None] * self.inv_freq
                scale = self.attention_scaling
                self._step = (positions, (freqs.cos() * scale).to(q.dtype), (freqs.sin() * scale).to(q.dtype))
            torch.ops.fw_layers.rotary_neox(q, k, self._step[1], self._step[2])  # in place
            return q, k
        freqs = positions.float()[:, None] * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)
        cos = (emb.cos() * self.attention_scaling).to(q.dtype)
        sin = (emb.sin() * self.attention_scaling).to(q.dtype)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin

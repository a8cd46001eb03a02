"""The KV-cache dtypes of ``--kv-cache-dtype``, as stored: quantize on write, dequantize on read.

Backends that keep the standard layout (``AttentionBackend.kv_cache_spec``)
store and read their cache with these functions; native kernels mirror ``read``.

- ``auto``: the model dtype, as is.
- ``fp8``: float8_e4m3fn holding K / k_scale and V / v_scale, one scale per
  layer (``AttentionLayerSpec``), saturated at the format's largest value.
- ``int8``: symmetric int8 with a float32 scale per token and head,
  absmax / 127 as llama.cpp's q8_0 cache. The scale is stored in the last four
  bytes of the head's row, so a block, scales included, is one slice of the
  cache.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from fw.sdk import native_ops

if TYPE_CHECKING:
    from fw.interfaces.attention import AttentionLayerSpec

FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
SCALE_BYTES = 4  # an int8 row's float32 scale


def storage(kv_cache_dtype: str, dtype: torch.dtype, row: int) -> tuple[torch.dtype, int]:
    """The element dtype of the cache and the length of one stored row of ``row`` values."""
    if kv_cache_dtype == "auto":
        return dtype, row
    if kv_cache_dtype == "fp8":
        return torch.float8_e4m3fn, row
    if kv_cache_dtype == "int8":
        if row % SCALE_BYTES:  # the scale is read as a float32 in place: it must be aligned
            raise ValueError(f"an int8 KV cache needs a head size divisible by {SCALE_BYTES}, got {row}")
        return torch.int8, row + SCALE_BYTES
    raise ValueError(f"unknown KV-cache dtype {kv_cache_dtype!r}")


def write(part: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, scale: float) -> None:
    """Store ``x`` [T, heads, head_size] at ``slots`` of one part (K or V) of a layer's cache.

    ``scale`` is the layer's per-tensor scale, used by fp8 only.
    """
    if part.dtype == torch.float8_e4m3fn:
        # Saturate explicitly (vLLM's rule): whether a plain cast saturates or overflows to NaN depends on the device.
        x = (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(part.dtype)
    elif part.dtype == torch.int8:
        x = x.float()
        step = x.abs().amax(-1, keepdim=True) / 127
        inverse = torch.where(step > 0, 1 / step, 0.0)  # an all-zero row stores zeros with scale 0
        values = (x * inverse).round_().clamp_(-127, 127).to(torch.int8)
        x = torch.cat([values, step.view(torch.int8)], dim=-1)
    part.view(-1, *part.shape[-2:])[slots] = x


def store_kv(cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             layer: AttentionLayerSpec) -> None:
    """Store a step's K and V at ``slots`` of a layer's standard-layout cache, with the layer's scales."""
    if (cache.dtype == k.dtype and cache.dim() == 5 and k.stride(-1) == v.stride(-1) == 1 and native_ops.usable(k)
            and cache.is_contiguous()):
        torch.ops.fw_layers.store_kv(cache, slots, k, v)  # the model dtype: one native copy for both
    else:
        write(cache[0], slots, k, layer.k_scale)
        write(cache[1], slots, v, layer.v_scale)


def write_kv(cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             layer: AttentionLayerSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """``store_kv``, returning the cache's K and V parts (the kernels read the new tokens from there). A decode
    step's two views cost more than its native store: a backend that does not read them calls ``store_kv``."""
    store_kv(cache, slots, k, v, layer)
    return cache[0], cache[1]


def read(part: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """The entries at ``slots`` (any shape) of one part, dequantized: [*slots.shape, heads, head_size] in ``dtype``."""
    rows = part.view(-1, *part.shape[-2:])[slots]
    if part.dtype == torch.float8_e4m3fn:
        return (rows.float() * scale).to(dtype)
    if part.dtype == torch.int8:
        step = rows[..., -SCALE_BYTES:].view(torch.float32)
        return (rows[..., :-SCALE_BYTES].float() * step).to(dtype)
    return rows.to(dtype)

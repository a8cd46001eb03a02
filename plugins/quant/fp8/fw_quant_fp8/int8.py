"""The int8 quant method: the fp8 method's 8-bit linear layers and experts with integer elements
(``numerics.INT8``), and their products.

- Weight-only (W8A16; ``--quant int8`` by default): operation ``int8.linear``, the fp8 method's widening product
  (``fw`` widens each int8 in registers) with its ``torch`` / ``torch-fp32`` candidates.
- W8A8 (the checkpoint's ``input_activations``, or ``quant.activations=dynamic``): operation ``int8.linear.a8``.
  ``fw`` (``csrc/w8a8.cpp``, CPU) rounds each activation row to int8 as compressed-tensors does and multiplies in
  integers, widening the bytes to int16 pairs; ``fw-vnni`` (the same file, where the CPU has AVX-512 VNNI)
  multiplies the bytes themselves, with each weight row's sum kept beside the weight (its layout); ``fw-amx``
  (where the CPU has AMX-INT8 and Linux grants it) multiplies 16 weight rows by up to 32 activation rows a tile
  instruction, reading the weight as it is (N a multiple of 16, K of 64); all three give equal outputs. The other candidates are the weight-only ones on activations rounded by the reference formula
  (through int8 and back), which every other device runs. Activation scales per group of input features, and block
  weight scales, round first and go through ``int8.linear``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from fw.sdk import kernels, native
from fw_quant_fp8.method import (
    Fp8Method,
    W8A8Rows,
    as_bits,
    bf16_pairs,
    has_amx,
    has_bf16_pairs,
    has_tiles,
    logits_product,
    native_bf16,
    tile_product,
    w8a8_product,
    widening_product,
)
from fw_quant_fp8.numerics import INT8

_SOURCE = Path(__file__).parent / "csrc" / "w8a8.cpp"


def _native(w: W8A8Rows, x: torch.Tensor, bias: torch.Tensor | None = None, kernel: str = "w8a8_gemv") -> torch.Tensor:
    """The kernels return x's dtype with the bias added, rounded as ``.to(x.dtype) + bias`` would."""
    rows = x.numel() // x.shape[-1]
    out = getattr(torch.ops.fw_quant_int8, kernel)(x.reshape(rows, x.shape[-1]), w.weight, w.scale, w.input_scale,
                                                   bias)
    return out.view(*x.shape[:-1], out.shape[-1])


@dataclass(frozen=True)
class _SummedRows:
    """W8A8 rows and each weight row's sum (int32): VNNI multiplies unsigned activation bytes (q + 128) by the
    signed weights, and 128 times a row's sum comes off its dot product."""

    rows: W8A8Rows
    sums: torch.Tensor


def _vnni(state: _SummedRows, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    w = state.rows
    rows = x.numel() // x.shape[-1]
    out = torch.ops.fw_quant_int8.w8a8_gemv_vnni(x.reshape(rows, x.shape[-1]), w.weight, w.scale, w.input_scale,
                                                 bias, state.sums)
    return out.view(*x.shape[:-1], out.shape[-1])


def _native_supports(key: tuple) -> bool:
    return key[4] == "cpu" and key[3] in ("float32", "bfloat16") and native.load("fw_quant_int8", _SOURCE)


WEIGHT_ONLY = widening_product("int8.linear", "int8_gemv")
WEIGHT_ONLY.register(kernels.Candidate("fw-bf16", partial(native_bf16, True), as_bits, "bits", has_bf16_pairs))
WEIGHT_ONLY.register(kernels.Candidate(
    "fw-tiles", partial(tile_product, "gemm_bf16", True), as_bits, "bits", has_tiles))
WEIGHT_ONLY.register(kernels.Candidate("fw-amx", partial(tile_product, "gemm_amx", True), as_bits, "bits", has_amx))
LOGITS = logits_product("int8.logits", "int8_gemv")
LOGITS.register(kernels.Candidate("fw-bf16", partial(bf16_pairs, True), as_bits, "bits", has_bf16_pairs))
W8A8 = w8a8_product("int8.linear.a8", WEIGHT_ONLY, INT8, (
    kernels.Candidate("fw", _native, supports=_native_supports),
    kernels.Candidate("fw-vnni", _vnni, prepare=lambda w: _SummedRows(w, w.weight.sum(1, dtype=torch.int32)),
                      layout="row-sums", supports=lambda key: _native_supports(key)
                      and torch.ops.fw_quant_int8.has_vnni() and key[1] < 65536),
    kernels.Candidate("fw-amx", lambda w, x, bias=None: _native(w, x, bias, "w8a8_gemm_amx"),
                      supports=lambda key: _native_supports(key) and key[0] % 16 == 0 and key[1] % 64 == 0
                      and key[1] < 65536 and torch.ops.fw_quant_int8.amx_supported()),
))


class Int8Method(Fp8Method):
    element = INT8
    weight_only = WEIGHT_ONLY
    logits = LOGITS
    w8a8 = W8A8

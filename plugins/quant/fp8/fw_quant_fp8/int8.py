"""The int8 quant method: the fp8 method's 8-bit linear layers and experts with integer elements
(``numerics.INT8``), and their products.

- Weight-only (W8A16; ``--quant int8`` by default): operation ``int8.linear``, the fp8 method's widening product
  (``fw`` widens each int8 in registers) with its ``torch`` / ``torch-fp32`` candidates.
- W8A8 (the checkpoint's ``input_activations``, or ``quant.activations=dynamic``): operation ``int8.linear.a8``.
  ``fw`` (``csrc/w8a8.cpp``, CPU) rounds each activation row to int8 as compressed-tensors does and multiplies in
  integers; the other candidates are the weight-only ones on activations rounded by the reference formula
  (through int8 and back), which every other device runs. Activation scales per group of input features, and block
  weight scales, round first and go through ``int8.linear``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from fw.sdk import kernels, native
from fw_quant_fp8.method import Fp8Method, W8A8Rows, w8a8_product, widening_product
from fw_quant_fp8.numerics import INT8

_SOURCE = Path(__file__).parent / "csrc" / "w8a8.cpp"


def _native(w: W8A8Rows, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    rows = x.numel() // x.shape[-1]
    out = torch.ops.fw_quant_int8.w8a8_gemv(x.reshape(rows, x.shape[-1]), w.weight, w.scale, w.input_scale)
    out = out.view(*x.shape[:-1], out.shape[-1]).to(x.dtype)
    return out if bias is None else out + bias


WEIGHT_ONLY = widening_product("int8.linear", "int8_gemv")
W8A8 = w8a8_product("int8.linear.a8", WEIGHT_ONLY, INT8, (kernels.Candidate(
    "fw", _native, supports=lambda key: key[4] == "cpu" and key[3] in ("float32", "bfloat16")
    and native.load("fw_quant_int8", _SOURCE)),))


class Int8Method(Fp8Method):
    element = INT8
    weight_only = WEIGHT_ONLY
    w8a8 = W8A8

"""INT8 layers: fw-quant-fp8's 8-bit linear layers and experts with integer elements (``numerics.INT8``), and their
products.

- Weight-only (W8A16; ``--quant int8`` by default): operation ``int8.linear``, the widening product of fw-quant-fp8
  (``fw`` widens each int8 in registers) with its ``torch`` / ``torch-fp32`` candidates.
- W8A8 (the checkpoint's ``input_activations``, or ``quant.activations=dynamic``): operation ``int8.linear.a8``.
  ``fw`` (``csrc/w8a8.cpp``, CPU) rounds each activation row to int8 as compressed-tensors does and multiplies in
  integers; ``torch`` / ``torch-fp32`` are the reference formula (activations through int8 and back, then a float
  product), which every other device runs. Activation scales per group of input features, and block weight
  scales, use the formula too.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from fw import kernels, native
from fw_quant_fp8.method import Fp8Method, Product, QuantizedRows, product_in, select_product, widening_product
from fw_quant_fp8.numerics import INT8, quantize_input
from fw_quant_fp8.scheme import Scheme

_SOURCE = Path(__file__).parent / "csrc" / "w8a8.cpp"

WEIGHT_ONLY = widening_product("int8.linear", "int8_gemv")


@dataclass(frozen=True)
class W8A8Rows(QuantizedRows):
    input_scale: torch.Tensor | None = None  # a static activation scale; None: one per token


def _native(w: W8A8Rows, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    rows = x.numel() // x.shape[-1]
    out = torch.ops.fw_quant_int8.w8a8_gemv(x.reshape(rows, x.shape[-1]), w.weight, w.scale, w.input_scale)
    out = out.view(*x.shape[:-1], out.shape[-1]).to(x.dtype)
    return out if bias is None else out + bias


def _formula(w: W8A8Rows, x: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    return product_in(w, quantize_input(x, w.input_scale, None, INT8), bias, dtype)


W8A8 = kernels.Operation("int8.linear.a8", reference="torch")
W8A8.register(kernels.Candidate(
    "fw", _native, supports=lambda key: key[4] == "cpu" and key[3] in ("float32", "bfloat16")
    and native.load("fw_quant_int8", _SOURCE)))
W8A8.register(kernels.Candidate("torch", lambda w, x, bias=None: _formula(w, x, bias, x.dtype)))
W8A8.register(kernels.Candidate(
    "torch-fp32", lambda w, x, bias=None: _formula(w, x, bias, torch.float32).to(x.dtype),
    supports=lambda key: key[3] == "bfloat16"))


class Int8Method(Fp8Method):
    element = INT8
    weight_only = WEIGHT_ONLY

    def product(self, w: QuantizedRows, scheme: Scheme, input_scale: torch.Tensor | None,
                dtype: torch.dtype) -> Product:
        if scheme.activations == "none" or scheme.activation_group or w.group:
            return super().product(w, scheme, input_scale, dtype)
        return select_product(W8A8, W8A8Rows(w.weight, w.scale, None, input_scale), dtype)

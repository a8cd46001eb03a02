"""8-bit linear layers (FP8 here; the int8 method, ``fw_quant_fp8.int8``, reuses them for INT8): the weight stays
8-bit in memory and is widened inside the product.

Parameters are named after the checkpoint tensors' leaves: ``weight`` (8-bit ``[out, in]``; the float weight of
a plain checkpoint, quantized once loaded), the weight scale (``weight_scale`` / ``weight_scale_inv``) and, for
static activation scales, ``input_scale``. Every weight scale is held as float32 ``[out, groups]``, one row per
output row: a per-tensor scale of a fused sub-matrix (q, k, v) is repeated over its rows and a block scale over
its block's rows, so fused layers keep each sub-matrix's exact numerics. ``input_scale`` keeps one scale per
sub-matrix; where they differ, each sub-matrix's rows see their own quantization of the input, as in the
reference, which quantizes the input of each checkpoint module separately.

FP8 products (``fw.sdk.kernels`` operation ``fp8.linear``, chosen per CPU, shape and row count by timing): ``torch``
widens the weight into the activation dtype and multiplies, ``torch-fp32`` into float32 (bf16 GEMMs are several
times slower on CPUs without bf16 arithmetic), ``fw`` (``csrc/gemv.cpp``, CPU) widens each weight in registers
as it reads it, at one byte a weight: the decode-sized choice, and ``triton`` (CUDA, ``triton_gemm``) widens
tiles, block scales included. The torch candidates widen a chunk of rows at a time, so the float temporaries stay
small. W8A8 schemes round the input first (``numerics.quantize_input``): operation ``fp8.linear.a8`` for scales per
token or static ones, whose candidates are those above on rounded activations and, on CUDA GPUs with FP8 tensor
cores, ``torch._scaled_mm``; per-group activation scales go through ``fp8.linear`` after rounding.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fw.interfaces.quant import LinearMethod, LinearSpec, MoEMethod, MoESpec, QuantMethod
from fw.sdk import dense, kernels, native
from fw.sdk.errors import ModelLoadError
from fw.sdk.linear import UnquantizedLinearMethod
from fw.sdk.moe import UnquantizedMoEMethod
from fw_quant_fp8.numerics import E4M3, Element, dequantize, quantize_input, quantize_rows
from fw_quant_fp8.scheme import Scheme, Schemes

_SOURCE = Path(__file__).parent / "csrc" / "gemv.cpp"


def new_param(shape: tuple[int, ...], dtype: torch.dtype, output_dim: int | None, input_dim: int | None) -> nn.Parameter:
    param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    param.output_dim, param.input_dim = output_dim, input_dim
    return param


def check_blocks(scheme: Scheme, in_features: int, split: bool, what: str) -> None:
    group = scheme.group()
    if group and split and in_features % group:
        raise ModelLoadError(f"{what}: this rank's {in_features} input features are not whole {group}-wide "
                             "scale blocks; use a tensor-parallel size that splits them on block boundaries")


def load_scale(scheme: Scheme, place: Callable[..., None], rows_needed: Callable[[Any], int],
               param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
    """A checkpoint weight scale as float32 rows ``[rows, groups]`` of its sub-matrix, placed by the layer's own
    loader (``place``) like the weight's rows. ``rows_needed(shard_id)``: how many of the sub-matrix's rows that
    loader reads (up to the end of this rank's slice)."""
    loaded = loaded.float()
    if scheme.weights == "tensor":
        rows = loaded.reshape(1, 1).expand(rows_needed(shard_id), 1)
    elif scheme.weights == "channel":
        rows = loaded.reshape(-1, 1)
    else:
        rows = loaded.repeat_interleave(scheme.block[0], dim=0)[: rows_needed(shard_id)]
    place(param, rows, shard_id)


@dataclass(frozen=True)
class QuantizedRows:
    """Rows of a layer's weight as its kernels read them."""

    weight: torch.Tensor  # 8-bit [rows, in]
    scale: torch.Tensor  # float32 [rows, groups]
    group: int | None  # input features per scale; None: one per row


def product_in(w: QuantizedRows, x: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    x = x.to(dtype)
    step = max(1, dense.WIDEN_CHUNK // w.weight.shape[1])
    parts = [F.linear(x, dequantize(w.weight[i : i + step], w.scale[i : i + step], w.group, dtype))
             for i in range(0, w.weight.shape[0], step)]
    out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
    return out if bias is None else out + bias.to(dtype)


def _native(kernel: str, w: QuantizedRows, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    rows = x.numel() // x.shape[-1]
    group = w.group or w.weight.shape[1]
    out = getattr(torch.ops.fw_quant_fp8, kernel)(x.reshape(rows, x.shape[-1]), w.weight, w.scale, group)
    out = out.view(*x.shape[:-1], out.shape[-1]).to(x.dtype)
    return out if bias is None else out + bias


def _triton(w: QuantizedRows, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    from fw_quant_fp8.triton_gemm import gemm8

    out = gemm8(x.reshape(-1, x.shape[-1]), w.weight, w.scale, w.group).view(*x.shape[:-1], w.weight.shape[0])
    return out if bias is None else out + bias


def as_bits(w: QuantizedRows) -> QuantizedRows:
    """The native kernels' state: the weight's bytes as uint8, viewed once at load (the step's tracer cannot
    record a view of a float8 tensor as another dtype)."""
    return dataclasses.replace(w, weight=w.weight.view(torch.uint8))


def native_supports(key: tuple) -> bool:
    """The ``fw`` candidates' condition: a CPU weight and the kernels built (``key[4]``: the weight's device)."""
    return key[4] == "cpu" and native.load("fw_quant_fp8", _SOURCE)


def widening_product(name: str, kernel: str) -> kernels.Operation:
    """The operation of a weight-only product with ``kernel`` (``csrc/gemv.cpp``) as its native candidate."""
    op = kernels.Operation(name, reference="torch")
    op.register(kernels.Candidate("fw", partial(_native, kernel), as_bits, "bits", native_supports))
    op.register(kernels.Candidate("torch", lambda w, x, bias=None: product_in(w, x, bias, x.dtype)))
    op.register(kernels.Candidate(
        "torch-fp32", lambda w, x, bias=None: product_in(w, x, bias, torch.float32).to(x.dtype),
        supports=lambda key: key[3] == "bfloat16"))
    op.register(kernels.Candidate(
        "triton", _triton, supports=lambda key: key[4] == "cuda" and kernels.importable("triton")))
    return op


@dataclass(frozen=True)
class W8A8Rows(QuantizedRows):
    """Rows whose product first rounds the activations to the weight's element type, with a scale per token or the
    static ``input_scale``."""

    input_scale: torch.Tensor | None = None


def w8a8_product(name: str, weight_only: kernels.Operation, element: Element,
                 own: tuple[kernels.Candidate, ...]) -> kernels.Operation:
    """The operation of a W8A8 product: the ``own`` candidates (which take unrounded activations), and every
    other candidate of ``weight_only`` after rounding the activations as the reference does."""
    op = kernels.Operation(name, reference="torch")
    for candidate in own:
        op.register(candidate)
    for c in weight_only.candidates.values():
        if c.name not in op.candidates:
            op.register(kernels.Candidate(
                c.name,
                lambda w, x, bias=None, run=c.run: run(w, quantize_input(x, w.input_scale, None, element), bias),
                c.prepare, c.layout, c.supports))
    return op


def _scaled_mm(w: W8A8Rows, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    if w.input_scale is None:
        scale = E4M3.scale(rows.abs().amax(dim=-1, keepdim=True))
    else:
        scale = w.input_scale.to(x.dtype).reshape(1, 1).expand(rows.shape[0], 1)
    q = E4M3.round(rows / scale)
    out = torch._scaled_mm(q, w.weight.t(), scale_a=scale.float().contiguous(), scale_b=w.scale.reshape(1, -1),
                           out_dtype=x.dtype).view(*x.shape[:-1], w.weight.shape[0])
    return out if bias is None else out + bias


def _has_fp8_matmul(key: tuple) -> bool:
    """CUDA FP8 tensor cores (compute capability 8.9+) and the sizes ``torch._scaled_mm`` takes (multiples of 16)."""
    rows, width, group, _, device = key
    return (device == "cuda" and group is None and rows % 16 == 0 and width % 16 == 0
            and torch.cuda.get_device_capability() >= (8, 9))


def bf16_pairs(int8: bool, w: QuantizedRows, x: torch.Tensor, bias: torch.Tensor | None = None,
               float_out: bool = True) -> torch.Tensor:
    """Products of bf16 activations with FP8 (or int8) rows in bf16 pairs (AVX-512 BF16; csrc/gemv.cpp says why
    that is exact but for the order of the sums), a scale per row only: float32, or bf16 with the bias added."""
    rows = x.numel() // x.shape[-1]
    out = torch.ops.fw_quant_fp8.gemv_bf16(x.reshape(rows, x.shape[-1]), w.weight, w.scale, bias, float_out, int8)
    return out.view(*x.shape[:-1], out.shape[-1])


def native_bf16(int8: bool, w: QuantizedRows, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return bf16_pairs(int8, w, x, bias, float_out=False)


def has_bf16_pairs(key: tuple) -> bool:
    return key[2] is None and key[3] == "bfloat16" and native_supports(key) and torch.ops.fw_quant_fp8.has_bf16_dot()


def logits_product(name: str, kernel: str) -> kernels.Operation:
    """The operation of a weight-only LM head: float32 logits from hidden states in the model's dtype, never
    rounded to it (``fw`` widens the weights in registers against float32 activations)."""
    op = kernels.Operation(name, reference="torch")
    op.register(kernels.Candidate("fw", lambda w, x: _native(kernel, w, x.float()), as_bits, "bits", native_supports))
    op.register(kernels.Candidate("torch", lambda w, x: product_in(w, x, None, torch.float32)))
    return op


def tile_product(kernel: str, int8: bool, w: QuantizedRows, x: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """bf16 activations times FP8 (or int8) rows widened, exactly, into bf16 tiles a few rows at a time, for
    prefill-sized products, a scale per row only: ``gemm_bf16`` (fw's dense AVX512-BF16 tiles) or ``gemm_amx``."""
    rows = x.numel() // x.shape[-1]
    out = getattr(torch.ops.fw_quant_fp8, kernel)(x.reshape(rows, x.shape[-1]), w.weight, w.scale, bias, int8)
    return out.view(*x.shape[:-1], out.shape[-1])


def has_tiles(key: tuple) -> bool:
    """bf16 tiles for prefill-sized products: the bf16-pair conditions, 16 output rows and 64 input features at a
    time."""
    return has_bf16_pairs(key) and key[0] % 16 == 0 and key[1] % 64 == 0


def has_amx(key: tuple) -> bool:
    return has_tiles(key) and torch.ops.fw_quant_fp8.amx_supported()


PRODUCT = widening_product("fp8.linear", "fp8_gemv")
PRODUCT.register(kernels.Candidate("fw-bf16", partial(native_bf16, False), as_bits, "bits", has_bf16_pairs))
PRODUCT.register(kernels.Candidate("fw-tiles", partial(tile_product, "gemm_bf16", False), as_bits, "bits", has_tiles))
PRODUCT.register(kernels.Candidate("fw-amx", partial(tile_product, "gemm_amx", False), as_bits, "bits", has_amx))
LOGITS = logits_product("fp8.logits", "fp8_gemv")
LOGITS.register(kernels.Candidate("fw-bf16", partial(bf16_pairs, False), as_bits, "bits", has_bf16_pairs))
# W8A8 with a scale per token or a static one (no groups): the widening products on rounded activations, and
# torch._scaled_mm's FP8 GEMM where the GPU has one.
W8A8 = w8a8_product("fp8.linear.a8", PRODUCT, E4M3,
                    (kernels.Candidate("scaled-mm", _scaled_mm, supports=_has_fp8_matmul),))


def select_product(op: kernels.Operation, w: QuantizedRows, dtype: torch.dtype) -> kernels.Selection:
    rows, width = w.weight.shape
    key = (rows, width, w.group, str(dtype).removeprefix("torch."), w.weight.device.type)
    return op.select(key, w, lambda n: (torch.randn(n, width, dtype=dtype, device=w.weight.device),))


Product = Callable[..., torch.Tensor]  # (x, bias=None) -> x times the rows' weight


class Fp8LinearMethod(LinearMethod):
    def __init__(self, scheme: Scheme, method: Fp8Method) -> None:
        self.scheme, self.method = scheme, method

    def create_weights(self, layer: nn.Module, spec: LinearSpec) -> None:
        scheme, rows, width = self.scheme, sum(spec.output_sizes), spec.input_size
        self.sizes, self.dtype = spec.output_sizes, spec.params_dtype
        dtype = spec.params_dtype if scheme.online else self.method.element.dtype
        layer.register_parameter("weight", new_param((rows, width), dtype, 0, 1))
        if scheme.online:
            return
        check_blocks(scheme, width, spec.input_is_parallel and spec.tp_size > 1, spec.prefix)
        group = scheme.group()
        scale = new_param((rows, -(-width // group) if group else 1), torch.float32, 0, 1 if group else None)

        def rows_needed(shard_id: Any) -> int:
            idx = spec.shard_index(shard_id)
            size = spec.output_sizes[idx]
            return (spec.shard_rank(idx) + 1) * size if spec.output_is_parallel else size

        scale.weight_loader = partial(load_scale, scheme, layer.weight_loader, rows_needed)
        layer.register_parameter(scheme.scale_name, scale)
        if scheme.input_scales:
            input_scale = new_param((len(spec.output_sizes),), torch.float32, None, None)
            input_scale.weight_loader = lambda p, t, shard_id=None: p.data[spec.shard_index(shard_id)].copy_(
                t.reshape(()))
            layer.register_parameter("input_scale", input_scale)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        scheme = self.scheme
        if scheme.online:
            weight, scale = quantize_rows(layer.weight, self.method.element)
            del layer.weight
            layer.register_buffer("weight", weight, persistent=False)
            layer.register_buffer("weight_scale", scale, persistent=False)
        else:
            weight, scale = layer.weight.data, getattr(layer, scheme.scale_name).data
        # Runs of adjacent sub-matrices that quantize the input alike: one product each.
        statics = layer.input_scale.tolist() if scheme.activations == "static" else [None] * len(self.sizes)
        runs: list[list[Any]] = []  # [first row, end row, input scale]
        start = 0
        for size, input_scale in zip(self.sizes, statics, strict=True):
            if runs and runs[-1][2] == input_scale:
                runs[-1][1] += size
            else:
                runs.append([start, start + size, input_scale])
            start += size
        self.runs = [
            (slice(lo, hi), self.method.product(QuantizedRows(weight[lo:hi], scale[lo:hi], scheme.group()), scheme,
                                                None if s is None else torch.tensor(s, device=weight.device),
                                                self.dtype))
            for lo, hi, s in runs
        ]

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        outs = [product(x, None if bias is None else bias[rows]) for rows, product in self.runs]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)


class Fp8Method(QuantMethod):
    element = E4M3
    weight_only = PRODUCT  # the operation of weight-only products
    logits = LOGITS  # and of a weight-only LM head
    w8a8 = W8A8  # and of products with activations rounded per token or by a static scale

    def __init__(self, options: Any = None, quant_config: dict[str, Any] | None = None) -> None:
        super().__init__(options, quant_config)
        activations = options.activations if options is not None else "auto"
        self.schemes = Schemes(self.quant_config, activations, self.element,
                               options.layers if options is not None else "all")

    def product(self, w: QuantizedRows, scheme: Scheme, input_scale: torch.Tensor | None,
                dtype: torch.dtype) -> Product:
        """The product of activations in ``dtype`` with ``w``, quantizing them first as ``scheme`` says (with the
        static ``input_scale`` of these rows, if any)."""
        if scheme.activations != "none" and scheme.activation_group is None and w.group is None:
            return select_product(self.w8a8, W8A8Rows(w.weight, w.scale, None, input_scale), dtype)
        selected = select_product(self.weight_only, w, dtype)
        if scheme.activations == "none":
            return selected
        group = scheme.activation_group if input_scale is None else None
        return lambda x, bias=None: selected(quantize_input(x, input_scale, group, self.element), bias)

    def get_logits_method(self, weight: torch.Tensor) -> Product | None:
        if self.options is None or not (self.options.lm_head or self.options.layers == "lm_head"):
            return None
        rows = QuantizedRows(*quantize_rows(weight, self.element), None)
        if self.options.activations != "dynamic":  # weight-only, as the layers are unless every one rounds its input
            return select_product(self.logits, rows, weight.dtype)
        product = self.product(rows, Scheme("channel", "dynamic"), None, torch.float32)
        return lambda hidden: product(hidden.float())

    def get_linear_method(self, spec: LinearSpec) -> LinearMethod:
        scheme = self.schemes.common(spec.checkpoint_names, spec.prefix)
        return UnquantizedLinearMethod() if scheme is None else Fp8LinearMethod(scheme, self)

    def get_moe_method(self, spec: MoESpec) -> MoEMethod:
        from fw_quant_fp8.moe import Fp8MoEMethod

        names = tuple(f"{spec.checkpoint_prefix}.{e}.{p}" for e in range(spec.num_experts) for p in spec.projections)
        scheme = self.schemes.common(names, spec.prefix)
        return UnquantizedMoEMethod() if scheme is None else Fp8MoEMethod(scheme, self.element)

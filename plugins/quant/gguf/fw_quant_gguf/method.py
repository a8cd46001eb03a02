"""The GGUF quant method: linear layers over ggml blocks (the file itself is read by ``fw_quant_gguf.format``).

Packed weights. A quantized linear layer keeps one flat uint8 parameter, ``weight``: the ggml blocks
of each fused sub-matrix (q, k, v or gate, up), one after the other, each as ``[rows, row_bytes]``
in the file's row-major order. Sub-matrices of one layer may have different types (llama.cpp's
``*_K_M`` mixes put v in Q6_K next to q and k in Q4_K); the layout is fixed when the layer is built,
from the ggml types that the checkpoint config's ``quantization_config["tensor_types"]`` lists per
Hugging Face tensor name.

Products (``fw.sdk.kernels`` operation ``gguf.linear``, chosen per CPU, shape and row count by timing):
``torch`` dequantizes the blocks into the activation dtype and multiplies, ``torch-fp32`` into float32
(bf16 GEMMs are several times slower on CPUs without bf16 arithmetic), ``fw-dequant`` is ``torch`` with the
blocks decoded natively (several times faster than the torch ops, the same values), and ``fw`` is a native
kernel that decodes each block as it reads it (in registers for Q4_0/Q4_1/Q8_0 and Q4_K, and Q5_K with
AVX-512; Q6_K, and Q5_K without AVX-512, through a super-block of bytes; through a block of floats in L1 for
the other types): it wins at decode sizes, while prefill-sized inputs amortize one dequantization into a dense
product better.
With the plugin's option ``activations=int8`` products of Q4_0/Q4_1/Q8_0 blocks on the CPU are
operation ``gguf.linear.a8``: each block of 32 activation values is rounded to int8 with its own scale first,
as llama.cpp does, and ``fw`` multiplies bytes (exact in int32); its ``torch`` reference emulates that rounding.
Layers whose weights are all plain floats (F32/F16/BF16), and every layer with ``dequantize=True``,
hold a dense ``[out, in]`` weight instead, filled by dequantizing each tensor as it is loaded.

Tensor parallelism: blocks run along the input dimension, so a rank's output rows are whole rows of
blocks, and a row-parallel layer's input split is a byte range of every row as long as it falls on a
block boundary (checked when the layer is built).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from itertools import groupby
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from torch import nn

from fw.interfaces.quant import LinearMethod, LinearSpec, QuantMethod
from fw.sdk import dense, kernels, native
from fw.sdk.errors import ModelLoadError
from fw.sdk.linear import int_block_rounded, load_linear_shard
from fw.sdk.weights import check_shape
from fw_quant_gguf.dequant import FLOAT_TYPES, SUPPORTED_TYPES, dequantize, row_bytes
from fw_quant_gguf.spec import GGUFOptions

# The types the native kernels (csrc/gemv.cpp) decode, and those of them with integer-activation kernels.
_NATIVE_TYPES = frozenset(t for t in SUPPORTED_TYPES if t not in FLOAT_TYPES)
_INT_TYPES = frozenset({GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0})
_SOURCE = Path(__file__).parent / "csrc" / "gemv.cpp"


@dataclass(frozen=True)
class _Shard:
    """One sub-matrix's blocks within the flat ``weight``: ``rows`` rows of ``row_bytes``, from byte ``offset``."""

    qtype: GGMLQuantizationType
    offset: int
    rows: int
    row_bytes: int

    @property
    def nbytes(self) -> int:
        return self.rows * self.row_bytes


class GGUFLinearMethod(LinearMethod):
    """One linear layer whose sub-matrices have the ggml types ``shard_types``."""

    def __init__(self, shard_types: list[GGMLQuantizationType], dequantize_at_load: bool,
                 int8_activations: bool = False) -> None:
        self.shard_types = shard_types
        self.int8_activations = int8_activations
        self.dense = dequantize_at_load or all(t in FLOAT_TYPES for t in shard_types)
        self.shards: list[_Shard] = []
        # What apply() dequantizes at a time: rows of adjacent shards of one type, at most dense.WIDEN_CHUNK weights.
        self.chunks: list[_Shard] = []

    def create_weights(self, layer: nn.Module, spec: LinearSpec) -> None:
        input_size, params_dtype = spec.input_size, spec.params_dtype
        self.input_size, self.params_dtype = input_size, params_dtype  # what the kernels are timed on
        if self.dense:
            weight = nn.Parameter(
                torch.empty(sum(spec.output_sizes), input_size, dtype=params_dtype), requires_grad=False
            )
            weight.output_dim, weight.input_dim = 0, 1
            weight.weight_loader = partial(self._load_dense, spec)
        else:
            offset = 0
            for qtype, rows in zip(self.shard_types, spec.output_sizes, strict=True):
                try:
                    width = row_bytes(qtype, input_size)
                except ValueError as exc:
                    split = " (the tensor-parallel split of its input features must fall on block boundaries)"
                    raise ModelLoadError(f"{spec.prefix}: {exc}{split if spec.input_is_parallel else ''}") from None
                self.shards.append(_Shard(qtype, offset, rows, width))
                offset += rows * width
            self.chunks, self.native_shards = _layout(self.shards, input_size)
            weight = nn.Parameter(torch.empty(offset, dtype=torch.uint8), requires_grad=False)
            # Sharded and placed by _load_packed itself: the generic loader cannot cut a flat mix of layouts.
            weight.output_dim = weight.input_dim = None
            weight.weight_loader = partial(self._load_packed, spec)
        layer.register_parameter("weight", weight)

    def _load_dense(self, spec: LinearSpec, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        qtype = self.shard_types[spec.shard_index(shard_id)]
        load_linear_shard(spec, param, dequantize(loaded.to(param.device), qtype, param.dtype), shard_id)

    def _load_packed(self, spec: LinearSpec, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        idx = spec.shard_index(shard_id)
        shard = self.shards[idx]
        if spec.output_is_parallel:
            loaded = loaded.narrow(0, spec.shard_rank(idx) * shard.rows, shard.rows)
        if spec.input_is_parallel:
            loaded = loaded.narrow(1, spec.tp_rank * shard.row_bytes, shard.row_bytes)
        check_shape((shard.rows, shard.row_bytes), loaded, f"{spec.prefix}, shard {shard_id}, {shard.qtype.name}")
        param.data[shard.offset : shard.offset + shard.nbytes].view(shard.rows, shard.row_bytes).copy_(loaded)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if self.dense:
            dense.pack_parameter(layer)
            return
        self.kernel = _select(layer.weight, self.shards, self.chunks, self.native_shards, self.input_size,
                              self.params_dtype, self.int8_activations)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.dense:
            return dense.linear(x, layer.weight, bias)
        return self.kernel(x, bias)


def _layout(shards: list[_Shard], input_size: int) -> tuple[list[_Shard], list[int]]:
    """What the torch candidates dequantize at a time (rows of adjacent shards of one type, at most
    dense.WIDEN_CHUNK weights), and the native kernel's (byte offset, rows, ggml type) per sub-matrix."""
    chunks, step = [], max(1, dense.WIDEN_CHUNK // input_size)
    for qtype, group in groupby(shards, key=lambda s: s.qtype):
        group = list(group)
        rows, width = sum(s.rows for s in group), group[0].row_bytes
        for start in range(0, rows, step):
            count = min(step, rows - start)
            chunks.append(_Shard(qtype, group[0].offset + start * width, count, width))
    return chunks, [v for s in shards for v in (s.offset, s.rows, int(s.qtype))]


def _select(data: torch.Tensor, shards: list[_Shard], chunks: list[_Shard], native_shards: list[int],
            width: int, dtype: torch.dtype, int8_activations: bool) -> kernels.Selection:
    """The layer's product: with int8 activations where the integer kernels' types are on the CPU (the only
    products they speed up), else with the activations as they are."""
    key = (tuple((s.qtype.name, s.rows) for s in shards), width, str(dtype).removeprefix("torch."), data.device.type)
    a8 = int8_activations and data.device.type == "cpu" and all(s.qtype in _INT_TYPES for s in shards)
    return (PRODUCT_A8 if a8 else PRODUCT).select(key, _Blocks(data, chunks, native_shards),
                                                  lambda rows: (torch.randn(rows, width, dtype=dtype),))


def quantize_q8_0(weight: torch.Tensor) -> torch.Tensor:
    """float ``[rows, 32k]`` -> Q8_0 blocks ``[rows, k * 34]``, as ggml quantizes: d = max|w| / 127 (fp16),
    q = round(w / d)."""
    rows, width = weight.shape
    w = weight.float().reshape(rows, width // 32, 32)
    d = (w.abs().amax(-1, keepdim=True) / 127).half()
    inv = torch.where(d != 0, 1 / d.float(), 0.0)
    q = (w * inv).round().clamp(-127, 127).to(torch.int8)
    return torch.cat([d.view(torch.uint8), q.view(torch.uint8)], dim=-1).reshape(rows, -1)


@dataclass(frozen=True)
class _Blocks:
    """A quantized layer's weight as its kernels read it."""

    data: torch.Tensor  # the flat uint8 blocks
    chunks: list[_Shard]
    native_shards: list[int]


def _dequantized(blocks: _Blocks, x: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype,
                 decode: Callable[..., torch.Tensor] = dequantize,
                 product: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.linear) -> torch.Tensor:
    def weight(c: _Shard) -> torch.Tensor:
        return decode(blocks.data[c.offset : c.offset + c.nbytes].view(c.rows, c.row_bytes), c.qtype, dtype)

    x = x.to(dtype)
    if len(blocks.chunks) == 1:
        out = product(x, weight(blocks.chunks[0]))
    else:
        out = torch.cat([product(x, weight(c)) for c in blocks.chunks], dim=-1)
    return out if bias is None else out + bias.to(dtype)


def _run_native(op: Callable[..., torch.Tensor], blocks: _Blocks, x: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
    # 2-D inputs (every model's) skip the reshapes: a decode step makes over a hundred of these calls.
    flat = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    out = op(flat, blocks.data, blocks.native_shards)
    if flat is not x:
        out = out.view(*x.shape[:-1], out.shape[-1])
    return out if bias is None else out + bias


def _native(blocks: _Blocks, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return _run_native(torch.ops.fw_quant_gguf.quant_gemv, blocks, x, bias)


def _native_a16(blocks: _Blocks, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return _run_native(torch.ops.fw_quant_gguf.quant_gemv_a16, blocks, x, bias)


def _native_decode(data: torch.Tensor, qtype: GGMLQuantizationType, dtype: torch.dtype) -> torch.Tensor:
    if dtype in (torch.float32, torch.bfloat16):
        return torch.ops.fw_quant_gguf.dequantize(data, int(qtype), dtype)
    return torch.ops.fw_quant_gguf.dequantize(data, int(qtype), torch.float32).to(dtype)


def _dense_product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` for a freshly decoded chunk: float32 through oneDNN, which on a Zen 5 ran 400-470 GFLOP/s
    at 128-256 rows where ``F.linear`` (MKL) ran 155-215; other dtypes through ``F.linear`` (oneDNN already)."""
    if x.dtype != torch.float32 or not torch.backends.mkldnn.is_available():
        return F.linear(x, weight)
    out = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]).contiguous(), weight, None, "none", [], "")
    return out.view(*x.shape[:-1], weight.shape[0])


def _native_supports(key: tuple, types: frozenset = _NATIVE_TYPES) -> bool:
    shards, _, _, device = key
    return (device == "cpu" and all(GGMLQuantizationType[t] in types for t, _ in shards)
            and native.load("fw_quant_gguf", _SOURCE))


def _int_supports(key: tuple) -> bool:
    return _native_supports(key, _INT_TYPES)


PRODUCT = kernels.Operation("gguf.linear", reference="torch")
PRODUCT.register(kernels.Candidate("fw", _native, supports=_native_supports))
# 16-bit activations rounded to int16 blocks: within about 1e-5 of a block's largest value, 250 times finer than
# their own rounding, and integer block products are cheaper than widening each weight to float. Not for float32
# activations, whose product must stay within float32 summation error (the quant conformance suite).
PRODUCT.register(kernels.Candidate(
    "fw-a16", _native_a16, supports=lambda key: key[2] in ("bfloat16", "float16") and _int_supports(key)))
PRODUCT.register(kernels.Candidate(
    "fw-dequant", lambda b, x, bias=None: _dequantized(b, x, bias, x.dtype, _native_decode, _dense_product),
    supports=_native_supports))
PRODUCT.register(kernels.Candidate("torch", lambda b, x, bias=None: _dequantized(b, x, bias, x.dtype)))
PRODUCT.register(kernels.Candidate(
    "torch-fp32", lambda b, x, bias=None: _dequantized(b, x, bias, torch.float32).to(x.dtype),
    supports=lambda key: key[2] == "bfloat16"))


def _emulated_a8(blocks: _Blocks, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The int8-activation product in torch: the rounded activations times the dequantized weights, in float32."""
    rounded = int_block_rounded(x)
    return _dequantized(blocks, rounded, None if bias is None else bias.float(), torch.float32).to(x.dtype)


def _native_a8(blocks: _Blocks, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return _run_native(torch.ops.fw_quant_gguf.quant_gemv_a8, blocks, x, bias)


# The same products with int8 activations (the option activations=int8): "torch" emulates the rounding exactly.
PRODUCT_A8 = kernels.Operation("gguf.linear.a8", reference="torch")
PRODUCT_A8.register(kernels.Candidate("fw", _native_a8, supports=_int_supports))
PRODUCT_A8.register(kernels.Candidate("torch", _emulated_a8))


class GGUFMethod(QuantMethod):
    def __init__(self, options: Any = None, quant_config: dict[str, Any] | None = None) -> None:
        super().__init__(options, quant_config)
        self.tensor_types: dict[str, str] = self.quant_config.get("tensor_types", {})
        options = options if options is not None else GGUFOptions()
        self.dequantize_at_load = options.dequantize
        self.int8_activations = options.activations == "int8"

    def get_linear_method(self, spec: LinearSpec) -> LinearMethod:
        types = []
        for part in spec.checkpoint_names:
            name = f"{part}.weight"
            if name not in self.tensor_types:
                raise ModelLoadError(f"the GGUF file has no tensor for {name}")
            types.append(GGMLQuantizationType[self.tensor_types[name]])
        return GGUFLinearMethod(types, self.dequantize_at_load, self.int8_activations)

    def get_logits_method(self, weight: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """The head on ggml blocks, where the native kernels read them: the logits keep their weights, while the
        head, a small model's largest matrix and read in full every decode step, reads a quarter (Q8_0) to a
        seventh (Q4_K) of the float table's bytes. The blocks are the file's own (``output``, or the tied
        ``token_embd``), read again and checked against the loaded table (float32, or bfloat16 with
        ``--dtype bfloat16``: the head then multiplies the file's weights rather than their bf16 rounding); a
        float32 table that holds a rank's rows only (tensor parallel) keeps its weights if it is exactly a Q8_0
        table (as one dequantized from the file's Q8_0 is: it requantizes to the same blocks, checked). Any other
        table keeps the float head, as does a machine without the native kernels (the torch candidates would
        dequantize the whole head every step); while they build in the background, kernel choice takes them up
        once they land."""
        if (self.dequantize_at_load or weight.dtype not in (torch.float32, torch.bfloat16)
                or weight.device.type != "cpu"
                or not (native.load("fw_quant_gguf", _SOURCE) or "fw_quant_gguf" in native.building())):
            return None
        found = self._file_head(weight) or (_q8_0_head(weight) if weight.dtype == torch.float32 else None)
        if found is None:
            return None
        qtype, data = found
        rows, width = weight.shape
        shards = [_Shard(qtype, 0, rows, data.shape[1])]
        kernel = _select(data.flatten(), shards, *_layout(shards, width), width, torch.float32, self.int8_activations)
        return lambda hidden: kernel(hidden.float())

    def _file_head(self, weight: torch.Tensor) -> tuple[GGMLQuantizationType, torch.Tensor] | None:
        head = self.quant_config.get("head")
        if head is None or head["type"] not in GGMLQuantizationType.__members__:
            return None
        qtype = GGMLQuantizationType[head["type"]]
        if qtype not in _NATIVE_TYPES or head["rows"] != weight.shape[0]:
            return None
        try:
            raw = np.fromfile(head["file"], dtype=np.uint8, count=head["rows"] * head["row_bytes"],
                              offset=head["offset"])
        except OSError:
            return None
        if raw.size != head["rows"] * head["row_bytes"]:
            return None
        data = torch.from_numpy(raw).view(head["rows"], head["row_bytes"])
        decode = _native_decode if native.load("fw_quant_gguf", _SOURCE) else dequantize
        # A few thousand rows at a time: a whole decoded copy would be the float table's size again.
        for start in range(0, len(data), 4096):
            if not torch.equal(decode(data[start : start + 4096], qtype, weight.dtype), weight[start : start + 4096]):
                return None
        return qtype, data


def _q8_0_head(weight: torch.Tensor) -> tuple[GGMLQuantizationType, torch.Tensor] | None:
    """Q8_0 blocks that decode to exactly ``weight``, or None."""
    q8 = GGMLQuantizationType.Q8_0
    if weight.shape[1] % 32:
        return None

    def exact(rows: torch.Tensor) -> torch.Tensor | None:
        data = quantize_q8_0(rows)
        return data if torch.equal(dequantize(data, q8, torch.float32), rows) else None

    # A few rows first: a table of another type fails there, before the whole table is requantized.
    if exact(weight[:64]) is None or (data := exact(weight)) is None:
        return None
    return q8, data

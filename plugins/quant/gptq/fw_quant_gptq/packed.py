"""Integer weights as fw's kernels read them, whatever checkpoint layout they came from (``formats``).

Every supported layout (GPTQ, AWQ, compressed-tensors pack-quantized) means the same thing: weight
``W[n, k] = scale[n, g] * (q[n, k] - zero[n, g])`` with ``g`` the group of input feature ``k``. At load each is
decoded once to ``q``, ``zero`` and ``scale`` and repacked here into ``IntWeight``:

- ``q``: uint8 ``[N, K * bits / 8]``. 8-bit: one byte per weight. 4-bit: blocks of 32 weights in 16 bytes,
  weight ``j`` of a block in the low nibble of byte ``j`` and weight ``j + 16`` in its high nibble, so that a
  vector unit splits a block into two halves with one mask and one shift.
- ``scale`` and ``offset = -scale * zero``: float32 ``[N, groups]``. ``q * scale + offset`` is exact in float32
  (a half-precision scale times a small integer), so every kernel computes with the checkpoint's own weights.
- act-order (GPTQ ``desc_act``, a permuted ``g_idx``): the input features are sorted by group once at load
  (``perm``), which makes every group contiguous; the product then permutes the activation once per call.

Products (``fw.sdk.kernels`` operation ``int.linear``, chosen per CPU, shape and row count by timing): ``fw``
(``csrc/gemv.cpp``, CPU) decodes each block in registers as it reads it, at half a byte (or a byte) a weight:
the decode-sized choice; ``fw-dpbf16`` (AVX512-BF16, 4-bit) multiplies bf16 activations by the nibbles in bf16
pair products, exactly. ``fw-bf16`` (AVX512-BF16) dequantizes 48 rows at a time to bf16 in a thread's buffer,
in the layout of fw's dense kernel, and runs all of x's rows against them there: the prefill-sized choice where
it builds. ``torch`` / ``torch-fp32`` dequantize a chunk of rows at a time into the activation dtype / float32 and
multiply. ``fw-amx`` widens the integers into AMX tiles. ``triton`` (CUDA, ``triton_gemm``) decodes tiles
inside a GEMM. With the plugins' option ``activations=int8`` the operation is ``int.linear.a8``: the
activations are rounded to int8 blocks first, and ``fw`` multiplies integers (exact in int32).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from fw.sdk import dense, kernels, native
from fw.sdk.errors import ModelLoadError
from fw.sdk.linear import int_block_rounded

BLOCK = 32  # weights per 4-bit block (and the native kernel's unit)
_SOURCE = Path(__file__).parent / "csrc" / "gemv.cpp"


@dataclass(frozen=True)
class IntWeight:
    """Rows of a layer's weight in fw's layout (see the module docstring)."""

    bits: int
    q: torch.Tensor  # uint8 [N, K * bits / 8]
    scale: torch.Tensor  # float32 [N, groups]
    offset: torch.Tensor  # float32 [N, groups]
    columns: torch.Tensor  # int64 [K]: the group of each (sorted) input feature
    group: int | None  # input features per group when columns == arange(K) // group; None: irregular groups
    perm: torch.Tensor | None  # int64 [K]: input feature of each sorted position; None: in order

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape[0], self.columns.numel()


def repack(bits: int, q: torch.Tensor, zero: torch.Tensor, scale: torch.Tensor, g_idx: torch.Tensor) -> IntWeight:
    """``q`` uint8 [N, K], ``zero`` and ``scale`` float32 [N, groups], ``g_idx`` [K] as fw's ``IntWeight``."""
    n, k = q.shape
    if k % BLOCK:
        raise ModelLoadError(f"{k} input features: the integer kernels need a multiple of {BLOCK}")
    g_idx = g_idx.long()
    perm = None
    if bool((g_idx[1:] < g_idx[:-1]).any()):  # act-order: sort the input features by group, once
        perm = torch.argsort(g_idx, stable=True)
        q, g_idx = q[:, perm], g_idx[perm]
    width = int((g_idx == 0).sum())  # the first group's; regular groups all have it (the last may have fewer)
    regular = width > 0 and scale.shape[1] == -(-k // width) and bool(
        (g_idx == torch.arange(k, device=g_idx.device) // width).all())
    if bits == 4:
        q = q.reshape(n, k // BLOCK, 2, BLOCK // 2)
        q = q[:, :, 0] | (q[:, :, 1] << 4)
    return IntWeight(bits, q.reshape(n, -1).contiguous(), scale.float().contiguous(),
                     (-scale.float() * zero.float()).contiguous(), g_idx, width if regular else None, perm)


def round_rows(weight: torch.Tensor, bits: int = 8, group: int = 128) -> IntWeight:
    """A float weight [N, K] rounded to ``bits`` (8 or 4), symmetric (zero point 128 or 8: levels -127..127 or
    -7..7), a scale per row and ``group`` input features (``BLOCK`` where K is not a multiple of ``group``)."""
    n, k = weight.shape
    group = group if k % group == 0 else BLOCK
    if k % group:
        raise ModelLoadError(f"{k} input features: a rounded head needs a multiple of {BLOCK}")
    levels, zero = (1 << (bits - 1)) - 1, 1 << (bits - 1)
    blocks = weight.float().reshape(n, k // group, group)
    scale = (blocks.abs().amax(dim=-1) / levels).clamp(min=torch.finfo(torch.float32).tiny)
    q = (blocks / scale[..., None]).round().clamp(-levels, levels) + zero
    g_idx = torch.arange(k, device=weight.device) // group
    return repack(bits, q.reshape(n, k).to(torch.uint8), torch.full_like(scale, float(zero)), scale, g_idx)


def unpack_rows(w: IntWeight, rows: slice) -> torch.Tensor:
    """The integers ``q`` of ``rows``, uint8 [rows, K], input features in sorted order."""
    q = w.q[rows]
    if w.bits == 8:
        return q
    n = q.shape[0]
    blocks = q.reshape(n, -1, BLOCK // 2)
    return torch.stack((blocks & 0x0F, blocks >> 4), dim=2).reshape(n, -1)


def dequantize(w: IntWeight, rows: slice = slice(None), dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``rows`` of the weight, [rows, K] in ``dtype``, input features in sorted order."""
    q = unpack_rows(w, rows).float()
    scale, offset = w.scale[rows], w.offset[rows]
    if w.group is not None:
        n, k = q.shape
        width = w.group
        pad = -k % width
        q = F.pad(q, (0, pad)).view(n, -1, width)
        return (q * scale[:, :, None] + offset[:, :, None]).view(n, -1)[:, :k].to(dtype)
    return (q * scale[:, w.columns] + offset[:, w.columns]).to(dtype)


def matrix(w: IntWeight) -> torch.Tensor:
    """The whole weight, float32 [N, K], input features in the checkpoint's order."""
    rows = dequantize(w)
    return rows if w.perm is None else rows[:, torch.argsort(w.perm)]


def _product(w: IntWeight, x: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    x = x.to(dtype)
    n, k = w.shape
    step = max(1, dense.WIDEN_CHUNK // k)
    parts = [F.linear(x, dequantize(w, slice(i, i + step), dtype)) for i in range(0, n, step)]
    out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
    return out if bias is None else out + bias.to(dtype)


def _native(w: IntWeight, x: torch.Tensor, bias: torch.Tensor | None = None, kernel: str = "int_gemv") -> torch.Tensor:
    rows = x.numel() // x.shape[-1]
    out = getattr(torch.ops.fw_quant_gptq, kernel)(x.reshape(rows, x.shape[-1]), w.q, w.scale, w.offset, w.bits,
                                                   w.group)
    out = out.view(*x.shape[:-1], out.shape[-1])
    return out if bias is None else out + bias


def _tiles(kernel: str, w: IntWeight, x: torch.Tensor, bias: torch.Tensor | None = None, *flags: bool) -> torch.Tensor:
    """``int_gemm_amx``, ``int_gemm_bf16`` or ``int_gemv_dpbf16`` (with its ``float_out``), which add the bias
    themselves."""
    rows = x.numel() // x.shape[-1]
    out = getattr(torch.ops.fw_quant_gptq, kernel)(x.reshape(rows, x.shape[-1]), w.q, w.scale, w.offset, w.bits,
                                                   w.group, bias, *flags)
    return out.view(*x.shape[:-1], out.shape[-1])


def _tile_shape(key: tuple) -> bool:
    """What the bf16 tile kernels take: bf16 activations, 16 output rows and 64 input features at a time."""
    return PRODUCT.candidates["fw"].supports(key) and key[4] == "bfloat16" and key[0] % 16 == 0 and key[1] % 64 == 0


def _triton(w: IntWeight, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    from fw_quant_gptq.triton_gemm import int_gemm

    out = int_gemm(x.reshape(-1, x.shape[-1]), w).view(*x.shape[:-1], w.shape[0])
    return out if bias is None else out + bias


# key: (N, K, bits, group, dtype, device)
PRODUCT = kernels.Operation("int.linear", reference="torch")
PRODUCT.register(kernels.Candidate(
    "fw", _native,
    supports=lambda key: key[5] == "cpu" and key[3] is not None and key[3] % BLOCK == 0
    and native.load("fw_quant_gptq", _SOURCE)))
# The same kernel in 512-bit vectors where the build has AVX-512 (GPTQ 4-bit on an AMX Xeon: 28.5 -> 32.8 tok/s).
PRODUCT.register(kernels.Candidate(
    "fw-avx512", lambda w, x, bias=None: _native(w, x, bias, "int_gemv_wide"),
    supports=lambda key: PRODUCT.candidates["fw"].supports(key) and torch.ops.fw_quant_gptq.has_wide()))
def _has_dpbf16(key: tuple) -> bool:
    """What int_gemv_dpbf16 takes: bf16 activations, 4-bit weights, groups and K in whole pairs of blocks."""
    return (PRODUCT.candidates["fw"].supports(key) and key[2] == 4 and key[3] % 64 == 0 and key[1] % 64 == 0
            and key[4] == "bfloat16" and torch.ops.fw_quant_gptq.has_dpbf16())


# 4-bit weights against bf16 activations in AVX512-BF16 pair products (each nibble n as the bf16 128 + n): exact
# products in a third of the float kernel's instructions. Zen 5, Qwen2-0.5B's 96 4-bit layers streamed at one row:
# 8.7 ms with fw-avx512, 5.6 (int8 activations' fw-vnni512: 5.9).
PRODUCT.register(kernels.Candidate(
    "fw-dpbf16", lambda w, x, bias=None: _tiles("int_gemv_dpbf16", w, x, bias, False), supports=_has_dpbf16))
# Prompts and batches through AMX bf16 tiles, the integers widened once per call for all the rows.
PRODUCT.register(kernels.Candidate(
    "fw-amx", partial(_tiles, "int_gemm_amx"),
    supports=lambda key: _tile_shape(key) and torch.ops.fw_quant_gptq.amx_supported()))
# Prompts and batches through fw's AVX512-BF16 dense tiles, each 48 rows of the weight dequantized to bf16 in a
# thread's buffer once per call: the same bf16 weights as "torch", without a copy of them in memory. Zen 5, 4-bit
# Qwen2-0.5B at 128 rows: 9728 x 896 in 2.5 ms against torch's 32; TTFT of a 128-token prompt 510 -> 145-155 ms.
PRODUCT.register(kernels.Candidate(
    "fw-bf16", partial(_tiles, "int_gemm_bf16"),
    supports=lambda key: _tile_shape(key) and torch.ops.fw_quant_gptq.has_bf16_tiles()))
PRODUCT.register(kernels.Candidate("torch", lambda w, x, bias=None: _product(w, x, bias, x.dtype)))
PRODUCT.register(kernels.Candidate(
    "torch-fp32", lambda w, x, bias=None: _product(w, x, bias, torch.float32).to(x.dtype),
    supports=lambda key: key[4] == "bfloat16"))
PRODUCT.register(kernels.Candidate(
    "triton", _triton, supports=lambda key: key[5] == "cuda" and kernels.importable("triton")))


def _emulated_a8(w: IntWeight, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    rounded = int_block_rounded(x, BLOCK)
    return _product(w, rounded, None if bias is None else bias.float(), torch.float32).to(x.dtype)


# The same products with int8 activations (the plugins' option activations=int8): "torch" emulates them exactly.
PRODUCT_A8 = kernels.Operation("int.linear.a8", reference="torch")
PRODUCT_A8.register(kernels.Candidate("fw", lambda w, x, bias=None: _native(w, x, bias, "int_gemv_a8"),
                                      supports=PRODUCT.candidates["fw"].supports))
# Two blocks an instruction in 512-bit VNNI products where the build has AVX-512 VNNI.
PRODUCT_A8.register(kernels.Candidate(
    "fw-vnni512", lambda w, x, bias=None: _native(w, x, bias, "int_gemv_a8_wide"),
    supports=lambda key: PRODUCT.candidates["fw"].supports(key) and torch.ops.fw_quant_gptq.has_wide_a8()))
PRODUCT_A8.register(kernels.Candidate("torch", _emulated_a8))
# Prompts: fw-bf16 on the activations rounded as "torch" rounds them, then to bf16 for the tiles (as the fp8
# plugin's W8A8 prompts take its weight-only tiles). Zen 5, 4-bit Qwen2-0.5B: a 128-token TTFT 400-500 -> 180 ms.
PRODUCT_A8.register(kernels.Candidate(
    "fw-bf16", lambda w, x, bias=None: _tiles("int_gemm_bf16", w, int_block_rounded(x, BLOCK).to(x.dtype), bias),
    supports=PRODUCT.candidates["fw-bf16"].supports))


# A rounded LM head (the plugins' option lm_head): float32 logits from hidden states in the model's dtype, never
# rounded to it. Zen 5, Qwen2-0.5B's head at 4 bits: fw-avx512 (on the hidden states widened) 3.8 ms, fw-dpbf16 2.0.
LOGITS = kernels.Operation("int.logits", reference="torch")
LOGITS.register(kernels.Candidate("fw", lambda w, x: _native(w, x.float()), supports=PRODUCT.candidates["fw"].supports))
LOGITS.register(kernels.Candidate("fw-avx512", lambda w, x: _native(w, x.float(), None, "int_gemv_wide"),
                                  supports=PRODUCT.candidates["fw-avx512"].supports))
LOGITS.register(kernels.Candidate("fw-dpbf16", lambda w, x: _tiles("int_gemv_dpbf16", w, x, None, True),
                                  supports=_has_dpbf16))
LOGITS.register(kernels.Candidate("torch", lambda w, x: _product(w, x, None, torch.float32)))
LOGITS.register(kernels.Candidate("triton", lambda w, x: _triton(w, x.float()),
                                  supports=PRODUCT.candidates["triton"].supports))


def key(w: IntWeight, dtype: torch.dtype) -> tuple:
    return (*w.shape, w.bits, w.group, str(dtype).removeprefix("torch."), w.q.device.type)


def select_product(w: IntWeight, dtype: torch.dtype, int8_activations: bool = False,
                   op: kernels.Operation | None = None) -> kernels.Selection:
    width, op = w.shape[1], op or (PRODUCT_A8 if int8_activations else PRODUCT)
    return op.select(key(w, dtype), w, lambda n: (torch.randn(n, width, dtype=dtype, device=w.q.device),))


class Product:
    """A layer's (or an expert's) product with one ``IntWeight``: the activation permuted once, then the kernel."""

    def __init__(self, w: IntWeight, dtype: torch.dtype, int8_activations: bool = False) -> None:
        self.weight, self.perm = w, w.perm
        self.run = select_product(w, dtype, int8_activations)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.perm is not None:
            x = x.index_select(-1, self.perm)
        return self.run(x, bias)

"""GGML weight blocks decoded with vectorised torch ops (every block of a tensor at once, on its device).

A quantized row of ``n`` weights is ``n / block_size`` blocks of ``type_size`` bytes, each holding
its own fp16 scale(s) and packed integers; the layouts are those of ggml's ``block_q*`` structs
(little-endian). Every kernel computes in float32 exactly as ggml's reference dequantization does
(scale times integer, minus the min where there is one), so results match ``gguf.quants.dequantize``
bit for bit; callers cast to the activation dtype afterwards.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from gguf import GGML_QUANT_SIZES, QK_K, GGMLQuantizationType

Q = GGMLQuantizationType

# Stored as plain floats, no block structure: (exponent bits, mantissa bits) of each.
FLOAT_TYPES = {Q.F32: (8, 23), Q.F16: (5, 10), Q.BF16: (8, 7)}


def _ieee(b: torch.Tensor, exponent: int, mantissa: int) -> torch.Tensor:
    """[..., k * bytes] little-endian IEEE floats of ``exponent`` and ``mantissa`` bits -> [..., k] float32, exactly.

    Arithmetic on the bits rather than a dtype view of the bytes, which ``torch.jit.trace`` cannot record (a
    captured decode step, ``fw.decode_graph``, may run this)."""
    width = (1 + exponent + mantissa) // 8
    b = b.reshape(*b.shape[:-1], -1, width).long()
    bits = b[..., 0]
    for i in range(1, width):
        bits = bits | (b[..., i] << (8 * i))
    e, m = (bits >> mantissa) & ((1 << exponent) - 1), bits & ((1 << mantissa) - 1)
    normal = e > 0  # subnormals: no implicit leading 1, the smallest exponent
    scale = torch.where(normal, e, 1) - ((1 << (exponent - 1)) - 1) - mantissa
    value = torch.ldexp(torch.where(normal, m | (1 << mantissa), m).float(), scale.float())
    top = e == (1 << exponent) - 1  # infinities and NaNs
    value = torch.where(top, torch.where(m == 0, float("inf"), float("nan")), value)
    return torch.where((bits >> (exponent + mantissa)) == 1, -value, value)


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[n, 2] bytes -> [n, 1] float32 (a block's fp16 scale)."""
    return _ieee(b, 5, 10)


def _shifts(like: torch.Tensor, *amounts: int) -> torch.Tensor:
    return torch.tensor(amounts, dtype=torch.uint8, device=like.device)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[n, k] bytes -> [n, 2k]: ggml stores element i in the low nibble of byte i, element k + i in its high one."""
    return torch.cat([qs & 0xF, qs >> 4], dim=-1)


def _bits(b: torch.Tensor) -> torch.Tensor:
    """[n, k] bytes -> [n, 8, k]: bit j of every byte (a K-quant's j-th sub-block takes bit j)."""
    return (b.unsqueeze(1) >> _shifts(b, *range(8)).view(1, 8, 1)) & 1


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    return _f16(b[:, :2]) * (_nibbles(b[:, 2:]).float() - 8)


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    return _f16(b[:, :2]) * _nibbles(b[:, 4:]).float() + _f16(b[:, 2:4])


def _five_bit(qh: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    # qh is one little-endian uint32 whose bit i is the fifth bit of element i.
    high = _bits(qh).transpose(1, 2).reshape(len(qh), 32)
    return _nibbles(qs) | (high << 4)


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    return _f16(b[:, :2]) * (_five_bit(b[:, 2:6], b[:, 6:]).float() - 16)


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    return _f16(b[:, :2]) * _five_bit(b[:, 4:8], b[:, 8:]).float() + _f16(b[:, 2:4])


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return _f16(b[:, :2]) * b[:, 2:].to(torch.int8).float()  # the conversion wraps, as a view would read


def _crumbs(qs: torch.Tensor, width: int) -> torch.Tensor:
    """2-bit fields of K-quant 128-element halves: [n, k] -> [n, k / width, 4, width]; field s of a byte is shift 2s."""
    return (qs.reshape(len(qs), -1, 1, width) >> _shifts(qs, 0, 2, 4, 6).view(1, 1, 4, 1)) & 3


def _q2_k(b: torch.Tensor) -> torch.Tensor:
    # scales[16] (low nibble scale, high nibble min, per 16 elements) | qs[64] | d | dmin
    n, scales = len(b), b[:, :16]
    d, dmin = _f16(b[:, 80:82]), _f16(b[:, 82:84])
    q = _crumbs(b[:, 16:80], 32).reshape(n, 16, 16).float()
    return ((d * (scales & 0xF).float()).unsqueeze(-1) * q - (dmin * (scales >> 4).float()).unsqueeze(-1)).reshape(
        n, QK_K
    )


def _q3_k(b: torch.Tensor) -> torch.Tensor:
    # hmask[32] | qs[64] | scales[12] (16 six-bit values) | d
    n, packed = len(b), b[:, 96:108]
    low = torch.cat([packed[:, :8] & 0xF, packed[:, :8] >> 4], dim=-1)
    high = ((packed[:, 8:12].unsqueeze(1) >> _shifts(b, 0, 2, 4, 6).view(1, 4, 1)) & 3).reshape(n, 16)
    scales = (low | (high << 4)).float() - 32
    q = _crumbs(b[:, 32:96], 32).reshape(n, 16, 16).float()
    # A clear hmask bit means "subtract 4" (the stored value is offset so that a set bit adds nothing).
    q = q - 4 * (1 - _bits(b[:, :32]).reshape(n, 16, 16).float())
    return ((_f16(b[:, 108:110]) * scales).unsqueeze(-1) * q).reshape(n, QK_K)


def _k4_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """12 bytes -> eight 6-bit scales and mins: the first four sit in the low 6 bits of bytes 0-7, the
    last four take their low nibbles from bytes 8-11 and their top two bits from bytes 0-7."""
    s0, s1, s2 = s[:, :4], s[:, 4:8], s[:, 8:12]
    scales = torch.cat([s0 & 63, (s2 & 0xF) | ((s0 >> 6) << 4)], dim=-1)
    mins = torch.cat([s1 & 63, (s2 >> 4) | ((s1 >> 6) << 4)], dim=-1)
    return scales.float(), mins.float()


def _k4_low(qs: torch.Tensor) -> torch.Tensor:
    """128 bytes -> [n, 8, 32]: each 32 bytes hold sub-block 2c in low nibbles and 2c + 1 in high ones."""
    return (qs.reshape(len(qs), 4, 1, 32) >> _shifts(qs, 0, 4).view(1, 1, 2, 1)).reshape(len(qs), 8, 32) & 0xF


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    # d | dmin | scales[12] | qs[128]
    scales, mins = _k4_scales(b[:, 4:16])
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    q = _k4_low(b[:, 16:]).float()
    return ((d * scales).unsqueeze(-1) * q - (dmin * mins).unsqueeze(-1)).reshape(len(b), QK_K)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    # d | dmin | scales[12] | qh[32] | qs[128]
    scales, mins = _k4_scales(b[:, 4:16])
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    q = (_k4_low(b[:, 48:]) | (_bits(b[:, 16:48]) << 4)).float()
    return ((d * scales).unsqueeze(-1) * q - (dmin * mins).unsqueeze(-1)).reshape(len(b), QK_K)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    # ql[128] (low 4 bits) | qh[64] (high 2 bits) | scales[16] int8 | d
    n = len(b)
    low = (b[:, :128].reshape(n, 2, 1, 64) >> _shifts(b, 0, 4).view(1, 1, 2, 1)).reshape(n, 8, 32) & 0xF
    high = _crumbs(b[:, 128:192], 32).reshape(n, 8, 32)
    q = ((low | (high << 4)).float() - 32).reshape(n, 16, 16)
    scales = b[:, 192:208].to(torch.int8).float()
    return ((_f16(b[:, 208:210]) * scales).unsqueeze(-1) * q).reshape(n, QK_K)


_KERNELS: dict[GGMLQuantizationType, Callable[[torch.Tensor], torch.Tensor]] = {
    Q.Q8_0: _q8_0,
    Q.Q4_0: _q4_0,
    Q.Q4_1: _q4_1,
    Q.Q5_0: _q5_0,
    Q.Q5_1: _q5_1,
    Q.Q2_K: _q2_k,
    Q.Q3_K: _q3_k,
    Q.Q4_K: _q4_k,
    Q.Q5_K: _q5_k,
    Q.Q6_K: _q6_k,
}

SUPPORTED_TYPES: tuple[GGMLQuantizationType, ...] = (*FLOAT_TYPES, *_KERNELS)


def row_bytes(qtype: GGMLQuantizationType, n: int) -> int:
    """Bytes of a row of ``n`` weights; ``n`` must be a whole number of blocks."""
    block, size = GGML_QUANT_SIZES[qtype]
    if n % block:
        raise ValueError(f"a row of {n} weights is not a whole number of {qtype.name} blocks of {block}")
    return n // block * size


def dequantize(data: torch.Tensor, qtype: GGMLQuantizationType, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 ``[..., row_bytes]`` blocks -> ``[..., weights per row]`` in ``dtype``."""
    if qtype in FLOAT_TYPES:
        return _ieee(data, *FLOAT_TYPES[qtype]).to(dtype)
    kernel = _KERNELS.get(qtype)
    if kernel is None:
        raise ValueError(f"cannot dequantize {qtype.name} (supported: {', '.join(t.name for t in SUPPORTED_TYPES)})")
    block, size = GGML_QUANT_SIZES[qtype]
    *lead, nbytes = data.shape
    out = kernel(data.reshape(-1, size))
    return out.reshape(*lead, nbytes // size * block).to(dtype)

"""A Triton GEMM over 8-bit weights with float32 scales per row and group of input features (channel, tensor and
DeepSeek-V3 block scales alike): each program widens a [K tile, N tile] of the weight to float32 with its scales
and accumulates ``x @ W.T`` in float32. FP8 e4m3 is widened from its bits as the CPU kernel does (the bits move
into a float32's exponent and mantissa, then one multiply by 2^120 rebiases), which is exact and needs no FP8
type, so the kernel also runs under ``TRITON_INTERPRET=1`` on a CPU (float32 inputs only there: the interpreter's
bf16 ``tl.dot`` is wrong). For CUDA."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

REBIAS = 2.0**120


@triton.jit
def _gemm8(x_ptr, w_ptr, scale_ptr, y_ptr, M, N, K, G, group, stride_x, stride_y, FP8: tl.constexpr,
           IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rm[:, None] * stride_x + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
        wmask = (rk[:, None] < K) & (rn[None, :] < N)
        b = tl.load(w_ptr + rn[None, :] * K + rk[:, None], mask=wmask, other=0).to(tl.int32)  # the bytes, 0..255
        if FP8:
            bits = ((b & 0x80) << 24) | ((b & 0x7F) << 20)
            w = bits.to(tl.float32, bitcast=True) * REBIAS
        else:  # int8
            w = (b - ((b & 0x80) << 1)).to(tl.float32)
        scale = tl.load(scale_ptr + rn[None, :] * G + (rk // group)[:, None], mask=wmask, other=0.0)
        w = (w * scale).to(x.dtype)
        if IEEE:
            acc += tl.dot(x, w, input_precision="ieee")
        else:
            acc += tl.dot(x, w)
    tl.store(y_ptr + rm[:, None] * stride_y + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def gemm8(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, group: int | None, block_m: int = 16,
          block_n: int = 32, block_k: int = 32) -> torch.Tensor:
    """``x @ (weight * scale).T`` for ``x`` [M, K], an FP8 or int8 ``weight`` [N, K] and float32 ``scale``
    [N, groups] (each for ``group`` input features; None: one per row), in ``x.dtype``."""
    x = x.contiguous()
    (m, k), n = x.shape, weight.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _gemm8[grid](x, weight.view(torch.uint8), scale.contiguous(), y, m, n, k, scale.shape[1], group or k,
                 x.stride(0), y.stride(0), FP8=weight.dtype == torch.float8_e4m3fn, IEEE=x.dtype == torch.float32,
                 BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    return y

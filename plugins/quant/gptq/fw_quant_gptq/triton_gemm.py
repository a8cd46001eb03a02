"""A Triton GEMM over ``packed.IntWeight`` (4- or 8-bit, regular groups): each program decodes a [K tile, N tile]
of integers with their group's scale and offset and accumulates ``x @ W.T`` in float32. For CUDA; on a CPU it
runs under ``TRITON_INTERPRET=1`` (float32 inputs only: the interpreter's bf16 ``tl.dot`` is wrong)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fw_quant_gptq.packed import BLOCK, IntWeight


@triton.jit
def _int_gemm(x_ptr, q_ptr, scale_ptr, offset_ptr, y_ptr, M, N, K, G, group, stride_x, stride_y,
              BITS: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rm[:, None] * stride_x + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
        wmask = (rk[:, None] < K) & (rn[None, :] < N)
        if BITS == 4:  # weight j of a 32-block: low nibble of byte j (j < 16), else high nibble of byte j - 16
            j = rk % 32
            byte = (rk // 32) * 16 + j % 16
            packed = tl.load(q_ptr + rn[None, :] * (K // 2) + byte[:, None], mask=wmask, other=0)
            q = (packed >> ((j // 16) * 4)[:, None]) & 0xF
        else:
            q = tl.load(q_ptr + rn[None, :] * K + rk[:, None], mask=wmask, other=0)
        g = (rk // group)[:, None]
        scale = tl.load(scale_ptr + rn[None, :] * G + g, mask=wmask, other=0.0)
        offset = tl.load(offset_ptr + rn[None, :] * G + g, mask=wmask, other=0.0)
        w = (q.to(tl.float32) * scale + offset).to(x.dtype)
        if IEEE:
            acc += tl.dot(x, w, input_precision="ieee")
        else:
            acc += tl.dot(x, w)
    tl.store(y_ptr + rm[:, None] * stride_y + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def int_gemm(x: torch.Tensor, w: IntWeight, block_m: int = 16, block_n: int = 32, block_k: int = BLOCK
             ) -> torch.Tensor:
    """``x @ W.T`` for ``x`` [M, K] (input features in ``w``'s sorted order), in ``x.dtype``."""
    if w.group is None:
        raise ValueError("the Triton integer GEMM needs regular groups")
    x = x.contiguous()
    (m, k), n = x.shape, w.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _int_gemm[grid](x, w.q, w.scale, w.offset, y, m, n, k, w.scale.shape[1], w.group, x.stride(0), y.stride(0),
                    BITS=w.bits, IEEE=x.dtype == torch.float32, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    return y

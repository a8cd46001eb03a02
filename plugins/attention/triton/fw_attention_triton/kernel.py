"""One Triton kernel for all of a step's attention rows: prefill chunks and decodes in a single launch.

A program takes up to ``BLOCK_Q`` consecutive query tokens of one request and the ``GROUP`` query heads that
share one KV head, as the rows of one ``[BLOCK_M, D]`` tile (row ``r``: token ``r // GROUP``, head
``r % GROUP``). All its rows read the same keys, so GQA reads each key once per KV head, and a decode's single
token still fills a tile with its heads. It walks the request's cache one block (``BLOCK_N`` keys) at a time
with FlashAttention's online softmax, skipping blocks wholly before the sliding window or after its last query.

Keys and values may be one cache row read twice: multi-head latent attention in its absorbed form is this
kernel with one KV head, keys the ``DK``-wide latent-and-rope row and values its first ``DV`` columns.

Quantized caches dequantize as they load, as ``fw.sdk.kv_quant.read`` does: fp8 by the layer's scales, int8 by the
float32 scale at column ``SCALE_COL`` of the row (keys and values share the row width), read
through a float32 view of the cache.
"""

from __future__ import annotations

import triton
import triton.language as tl

# KV_FP8_BITS: an fp8 cache read as bytes and decoded by hand, for GPUs whose Triton has no float8_e4m3fn
# (compute capability below 8.9).
KV_AUTO, KV_FP8, KV_INT8, KV_FP8_BITS = 0, 1, 2, 3


@triton.jit
def _e4m3_to_float(bits):
    """float8_e4m3fn bytes (as uint8) to float32: (8 + m) * 2^(e - 10), or m * 2^-9 when subnormal. The cache
    never holds NaN: writes saturate."""
    b = bits.to(tl.int32)
    e = (b >> 3) & 15
    m = (b & 7).to(tl.float32)
    magnitude = tl.where(e == 0, m * 0.001953125, (8.0 + m) * tl.exp2((e - 10).to(tl.float32)))
    return tl.where(b >= 128, -magnitude, magnitude)


@triton.jit
def _load_tile(ptr, scales_ptr, block, n, head, stride_b, stride_n, stride_h, stride_sb, stride_sn, stride_sh,
               d, D: tl.constexpr, valid, layer_scale, SCALE_COL: tl.constexpr, KV_QUANT: tl.constexpr, dtype):
    """``[BLOCK_N, D_PAD]`` entries of one block for one KV head, dequantized to ``dtype``; invalid slots are 0."""
    x = tl.load(ptr + block * stride_b + n[:, None] * stride_n + head * stride_h + d[None, :],
                mask=valid[:, None] & (d[None, :] < D), other=0.0)
    if KV_QUANT == 1:
        x = x.to(tl.float32) * layer_scale
    elif KV_QUANT == 3:
        x = _e4m3_to_float(x) * layer_scale
    elif KV_QUANT == 2:
        row_scale = tl.load(scales_ptr + block * stride_sb + n * stride_sn + head * stride_sh + SCALE_COL,
                            mask=valid, other=0.0)
        x = x.to(tl.float32) * row_scale[:, None]
    return x.to(dtype)


@triton.jit
def unified_attention(
    q_ptr, k_ptr, v_ptr, k_scales_ptr, v_scales_ptr, out_ptr,
    block_tables_ptr, seq_lens_ptr, query_start_ptr, tile_req_ptr, tile_first_ptr,
    scale, k_scale, v_scale, soft_cap, window,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh,
    stride_sb, stride_sn, stride_sh, stride_bt,
    GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DK: tl.constexpr, DV: tl.constexpr, DK_PAD: tl.constexpr, DV_PAD: tl.constexpr,
    KV_QUANT: tl.constexpr, SCALE_COL: tl.constexpr,
    SOFT_CAP: tl.constexpr, WINDOW: tl.constexpr,
):
    tile, kv_head = tl.program_id(0), tl.program_id(1)
    req = tl.load(tile_req_ptr + tile)
    first = tl.load(tile_first_ptr + tile)  # the tile's first query token, counted within its request
    q_start = tl.load(query_start_ptr + req)
    q_len = tl.load(query_start_ptr + req + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + req)
    context = seq_len - q_len  # keys cached before this step's queries

    rows = tl.arange(0, BLOCK_M)
    token = first + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows // GROUP < BLOCK_Q) & (token < q_len)
    q_pos = context + token
    dk, dv, n = tl.arange(0, DK_PAD), tl.arange(0, DV_PAD), tl.arange(0, BLOCK_N)

    q = tl.load(q_ptr + (q_start + token)[:, None] * stride_qt + head[:, None] * stride_qh + dk[None, :],
                mask=row_ok[:, None] & (dk[None, :] < DK), other=0.0)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DV_PAD], tl.float32)

    last_pos = context + tl.minimum(first + BLOCK_Q, q_len) - 1
    lo = 0
    if WINDOW:
        lo = tl.maximum(context + first - window + 1, 0) // BLOCK_N
    for j in range(lo, last_pos // BLOCK_N + 1):
        block = tl.load(block_tables_ptr + req * stride_bt + j).to(tl.int64)
        k_pos = j * BLOCK_N + n
        valid = k_pos < seq_len  # unwritten slots of the last block may hold NaN: never loaded
        k = _load_tile(k_ptr, k_scales_ptr, block, n, kv_head, stride_kb, stride_kn, stride_kh,
                       stride_sb, stride_sn, stride_sh, dk, DK, valid, k_scale, SCALE_COL, KV_QUANT, q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        if SOFT_CAP:  # cap * tanh(s / cap), with tanh from exp (the interpreter has no libdevice)
            s = soft_cap * (1.0 - 2.0 / (tl.exp(2.0 * s / soft_cap) + 1.0))
        seen = valid[None, :] & (k_pos[None, :] <= q_pos[:, None])
        if WINDOW:
            seen &= k_pos[None, :] > q_pos[:, None] - window
        s = tl.where(seen, s, float("-inf"))

        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m - m_safe)
        denom = denom * alpha + tl.sum(p, 1)
        v = _load_tile(v_ptr, v_scales_ptr, block, n, kv_head, stride_vb, stride_vn, stride_vh,
                       stride_sb, stride_sn, stride_sh, dv, DV, valid, v_scale, SCALE_COL, KV_QUANT, q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m = m_new

    out = acc / tl.where(denom == 0.0, 1.0, denom)[:, None]
    tl.store(out_ptr + (q_start + token)[:, None] * stride_ot + head[:, None] * stride_oh + dv[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (dv[None, :] < DV))

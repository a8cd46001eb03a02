// Products of a few activation rows with 4- or 8-bit integer weights (GPTQ, AWQ, compressed-tensors, after
// fw_quant_gptq.packed has repacked them), decoding each 32-weight block in registers as it streams by. A
// weight is q * scale_g + offset_g for its group g (offset = -scale * zero), so a row's product is
// sum_g scale_g (x_g . q_g) + offset_g sum(x_g): the zero points cost one multiply-add per group, not per
// weight. 4-bit blocks are 16 bytes, element j in the low nibble of byte j and element j + 16 in its high
// nibble. int_gemv_a8 rounds the activations to int8 blocks first and multiplies bytes (exact in int32).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "fw_cpu.h"

namespace {

constexpr int64_t kBlock = 32, kMaxRows = 8;

// R consecutive output rows: their blocks, and their groups' scales and offsets (rows `stride` bytes /
// `groups` values apart). Several rows at once give independent accumulator chains and share each x load.
struct Rows {
  const uint8_t* q;
  const float* scale;
  const float* offset;
  int64_t stride, groups, blocks, group_blocks;

  // A weight's rows (check_weight's tensors): K input features in groups of `group`.
  static Rows of(const at::Tensor& q, const at::Tensor& scale, const at::Tensor& offset, int64_t K, int64_t group) {
    return {q.data_ptr<uint8_t>(), scale.data_ptr<float>(), offset.data_ptr<float>(), q.size(1), scale.size(1),
            K / kBlock, group / kBlock};
  }

  // The rows from n (computed once per call, not once per tile: the tensors' accessors check types each time).
  Rows from(int64_t n) const {
    return {q + n * stride, scale + n * groups, offset + n * groups, stride, groups, blocks, group_blocks};
  }

  // Requests the scales and offsets of rows `ahead` on, which a kernel reads once per group and at the end of its
  // rows: they are a stream of their own, which the hardware prefetcher leaves cold.
  void prefetch_groups(int64_t ahead, int64_t rows) const {
    for (int64_t i = 0; i < rows * groups; i += 16) {
      _mm_prefetch(reinterpret_cast<const char*>(scale + ahead * groups + i), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(offset + ahead * groups + i), _MM_HINT_T0);
    }
  }
};

// Output rows per call for M activation rows: as many as the 16 vector registers hold.
constexpr int rows_for(int M) { return M == 1 ? 4 : M == 2 ? 2 : 1; }

// Row i's offsets times the activations' group sums (gsum of one activation row): sum_g (offset_g + shift scale_g)
// gsum_g, where `shift` is what the kernel took from every integer (128 for 8-bit weights as signed bytes).
inline float row_offsets(const Rows& r, int i, const float* gsum, float shift) {
  const float *offset = r.offset + i * r.groups, *scale = r.scale + i * r.groups;
#if defined(__AVX512F__)
  __m512 off = _mm512_setzero_ps();  // 16 groups a step: a down projection's row has 38
  for (int64_t g = 0; g < r.groups; g += 16) {
    const __mmask16 live = r.groups - g >= 16 ? __mmask16(0xffff) : __mmask16((1u << (r.groups - g)) - 1);
    const __m512 o = _mm512_fmadd_ps(_mm512_set1_ps(shift), _mm512_maskz_loadu_ps(live, scale + g),
                                     _mm512_maskz_loadu_ps(live, offset + g));
    off = _mm512_fmadd_ps(o, _mm512_maskz_loadu_ps(live, gsum + g), off);
  }
  return _mm512_reduce_add_ps(off);
#else
  float off = 0.f;
  for (int64_t g = 0; g < r.groups; ++g) off += (offset[g] + shift * scale[g]) * gsum[g];
  return off;
#endif
}

#if defined(__AVX2__) && defined(__FMA__)
// A block's 32 integers as floats, eight per vector (elements 0-7, 8-15, 16-23, 24-31).
inline void block_floats(const uint8_t* q, int bits, __m256 v[4]) {
  if (bits == 8) {
    for (int k = 0; k < 4; ++k)
      v[k] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * k))));
    return;
  }
  const __m128i w = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q)), mask = _mm_set1_epi8(0x0f);
  const __m128i lo = _mm_and_si128(w, mask), hi = _mm_and_si128(_mm_srli_epi16(w, 4), mask);
  v[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
  v[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
  v[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
  v[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
}

// A block's 32 integers as bytes in element order, for the unsigned-by-signed byte products: 4-bit as they
// are, 8-bit as q - 128 (signed; the offset absorbs the 128).
inline __m256i block_bytes(const uint8_t* q, int bits) {
  if (bits == 8)
    return _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)), _mm256_set1_epi8(char(0x80)));
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q)), mask = _mm_set1_epi8(0x0f);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), mask), _mm_and_si128(v, mask));
}

// The float kernel's vector width: eight lanes (AVX2), a 32-weight block in four vectors.
struct Avx2 {
  using V = __m256;
  static constexpr int kParts = 4, kLanes = 8;
  static V zero() { return _mm256_setzero_ps(); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V broadcast(const float* p) { return _mm256_broadcast_ss(p); }
  static float sum(V v) { return fw::sum8(v); }
  static void block(const uint8_t* q, int bits, V v[kParts]) { block_floats(q, bits, v); }
};

// Per group: the blocks' dot products accumulate unscaled, then one multiply by the group's scale; the offsets
// need only the activations' per-group sums (gsum [M, groups]), added once per row at the end. S: the width.
template <typename S, int M, int R>
void dot_rows_float(const float* x, const float* gsum, const Rows& r, int bits, float* y, int64_t ldy, int64_t K) {
  using V = typename S::V;
  r.prefetch_groups(4 * R, R);
  V acc[M][R];
  for (int m = 0; m < M; ++m)
    for (int i = 0; i < R; ++i) acc[m][i] = S::zero();
  const int64_t bb = bits * 4;
  for (int64_t g = 0, b0 = 0; b0 < r.blocks; ++g, b0 += r.group_blocks) {
    const int64_t b1 = std::min(r.blocks, b0 + r.group_blocks);
    V part[M][R];
    for (int m = 0; m < M; ++m)
      for (int i = 0; i < R; ++i) part[m][i] = S::zero();
    for (int64_t b = b0; b < b1; ++b) {
      for (int i = 0; i < R; ++i) {
        if (b * bb % 64 < bb) fw::prefetch_ahead(r.q + i * r.stride + b * bb);  // once per cache line
        V v[S::kParts];
        S::block(r.q + i * r.stride + b * bb, bits, v);
        for (int m = 0; m < M; ++m) {
          const float* xb = x + m * K + b * kBlock;
          for (int k = 0; k < S::kParts; ++k) part[m][i] = S::fmadd(v[k], S::load(xb + k * S::kLanes), part[m][i]);
        }
      }
    }
    for (int i = 0; i < R; ++i) {
      const V d = S::broadcast(r.scale + i * r.groups + g);
      for (int m = 0; m < M; ++m) acc[m][i] = S::fmadd(part[m][i], d, acc[m][i]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int i = 0; i < R; ++i) y[m * ldy + i] = S::sum(acc[m][i]) + row_offsets(r, i, gsum + m * r.groups, 0.f);
}

template <int M, int R>
void dot_rows(const float* x, const float* gsum, const Rows& r, int bits, float* y, int64_t ldy, int64_t K) {
  dot_rows_float<Avx2, M, R>(x, gsum, r, bits, y, ldy, K);
}

#if defined(__AVX512F__)
// A block's 32 integers as floats, sixteen per vector (elements 0-15, 16-31).
inline void block_floats(const uint8_t* q, int bits, __m512 v[2]) {
  if (bits == 8) {
    for (int k = 0; k < 2; ++k)
      v[k] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * k))));
    return;
  }
  const __m128i w = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q)), mask = _mm_set1_epi8(0x0f);
  v[0] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(w, mask)));
  v[1] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(w, 4), mask)));
}

// Sixteen lanes (int_gemv_wide): half the conversions and multiply-adds a block.
struct Avx512 {
  using V = __m512;
  static constexpr int kParts = 2, kLanes = 16;
  static V zero() { return _mm512_setzero_ps(); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V broadcast(const float* p) { return _mm512_set1_ps(*p); }
  static float sum(V v) { return _mm512_reduce_add_ps(v); }
  static void block(const uint8_t* q, int bits, V v[kParts]) { block_floats(q, bits, v); }
};
#endif

// With int8 activations (llama.cpp's way: each block of x as int8 times one scale dx) a block's integer dot
// product is exact in int32, a few instructions for 32 weights: y += scale_g sum_b dx_b (xq_b . q_b), plus the
// offsets times gsum = sum_b dx_b sum(xq_b) per group.
template <int M, int R>
void dot_rows_a8(const int8_t* xq, const float* dx, const float* gsum, const Rows& r, int bits, float* y,
                 int64_t ldy, int64_t K) {
  r.prefetch_groups(4 * R, R);
  __m256 acc[M][R];
  for (int m = 0; m < M; ++m)
    for (int i = 0; i < R; ++i) acc[m][i] = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1);
  const int64_t bb = bits * 4;
  for (int64_t g = 0, b0 = 0; b0 < r.blocks; ++g, b0 += r.group_blocks) {
    const int64_t b1 = std::min(r.blocks, b0 + r.group_blocks);
    __m256 part[M][R];
    for (int m = 0; m < M; ++m)
      for (int i = 0; i < R; ++i) part[m][i] = _mm256_setzero_ps();
    for (int64_t b = b0; b < b1; ++b) {
      for (int i = 0; i < R; ++i) {
        if (b * bb % 64 < bb) fw::prefetch_ahead(r.q + i * r.stride + b * bb);  // once per cache line
        const __m256i w = block_bytes(r.q + i * r.stride + b * bb, bits);
        const __m256i wabs = bits == 4 ? w : _mm256_sign_epi8(w, w);
        for (int m = 0; m < M; ++m) {
          __m256i xb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + m * K + b * kBlock));
          if (bits == 8) xb = _mm256_sign_epi8(xb, w);  // |w| times x with w's sign: no overflow
          const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(wabs, xb), ones);
          part[m][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_broadcast_ss(dx + m * r.blocks + b), part[m][i]);
        }
      }
    }
    for (int i = 0; i < R; ++i) {
      const __m256 s = _mm256_broadcast_ss(r.scale + i * r.groups + g);
      for (int m = 0; m < M; ++m) acc[m][i] = _mm256_fmadd_ps(part[m][i], s, acc[m][i]);
    }
  }
  const float shift = bits == 8 ? 128.f : 0.f;  // the weights went in as q - 128
  for (int m = 0; m < M; ++m)
    for (int i = 0; i < R; ++i) y[m * ldy + i] = fw::sum8(acc[m][i]) + row_offsets(r, i, gsum + m * r.groups, shift);
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// The VNNI kernels' ends of a group and of their rows: acc += part * scale_g, then each row's sum plus its offsets.
template <int M, int R>
inline void scale_group(__m512 (&acc)[M][R], const __m512 (&part)[M][R], const Rows& r, int64_t g) {
  for (int i = 0; i < R; ++i) {
    const __m512 s = _mm512_set1_ps(r.scale[i * r.groups + g]);
    for (int m = 0; m < M; ++m) acc[m][i] = _mm512_fmadd_ps(part[m][i], s, acc[m][i]);
  }
}

template <int M, int R>
inline void finish_rows(const __m512 (&acc)[M][R], const Rows& r, const float* gsum, float* y, int64_t ldy) {
  for (int m = 0; m < M; ++m)
    for (int i = 0; i < R; ++i)
      y[m * ldy + i] = _mm512_reduce_add_ps(acc[m][i]) + row_offsets(r, i, gsum + m * r.groups, 0.f);
}

// dot_rows_a8 two blocks at a time in 512-bit vpdpbusd (AVX-512 VNNI: 64 byte products an instruction, against
// maddubs' 32 and a second multiply-add), for int_gemv_a8_wide. The activations come laid out once per call in the
// order the weights' bytes take (paired_activations), so a pair of 4-bit blocks becomes its 64 unsigned bytes in
// two instructions: its 32 bytes in both halves of a vector, the upper half shifted by 4, and the nibble mask.
// Lanes (128-bit): the low nibbles of block b and of b + 1, then their high nibbles (8-bit weights: b, then b + 1,
// in element order). xw: 64 bytes a pair and row; dw: each int32 lane's activation scale, 16 floats a pair; a
// group's last block without a partner has zeros in its partner's place.
template <int M, int R>
void dot_rows_a8_wide(const int8_t* xw, const float* dw, int64_t pairs, const float* gsum, const Rows& r, int bits,
                      float* y, int64_t ldy) {
  r.prefetch_groups(4 * R, R);
  __m512 acc[M][R];
  for (int m = 0; m < M; ++m)
    for (int i = 0; i < R; ++i) acc[m][i] = _mm512_setzero_ps();
  const __m512i mask = _mm512_set1_epi8(0x0f);
  const __m512i shift = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);  // upper half by 4
  const int64_t bb = bits * 4;
  int64_t p = 0;
  for (int64_t g = 0, b0 = 0; b0 < r.blocks; ++g, b0 += r.group_blocks) {
    const int64_t b1 = std::min(r.blocks, b0 + r.group_blocks);
    __m512 part[M][R];
    for (int m = 0; m < M; ++m)
      for (int i = 0; i < R; ++i) part[m][i] = _mm512_setzero_ps();
    for (int64_t b = b0; b < b1; b += 2, ++p) {
      const bool pair = b + 1 < b1;
      __m512i xb[M];
      __m512 d[M];
      for (int m = 0; m < M; ++m) {
        xb[m] = _mm512_loadu_si512(xw + (m * pairs + p) * 64);
        d[m] = _mm512_loadu_ps(dw + (m * pairs + p) * 16);
      }
      for (int i = 0; i < R; ++i) {
        const uint8_t* blk = r.q + i * r.stride + b * bb;
        fw::prefetch_far_and_near(blk);
        __m512i w;
        if (bits == 8) {
          w = pair ? _mm512_loadu_si512(blk)
                   : _mm512_zextsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk)));
        } else {
          const __m512i both = pair ? _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk)))
                                    : _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk)));
          w = _mm512_and_si512(_mm512_srlv_epi16(both, shift), mask);
        }
        for (int m = 0; m < M; ++m)
          part[m][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), w, xb[m])), d[m],
                                       part[m][i]);
      }
    }
    scale_group<M, R>(acc, part, r, g);
  }
  finish_rows<M, R>(acc, r, gsum, y, ldy);
}

// x's int8 blocks (xq [M, K], scales dx [M, blocks]) in dot_rows_a8_wide's order: per row, the pairs of each group
// in turn. Returns the number of pairs a row.
int64_t paired_activations(const int8_t* xq, const float* dx, int64_t M, int64_t K, int64_t group_blocks, int bits,
                           std::vector<int8_t>& xw, std::vector<float>& dw) {
  const int64_t blocks = K / kBlock;
  int64_t pairs = 0;
  for (int64_t b0 = 0; b0 < blocks; b0 += group_blocks) pairs += (std::min(blocks - b0, group_blocks) + 1) / 2;
  xw.assign(M * pairs * 64, 0);
  dw.assign(M * pairs * 16, 0.f);
  for (int64_t m = 0; m < M; ++m) {
    int64_t p = 0;
    for (int64_t b0 = 0; b0 < blocks; b0 += group_blocks)
      for (int64_t b = b0, b1 = std::min(blocks, b0 + group_blocks); b < b1; b += 2, ++p) {
        int8_t* out = xw.data() + (m * pairs + p) * 64;
        float* d = dw.data() + (m * pairs + p) * 16;
        for (int64_t h = 0; h < 2 && b + h < b1; ++h) {
          const int8_t* in = xq + m * K + (b + h) * kBlock;
          if (bits == 8) {
            std::memcpy(out + 32 * h, in, kBlock);
            std::fill(d + 8 * h, d + 8 * h + 8, dx[m * blocks + b + h]);
          } else {  // elements 0-15 to lane h, 16-31 to lane h + 2
            std::memcpy(out + 16 * h, in, 16);
            std::memcpy(out + 32 + 16 * h, in + 16, 16);
            std::fill(d + 4 * h, d + 4 * h + 4, dx[m * blocks + b + h]);
            std::fill(d + 8 + 4 * h, d + 12 + 4 * h, dx[m * blocks + b + h]);
          }
        }
      }
  }
  return pairs;
}

// 4-bit weights four blocks (64 bytes, the nibbles in place) a step, where each group is whole steps (group and K
// multiples of 128): a pair of dot_rows_a8_wide's takes a shift, a mask, a product, a conversion and a multiply-add
// for 32 bytes; here 64 bytes take two masks and a shift, two products, one conversion and one multiply-add. The
// high nibbles are masked in place (16 n) and the low ones shifted up to match, so the int32 lanes hold 16 times
// the dot products (at most 2 x 4 x 240 x 128: exact in float32) and the activation scales come divided by 16
// (exact: a power of two). 128-bit lane l holds block 4v + l. One row, Qwen2-0.5B's 96 layers streamed, AMX Xeon:
// 11.8-12.5 -> 11.2-11.8 ms; in cache (one layer a shape) 0.29-0.31 -> 0.24-0.29 ms; two rows 12.0-12.6 -> 10.4.
template <int M, int R>
void dot_rows_a8_quad(const int8_t* xw, const float* dw, int64_t quads, const float* gsum, const Rows& r, int /*bits*/,
                      float* y, int64_t ldy) {
  r.prefetch_groups(4 * R, R);
  __m512 acc[M][R];
  for (int m = 0; m < M; ++m)
    for (int i = 0; i < R; ++i) acc[m][i] = _mm512_setzero_ps();
  const __m512i high = _mm512_set1_epi8(char(0xf0));
  const int64_t per_group = r.group_blocks / 4;
  for (int64_t g = 0, v = 0; v < quads; ++g) {
    __m512 part[M][R];
    for (int m = 0; m < M; ++m)
      for (int i = 0; i < R; ++i) part[m][i] = _mm512_setzero_ps();
    for (const int64_t end = std::min(quads, v + per_group); v < end; ++v) {
      __m512i lo_x[M], hi_x[M];
      __m512 d[M];
      for (int m = 0; m < M; ++m) {
        lo_x[m] = _mm512_loadu_si512(xw + (m * quads + v) * 128);
        hi_x[m] = _mm512_loadu_si512(xw + (m * quads + v) * 128 + 64);
        d[m] = _mm512_loadu_ps(dw + (m * quads + v) * 16);
      }
      for (int i = 0; i < R; ++i) {
        const uint8_t* blk = r.q + i * r.stride + v * 64;
        fw::prefetch_far_and_near(blk);
        const __m512i w = _mm512_loadu_si512(blk);
        const __m512i lo = _mm512_and_si512(_mm512_slli_epi16(w, 4), high), hi = _mm512_and_si512(w, high);
        for (int m = 0; m < M; ++m) {
          const __m512i t = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, lo_x[m]), hi, hi_x[m]);
          part[m][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), d[m], part[m][i]);
        }
      }
    }
    scale_group<M, R>(acc, part, r, g);
  }
  finish_rows<M, R>(acc, r, gsum, y, ldy);
}

// x's int8 blocks in dot_rows_a8_quad's order: per row and step of four blocks, 64 bytes of their elements 0-15
// (block 4v + l in lane l), 64 of their elements 16-31, and 16 scales (each block's dx / 16, four lanes each).
// Returns the number of steps a row.
int64_t quad_activations(const int8_t* xq, const float* dx, int64_t M, int64_t K, std::vector<int8_t>& xw,
                         std::vector<float>& dw) {
  const int64_t blocks = K / kBlock, quads = blocks / 4;
  xw.resize(M * quads * 128);
  dw.resize(M * quads * 16);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t v = m * quads + b / 4, l = b % 4;
      std::memcpy(xw.data() + v * 128 + 16 * l, xq + m * K + b * kBlock, 16);
      std::memcpy(xw.data() + v * 128 + 64 + 16 * l, xq + m * K + b * kBlock + 16, 16);
      std::fill_n(dw.data() + v * 16 + 4 * l, 4, dx[m * blocks + b] / 16.f);
    }
  return quads;
}
#endif
#else
// Without AVX2: the same sums, one weight at a time. A8: the activations are int8 blocks (xq, scales dx) and 8-bit
// weights go in as q - 128, as in the vector kernel.
template <int M, int R, bool A8>
void scalar_rows(const float* x, const int8_t* xq, const float* dx, const float* gsum, const Rows& r, int bits,
                 float* y, int64_t ldy, int64_t K) {
  const float shift = A8 && bits == 8 ? 128.f : 0.f;
  for (int i = 0; i < R; ++i) {
    float acc[M] = {0.f};
    for (int64_t b = 0; b < r.blocks; ++b) {
      const uint8_t* blk = r.q + i * r.stride + b * bits * 4;
      float q[kBlock];
      for (int j = 0; j < 16; ++j) {
        q[j] = (bits == 8 ? blk[j] : (blk[j] & 0x0f)) - shift;
        q[j + 16] = (bits == 8 ? blk[j + 16] : (blk[j] >> 4)) - shift;
      }
      const float s = r.scale[i * r.groups + b / r.group_blocks];
      for (int m = 0; m < M; ++m) {
        float dot = 0.f;  // exact for int8 activations: at most 32 x 255 x 127
        for (int j = 0; j < kBlock; ++j) dot += q[j] * (A8 ? xq[m * K + b * kBlock + j] : x[m * K + b * kBlock + j]);
        acc[m] += (A8 ? dx[m * r.blocks + b] : 1.f) * s * dot;
      }
    }
    for (int m = 0; m < M; ++m) y[m * ldy + i] = acc[m] + row_offsets(r, i, gsum + m * r.groups, shift);
  }
}

template <int M, int R>
void dot_rows(const float* x, const float* gsum, const Rows& r, int bits, float* y, int64_t ldy, int64_t K) {
  scalar_rows<M, R, false>(x, nullptr, nullptr, gsum, r, bits, y, ldy, K);
}

template <int M, int R>
void dot_rows_a8(const int8_t* xq, const float* dx, const float* gsum, const Rows& r, int bits, float* y,
                 int64_t ldy, int64_t K) {
  scalar_rows<M, R, true>(nullptr, xq, dx, gsum, r, bits, y, ldy, K);
}
#endif

// kernel(m, rows, n, many) for every tile: activation rows m .. m + rows (at most kMaxRows, so that the
// accumulators stay in registers) and output rows from n, rows_for(rows) of them when `many`, else one; in
// parallel over the output rows.
template <typename Kernel>
void tiles(int64_t M, int64_t N, const Kernel& kernel) {
  for (int64_t m = 0; m < M; m += kMaxRows) {
    const int rows = static_cast<int>(std::min(kMaxRows, M - m)), R = rows_for(rows);
    at::parallel_for(0, (N + R - 1) / R, std::max(1, 16 / R), [&](int64_t begin, int64_t end) {
      for (int64_t c = begin; c < end; ++c) {
        const int64_t n = c * R;
        if (n + R <= N) kernel(m, rows, n, true);
        else for (int64_t k = n; k < N; ++k) kernel(m, rows, k, false);
      }
    });
  }
}

void check_weight(const at::Tensor& q, const at::Tensor& scale, const at::Tensor& offset, int64_t K, int64_t bits,
                  int64_t group) {
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8");
  TORCH_CHECK(K % kBlock == 0 && group % kBlock == 0, "K and group must be multiples of 32");
  TORCH_CHECK(q.scalar_type() == at::kByte && q.is_contiguous() && q.size(1) == K * bits / 8, "q must be [N, K*bits/8]");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && offset.scalar_type() == at::kFloat && scale.is_contiguous() &&
                  offset.is_contiguous() && scale.sizes() == offset.sizes() && scale.size(0) == q.size(0) &&
                  scale.size(1) == (K + group - 1) / group,
              "scale and offset must be float32 [N, ceil(K / group)]");
}

// The float kernels of one width: `one` output row at a time, or `many` (rows_for(M)).
template <bool Wide>
struct Kernels {
  template <int M>
  static void one(const float* x, const float* gsum, const Rows& r, int bits, float* y, int64_t ldy, int64_t K) {
    dot_rows<M, 1>(x, gsum, r, bits, y, ldy, K);
  }
  template <int M>
  static void many(const float* x, const float* gsum, const Rows& r, int bits, float* y, int64_t ldy, int64_t K) {
    dot_rows<M, rows_for(M)>(x, gsum, r, bits, y, ldy, K);
  }
};
#if defined(__AVX512F__)
template <>
struct Kernels<true> {
  template <int M>
  static void one(const float* x, const float* gsum, const Rows& r, int bits, float* y, int64_t ldy, int64_t K) {
    dot_rows_float<Avx512, M, 1>(x, gsum, r, bits, y, ldy, K);
  }
  template <int M>
  static void many(const float* x, const float* gsum, const Rows& r, int bits, float* y, int64_t ldy, int64_t K) {
    dot_rows_float<Avx512, M, rows_for(M)>(x, gsum, r, bits, y, ldy, K);
  }
};
#endif

// x [M, K] (K a multiple of 32), q uint8 [N, K * bits / 8], scale and offset float32 [N, groups] with
// `group` (a multiple of 32) input features each. Returns x.dtype [M, N].
template <bool Wide>
at::Tensor int_gemv_impl(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale, const at::Tensor& offset,
                    int64_t bits, int64_t group) {
  TORCH_CHECK(x.dim() == 2, "x must be [rows, K]");
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0), G = scale.size(1);
  check_weight(q, scale, offset, K, bits, group);
  auto xf = x.to(at::kFloat).contiguous();
  auto gsum = at::zeros({M, G}, xf.options());  // each row's sum over each group
  const float* xp = xf.data_ptr<float>();
  float* gp = gsum.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) gp[m * G + k / group] += xp[m * K + k];
  auto y = at::empty({M, N}, xf.options());
  using Fn = void (*)(const float*, const float*, const Rows&, int, float*, int64_t, int64_t);
#if defined(__AVX512F__)
  static constexpr bool kWide = Wide;
#else
  static constexpr bool kWide = false;
  TORCH_CHECK(!Wide, "int_gemv_wide: built without AVX-512 (has_wide() is false)");
#endif
  static constexpr Fn kOne[kMaxRows] = {Kernels<kWide>::template one<1>, Kernels<kWide>::template one<2>,
                                        Kernels<kWide>::template one<3>, Kernels<kWide>::template one<4>,
                                        Kernels<kWide>::template one<5>, Kernels<kWide>::template one<6>,
                                        Kernels<kWide>::template one<7>, Kernels<kWide>::template one<8>};
  static constexpr Fn kMany[kMaxRows] = {Kernels<kWide>::template many<1>, Kernels<kWide>::template many<2>,
                                         Kernels<kWide>::template one<3>, Kernels<kWide>::template one<4>,
                                         Kernels<kWide>::template one<5>, Kernels<kWide>::template one<6>,
                                         Kernels<kWide>::template one<7>, Kernels<kWide>::template one<8>};
  float* yp = y.data_ptr<float>();
  const Rows weight = Rows::of(q, scale, offset, K, group);
  tiles(M, N, [&](int64_t m, int rows, int64_t n, bool many) {
    const Rows r = weight.from(n);
    (many ? kMany : kOne)[rows - 1](xp + m * K, gp + m * G, r, static_cast<int>(bits), yp + m * N + n, N, K);
  });
  return y.to(x.scalar_type());
}

at::Tensor int_gemv(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale, const at::Tensor& offset,
                    int64_t bits, int64_t group) {
  return int_gemv_impl<false>(x, q, scale, offset, bits, group);
}

// int_gemv in 512-bit vectors where the build has AVX-512: a candidate of its own, since a 512-bit kernel that
// wins on one CPU may lose on another.
at::Tensor int_gemv_wide(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale, const at::Tensor& offset,
                         int64_t bits, int64_t group) {
  return int_gemv_impl<true>(x, q, scale, offset, bits, group);
}

bool has_wide() {
#if defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// int_gemv_wide's products in bf16 pairs (AVX512-BF16 vdpbf16ps), for bf16 activations and 4-bit weights: a nibble
// n becomes the bf16 word 0x43nn, which is exactly 128 + n, so two byte interleaves turn a pair of blocks into their
// 64 weights and two instructions multiply them by x, exactly, accumulating in float32 (the offsets take the 128
// back: shift -128 in row_offsets). Against the float kernel: a third of the instructions a byte, and no int-to-float
// conversions. Nibbles as the pairs' kernel lays them (dot_rows_a8_wide); xw: 64 bf16 a pair and row in their order
// after the interleaves (int_gemv_dpbf16 lays them out): elements 0-7 of both blocks and 16-23 of both, then 8-15
// and 24-31.
template <int M, int R>
void dot_rows_dpbf16(const uint16_t* xw, int64_t pairs, const float* gsum, const Rows& r, float* y, int64_t ldy) {
  constexpr int C = M * R <= 4 ? 2 : 1;  // accumulator chains a row: two where the registers allow
  r.prefetch_groups(4 * R, R);
  __m512 acc[M][R];
  for (int m = 0; m < M; ++m)
    for (int i = 0; i < R; ++i) acc[m][i] = _mm512_setzero_ps();
  const __m512i mask = _mm512_set1_epi8(0x0f), high = _mm512_set1_epi8(0x43);
  const __m512i shift = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);  // upper half by 4
  const int64_t per_group = r.group_blocks / 2;
  for (int64_t g = 0, p = 0; p < pairs; ++g) {
    __m512 part[M][R][C];
    for (int m = 0; m < M; ++m)
      for (int i = 0; i < R; ++i)
        for (int c = 0; c < C; ++c) part[m][i][c] = _mm512_setzero_ps();
    for (const int64_t end = std::min(pairs, p + per_group); p < end; ++p) {
      __m512bh lo_x[M], hi_x[M];
      for (int m = 0; m < M; ++m) {
        lo_x[m] = (__m512bh)_mm512_loadu_si512(xw + (m * pairs + p) * 64);
        hi_x[m] = (__m512bh)_mm512_loadu_si512(xw + (m * pairs + p) * 64 + 32);
      }
      for (int i = 0; i < R; ++i) {
        const uint8_t* blk = r.q + i * r.stride + p * 32;
        fw::prefetch_far_and_near(blk);
        const __m512i both = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk)));
        const __m512i nib = _mm512_and_si512(_mm512_srlv_epi16(both, shift), mask);
        const __m512bh lo = (__m512bh)_mm512_unpacklo_epi8(nib, high), hi = (__m512bh)_mm512_unpackhi_epi8(nib, high);
        for (int m = 0; m < M; ++m) {
          part[m][i][0] = _mm512_dpbf16_ps(part[m][i][0], lo, lo_x[m]);
          part[m][i][C - 1] = _mm512_dpbf16_ps(part[m][i][C - 1], hi, hi_x[m]);
        }
      }
    }
    for (int i = 0; i < R; ++i) {
      const __m512 s = _mm512_set1_ps(r.scale[i * r.groups + g]);
      for (int m = 0; m < M; ++m)
        acc[m][i] = _mm512_fmadd_ps(C == 2 ? _mm512_add_ps(part[m][i][0], part[m][i][C - 1]) : part[m][i][0], s,
                                    acc[m][i]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int i = 0; i < R; ++i)
      y[m * ldy + i] = _mm512_reduce_add_ps(acc[m][i]) + row_offsets(r, i, gsum + m * r.groups, -128.f);
}
#endif

// int_gemv_wide through dot_rows_dpbf16: x bf16 [M, K], 4-bit weights in groups of a multiple of 64 (a pair of blocks
// never straddles two groups), K a multiple of 64. The same sums as int_gemv_wide, in another order; float32
// (float_out: an LM head's logits) or bf16, the bias added (fw::Outputs: no extra ops a call).
at::Tensor int_gemv_dpbf16(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale, const at::Tensor& offset,
                           int64_t bits, int64_t group, const c10::optional<at::Tensor>& bias, bool float_out) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "x must be bfloat16 [rows, K]");
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0), G = scale.size(1), pairs = K / 64;
  check_weight(q, scale, offset, K, bits, group);
  TORCH_CHECK(bits == 4 && group % 64 == 0 && K % 64 == 0,
              "int_gemv_dpbf16 takes 4-bit weights, group and K multiples of 64");
  const auto xc = x.contiguous();
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr());
  std::vector<uint16_t> xw(M * K);
  std::vector<float> gsum(M * G, 0.f);  // each row's sum over each group, for the offsets
  // Words from the first block (in[0..31]) or, index bit 5, the second (in[32..63]) of a pair
  static constexpr uint16_t kLoOrder[32] = {0,  1,  2,  3,  4,  5,  6,  7,  32, 33, 34, 35, 36, 37, 38, 39,
                                            16, 17, 18, 19, 20, 21, 22, 23, 48, 49, 50, 51, 52, 53, 54, 55};
  const __m512i lo_order = _mm512_loadu_si512(kLoOrder);
  const __m512i hi_order = _mm512_add_epi16(lo_order, _mm512_set1_epi16(8));
  for (int64_t m = 0; m < M; ++m)
    for (int64_t p = 0; p < pairs; ++p) {
      const uint16_t* in = xp + m * K + p * 64;
      uint16_t* out = xw.data() + (m * pairs + p) * 64;
      const __m512i first = _mm512_loadu_si512(in), second = _mm512_loadu_si512(in + 32);
      _mm512_storeu_si512(out, _mm512_permutex2var_epi16(first, lo_order, second));
      _mm512_storeu_si512(out + 32, _mm512_permutex2var_epi16(first, hi_order, second));
      __m512 sum = _mm512_setzero_ps();
      for (int j = 0; j < 64; j += 16)
        sum = _mm512_add_ps(sum, fw::load_bf16x16(reinterpret_cast<const fw::bf16*>(in + j)));
      gsum[m * G + p * 64 / group] += _mm512_reduce_add_ps(sum);
    }
  const fw::Outputs out(x, M, N, float_out ? at::kFloat : at::kBFloat16, bias);
  using Fn = void (*)(const uint16_t*, int64_t, const float*, const Rows&, float*, int64_t);
  static constexpr Fn kOne[kMaxRows] = {dot_rows_dpbf16<1, 1>, dot_rows_dpbf16<2, 1>, dot_rows_dpbf16<3, 1>,
                                        dot_rows_dpbf16<4, 1>, dot_rows_dpbf16<5, 1>, dot_rows_dpbf16<6, 1>,
                                        dot_rows_dpbf16<7, 1>, dot_rows_dpbf16<8, 1>};
  static constexpr Fn kMany[kMaxRows] = {dot_rows_dpbf16<1, rows_for(1)>, dot_rows_dpbf16<2, rows_for(2)>,
                                         dot_rows_dpbf16<3, 1>, dot_rows_dpbf16<4, 1>, dot_rows_dpbf16<5, 1>,
                                         dot_rows_dpbf16<6, 1>, dot_rows_dpbf16<7, 1>, dot_rows_dpbf16<8, 1>};
  const Rows weight = Rows::of(q, scale, offset, K, group);
  tiles(M, N, [&](int64_t m, int rows, int64_t n, bool many) {
    const int R = many ? rows_for(rows) : 1;
    float y[kMaxRows * 4];  // the tile's rows x R sums
    (many ? kMany : kOne)[rows - 1](xw.data() + m * K, pairs, gsum.data() + m * G, weight.from(n), y, R);
    for (int r = 0; r < rows; ++r)
      for (int i = 0; i < R; ++i) out.put(m + r, n + i, y[r * R + i]);
  });
  return out.y;
#else
  TORCH_CHECK(false, "int_gemv_dpbf16: built without AVX512-BF16 (has_dpbf16() is false)");
#endif
}

bool has_dpbf16() {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  return true;
#else
  return false;
#endif
}

// x rounded to int8 blocks: each block of 32 values times dx = absmax / 127, the integers rounded half to even
// (fw.sdk.linear.int_block_rounded is the same rounding in torch), and per row and group the sum over its blocks of
// dx times sum(xq), for the offsets.
struct IntBlocks {
  at::Tensor xq, dx, gsum;
};

IntBlocks int_blocks(const at::Tensor& x, int64_t group, int64_t G) {
  TORCH_CHECK(x.dim() == 2, "x must be [rows, K]");
  const int64_t M = x.size(0), K = x.size(1), blocks = K / kBlock;
  auto xf = x.to(at::kFloat).contiguous();
  IntBlocks out{at::empty({M, K}, xf.options().dtype(at::kChar)), at::empty({M, blocks}, xf.options()),
                at::zeros({M, G}, xf.options())};
  const float* xp = xf.data_ptr<float>();
  int8_t* qp = out.xq.data_ptr<int8_t>();
  float *dp = out.dx.data_ptr<float>(), *gp = out.gsum.data_ptr<float>();
  for (int64_t mb = 0; mb < M * blocks; ++mb) {
    const float* xb = xp + mb * kBlock;
    int8_t* qb = qp + mb * kBlock;
#if defined(__AVX512F__)
    // The same rounding 16 values an instruction: an IEEE division, then to nearest even
    const __m512 lo = _mm512_loadu_ps(xb), hi = _mm512_loadu_ps(xb + 16);
    const float d = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi))) / 127.f;
    const __m512 div = _mm512_set1_ps(d > 0.f ? d : 1.f), top = _mm512_set1_ps(127.f), bottom = _mm512_set1_ps(-127.f);
    auto round = [&](__m512 v) {
      const __m512 r = _mm512_roundscale_ps(_mm512_div_ps(v, div), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      return _mm512_cvtps_epi32(_mm512_min_ps(top, _mm512_max_ps(bottom, r)));
    };
    const __m512i q0 = round(lo), q1 = round(hi);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(qb), _mm512_cvtsepi32_epi8(q0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(qb + 16), _mm512_cvtsepi32_epi8(q1));
    const int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
#else
    float amax = 0.f;
    for (int64_t j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(xb[j]));
    const float d = amax / 127.f, div = d > 0.f ? d : 1.f;
    int32_t sum = 0;
    for (int64_t j = 0; j < kBlock; ++j) {
      qb[j] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, std::nearbyint(xb[j] / div))));
      sum += qb[j];
    }
#endif
    dp[mb] = d;
    gp[(mb / blocks) * G + (mb % blocks) * kBlock / group] += d * sum;
  }
  return out;
}

// As int_gemv, with x rounded to int8 blocks first (int_blocks).
at::Tensor int_gemv_a8(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale, const at::Tensor& offset,
                       int64_t bits, int64_t group) {
  const int64_t K = x.size(-1), N = q.size(0), G = scale.size(1), blocks = K / kBlock;
  check_weight(q, scale, offset, K, bits, group);
  const IntBlocks a = int_blocks(x, group, G);
  const int64_t M = a.xq.size(0);
  auto y = at::empty({M, N}, a.dx.options());
  using Fn = void (*)(const int8_t*, const float*, const float*, const Rows&, int, float*, int64_t, int64_t);
  static constexpr Fn kOne[kMaxRows] = {dot_rows_a8<1, 1>, dot_rows_a8<2, 1>, dot_rows_a8<3, 1>, dot_rows_a8<4, 1>,
                                        dot_rows_a8<5, 1>, dot_rows_a8<6, 1>, dot_rows_a8<7, 1>, dot_rows_a8<8, 1>};
  static constexpr Fn kMany[kMaxRows] = {dot_rows_a8<1, rows_for(1)>, dot_rows_a8<2, rows_for(2)>, dot_rows_a8<3, 1>,
                                         dot_rows_a8<4, 1>, dot_rows_a8<5, 1>, dot_rows_a8<6, 1>, dot_rows_a8<7, 1>,
                                         dot_rows_a8<8, 1>};
  const int8_t* qp = a.xq.data_ptr<int8_t>();
  const float *dp = a.dx.data_ptr<float>(), *gp = a.gsum.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const Rows weight = Rows::of(q, scale, offset, K, group);
  tiles(M, N, [&](int64_t m, int rows, int64_t n, bool many) {
    const Rows r = weight.from(n);
    (many ? kMany : kOne)[rows - 1](qp + m * K, dp + m * blocks, gp + m * G, r, static_cast<int>(bits),
                                    yp + m * N + n, N, K);
  });
  return y.to(x.scalar_type());
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// int_gemv_a8 through one of the VNNI kernels: x laid out by `layout` (64 or 128 bytes of xw and 16 scales of dw a
// step, `units` steps a row), then dot_rows_a8_wide or dot_rows_a8_quad (Kernel<M, R>) over every tile.
template <int64_t kBytes, template <int, int> class Kernel, typename Layout>
at::Tensor a8_vnni(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale, const at::Tensor& offset,
                   int64_t bits, int64_t group, const Layout& layout) {
  const int64_t K = x.size(-1), N = q.size(0), G = scale.size(1);
  const IntBlocks a = int_blocks(x, group, G);
  const int64_t M = a.xq.size(0);
  std::vector<int8_t> xw;
  std::vector<float> dw;
  const int64_t units = layout(a.xq.data_ptr<int8_t>(), a.dx.data_ptr<float>(), M, K, xw, dw);
  auto y = at::empty({M, N}, a.dx.options());
  using Fn = void (*)(const int8_t*, const float*, int64_t, const float*, const Rows&, int, float*, int64_t);
  static constexpr Fn kOne[kMaxRows] = {Kernel<1, 1>::run, Kernel<2, 1>::run, Kernel<3, 1>::run, Kernel<4, 1>::run,
                                        Kernel<5, 1>::run, Kernel<6, 1>::run, Kernel<7, 1>::run, Kernel<8, 1>::run};
  static constexpr Fn kMany[kMaxRows] = {Kernel<1, rows_for(1)>::run, Kernel<2, rows_for(2)>::run, Kernel<3, 1>::run,
                                         Kernel<4, 1>::run, Kernel<5, 1>::run, Kernel<6, 1>::run, Kernel<7, 1>::run,
                                         Kernel<8, 1>::run};
  const float* gp = a.gsum.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const Rows weight = Rows::of(q, scale, offset, K, group);
  tiles(M, N, [&](int64_t m, int rows, int64_t n, bool many) {
    (many ? kMany : kOne)[rows - 1](xw.data() + m * units * kBytes, dw.data() + m * units * 16, units, gp + m * G,
                                    weight.from(n), static_cast<int>(bits), yp + m * N + n, N);
  });
  return y.to(x.scalar_type());
}

template <int M, int R>
struct Wide {
  static constexpr auto run = dot_rows_a8_wide<M, R>;
};
template <int M, int R>
struct Quad {
  static constexpr auto run = dot_rows_a8_quad<M, R>;
};
#endif

// int_gemv_a8 in 512-bit VNNI products where the build has them: its own candidate, as int_gemv_wide is. 4-bit
// weights in groups of whole 128s take the four-block kernel, the others the pairs'.
at::Tensor int_gemv_a8_wide(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                            const at::Tensor& offset, int64_t bits, int64_t group) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  const int64_t K = x.size(-1);
  check_weight(q, scale, offset, K, bits, group);
  if (bits == 4 && group % 128 == 0 && K % 128 == 0)
    return a8_vnni<128, Quad>(x, q, scale, offset, bits, group, quad_activations);
  const auto pairs = [&](const int8_t* xq, const float* dx, int64_t M, int64_t K_, std::vector<int8_t>& xw,
                         std::vector<float>& dw) {
    return paired_activations(xq, dx, M, K_, group / kBlock, static_cast<int>(bits), xw, dw);
  };
  return a8_vnni<64, Wide>(x, q, scale, offset, bits, group, pairs);
#else
  TORCH_CHECK(false, "int_gemv_a8_wide: built without AVX-512 VNNI (has_wide_a8() is false)");
#endif
}

bool has_wide_a8() {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  return true;
#else
  return false;
#endif
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
// 64 input features of one row, 4-bit (two blocks) or 8-bit, as bf16 in order: integers below 256 are exact.
inline void widen_ints(const uint8_t* p, int bits, __m512i& first, __m512i& second) {
  __m128i v[4];
  if (bits == 8) {
    for (int i = 0; i < 4; ++i) v[i] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * i));
  } else {
    const __m128i mask = _mm_set1_epi8(0x0f);
    for (int b = 0; b < 2; ++b) {
      const __m128i w = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * b));
      v[2 * b] = _mm_and_si128(w, mask), v[2 * b + 1] = _mm_and_si128(_mm_srli_epi16(w, 4), mask);
    }
  }
  __m512 f[4];
  for (int i = 0; i < 4; ++i) f[i] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(v[i]));
  first = (__m512i)_mm512_cvtne2ps_pbh(f[1], f[0]);
  second = (__m512i)_mm512_cvtne2ps_pbh(f[3], f[2]);
}
#endif

// Prompts and batches through AMX bf16 tiles (float activations in bf16). Each 32 output rows' integers are widened
// once per call, exactly, into tile layout; every 32-row tile of x runs against them a group at a time, and each
// group's float32 sums are scaled into an accumulator (the scale changes every group); the offsets come from x's
// group sums, as int_gemv's. x bf16 [M, K] (K a multiple of 64, group of 32), N a multiple of 16. Returns bf16 with
// the bias (fw::Outputs).
at::Tensor int_gemm_amx(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale, const at::Tensor& offset,
                        int64_t bits, int64_t group, const c10::optional<at::Tensor>& bias) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
  constexpr int64_t kRowTile = 32, kCols = 16;
  TORCH_CHECK(fw::amx_permitted(), "int_gemm_amx: the kernel did not grant AMX tiles to this process");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "x must be bfloat16 [rows, K]");
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0), G = scale.size(1);
  check_weight(q, scale, offset, K, bits, group);
  TORCH_CHECK(N % kCols == 0 && K % 64 == 0, "int_gemm_amx takes N a multiple of 16 and K of 64");
  const int64_t Mp = (M + kRowTile - 1) / kRowTile * kRowTile, blocks = N / kCols, stride = q.size(1);
  const auto xp = Mp == M ? x.contiguous() : at::constant_pad_nd(x, {0, 0, 0, Mp - M});
  // offsets: sum_g offset[n, g] gsum[m, g], one float32 product for the whole call
  const auto xf = x.to(at::kFloat);
  const auto gsum = at::constant_pad_nd(xf, {0, G * group - K}).view({M, G, group}).sum(-1);
  const auto offsets = at::mm(gsum, offset.t()).contiguous();  // [M, N]
  const auto scale_t = scale.t().contiguous();                  // [G, N]: 16 columns' scales of a group in a row
  const float* op = offsets.data_ptr<float>();
  const float* st = scale_t.data_ptr<float>();
  const fw::bf16* xb = reinterpret_cast<const fw::bf16*>(xp.data_ptr());
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const fw::Outputs out(x, M, N, at::kBFloat16, bias);
  at::parallel_for(0, (blocks + 1) / 2, 1, [&](int64_t begin, int64_t end) {
    fw::configure_tiles();  // C 0-3, A 4-5, B 6-7
    std::vector<uint32_t> tiles(K * kCols);  // the pair's two blocks, K / 2 pairs x 16 columns each
    alignas(64) float buf[16 * kCols], acc[4][16 * kCols];
    for (int64_t g0 = begin; g0 < end; ++g0) {
      const int64_t j = 2 * g0;
      const bool two = j + 1 < blocks;
      for (int64_t b = 0; b < (two ? 2 : 1); ++b) {
        const uint8_t* rows = qp + (j + b) * kCols * stride;
        fw::widen_tiles(K, [&](int c, int64_t k0, __m512i& lo, __m512i& hi) {
          widen_ints(rows + c * stride + k0 * bits / 8, static_cast<int>(bits), lo, hi);
        }, tiles.data() + b * K / 2 * kCols);
      }
      const uint32_t* w0 = tiles.data();
      const uint32_t* w1 = w0 + K / 2 * kCols;
      for (int64_t m = 0; m < Mp; m += kRowTile) {
        std::fill(&acc[0][0], &acc[0][0] + 4 * 16 * kCols, 0.f);
        const fw::bf16* xm = xb + m * K;
        for (int64_t g = 0; g < G; ++g) {
          const int64_t k1 = std::min(K, (g + 1) * group);
          _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
          fw::amx_bf16_steps(xm, K, w0, two ? w1 : nullptr, g * group, k1);
          for (int t = 0; t < (two ? 4 : 2); ++t) {  // acc[t]: rows m + 16 (t % 2) of block j + t / 2
            fw::store_c_tile(t % 2 * 2 + t / 2, buf);  // C tile 0, 2, 1, 3
            const __m512 sc = _mm512_loadu_ps(st + g * N + (j + t / 2) * kCols);
            for (int r = 0; r < 16; ++r)
              _mm512_store_ps(acc[t] + r * kCols,
                              _mm512_fmadd_ps(_mm512_load_ps(buf + r * kCols), sc, _mm512_load_ps(acc[t] + r * kCols)));
          }
        }
        for (int t = 0; t < (two ? 4 : 2); ++t) {
          const int64_t row0 = m + 16 * (t % 2), col0 = (j + t / 2) * kCols;
          for (int64_t r = 0; r < 16 && row0 + r < M; ++r)
            out.put16(row0 + r, col0,
                      _mm512_add_ps(_mm512_load_ps(acc[t] + r * kCols), _mm512_loadu_ps(op + (row0 + r) * N + col0)));
        }
      }
    }
    _tile_release();
  });
  return out.y;
#else
  TORCH_CHECK(false, "int_gemm_amx: built without AMX-BF16 (amx_supported() is false)");
#endif
}

// Prompts and batches on CPUs with AVX512-BF16 (without AMX too), through fw::pair_linear: each 16 output rows'
// weights dequantized (q * scale + offset in float32, rounded to bf16, as the torch candidate's bf16 copy) into
// the pair-interleaved blocks of fw's dense kernel. x bf16 [M, K] (K a multiple of 64), N a multiple of 16.
// Returns bf16 [M, N], the bias added before rounding.
at::Tensor int_gemm_bf16(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale, const at::Tensor& offset,
                         int64_t bits, int64_t group, const c10::optional<at::Tensor>& bias) {
#if defined(__AVX512BF16__)
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "x must be bfloat16 [rows, K]");
  const int64_t K = x.size(1), N = q.size(0), G = scale.size(1), stride = q.size(1);
  check_weight(q, scale, offset, K, bits, group);
  TORCH_CHECK(N % fw::kPairCols == 0 && K % 64 == 0, "int_gemm_bf16 takes N a multiple of 16 and K of 64");
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const float *sp = scale.data_ptr<float>(), *op = offset.data_ptr<float>();
  const int block_bytes = static_cast<int>(bits) * kBlock / 8;
  return fw::pair_linear(x, N, bias, nullptr, [&](int64_t n0, uint32_t* tiles) {
    fw::widen_tiles(K, [&](int c, int64_t k0, __m512i& lo, __m512i& hi) {  // two 32-weight blocks of row n
      const int64_t n = n0 + c;
      __m512 f[4];
      for (int h = 0; h < 2; ++h) {
        const int64_t g = (k0 + h * kBlock) / group;
        const __m512 s = _mm512_set1_ps(sp[n * G + g]), o = _mm512_set1_ps(op[n * G + g]);
        __m512 v[2];
        block_floats(qp + n * stride + (k0 / kBlock + h) * block_bytes, static_cast<int>(bits), v);
        f[2 * h] = _mm512_fmadd_ps(v[0], s, o);
        f[2 * h + 1] = _mm512_fmadd_ps(v[1], s, o);
      }
      lo = (__m512i)_mm512_cvtne2ps_pbh(f[1], f[0]);
      hi = (__m512i)_mm512_cvtne2ps_pbh(f[3], f[2]);
    }, tiles);
  });
#else
  TORCH_CHECK(false, "int_gemm_bf16: built without AVX512-BF16 (has_bf16_tiles() is false)");
#endif
}

bool has_bf16_tiles() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

bool amx_supported() {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
  return fw::amx_permitted();
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY(fw_quant_gptq, m) {
  m.def("int_gemv(Tensor x, Tensor q, Tensor scale, Tensor offset, int bits, int group) -> Tensor");
  m.impl("int_gemv", c10::DispatchKey::CPU, TORCH_FN(int_gemv));
  m.def("int_gemv_a8(Tensor x, Tensor q, Tensor scale, Tensor offset, int bits, int group) -> Tensor");
  m.impl("int_gemv_a8", c10::DispatchKey::CPU, TORCH_FN(int_gemv_a8));
  m.def("int_gemv_wide(Tensor x, Tensor q, Tensor scale, Tensor offset, int bits, int group) -> Tensor");
  m.impl("int_gemv_wide", c10::DispatchKey::CPU, TORCH_FN(int_gemv_wide));
  m.def("has_wide() -> bool", TORCH_FN(has_wide));
  m.def("int_gemv_dpbf16(Tensor x, Tensor q, Tensor scale, Tensor offset, int bits, int group, Tensor? bias, "
        "bool float_out) -> Tensor");
  m.impl("int_gemv_dpbf16", c10::DispatchKey::CPU, TORCH_FN(int_gemv_dpbf16));
  m.def("has_dpbf16() -> bool", TORCH_FN(has_dpbf16));
  m.def("int_gemv_a8_wide(Tensor x, Tensor q, Tensor scale, Tensor offset, int bits, int group) -> Tensor");
  m.impl("int_gemv_a8_wide", c10::DispatchKey::CPU, TORCH_FN(int_gemv_a8_wide));
  m.def("has_wide_a8() -> bool", TORCH_FN(has_wide_a8));
  m.def("int_gemm_amx(Tensor x, Tensor q, Tensor scale, Tensor offset, int bits, int group, Tensor? bias) -> Tensor");
  m.impl("int_gemm_amx", c10::DispatchKey::CPU, TORCH_FN(int_gemm_amx));
  m.def("amx_supported() -> bool", TORCH_FN(amx_supported));
  m.def("int_gemm_bf16(Tensor x, Tensor q, Tensor scale, Tensor offset, int bits, int group, Tensor? bias) -> Tensor");
  m.impl("int_gemm_bf16", c10::DispatchKey::CPU, TORCH_FN(int_gemm_bf16));
  m.def("has_bf16_tiles() -> bool", TORCH_FN(has_bf16_tiles));
}

// Products of a few activation rows with ggml-quantized weights, decoding each block as it streams by: the
// weights are read once, in their packed size, instead of being dequantized into a full float matrix first. For
// decode steps (few rows). Q4_0, Q4_1 and Q8_0 have kernels of their own that decode a 32-weight block in
// registers, as do Q4_K (AVX2 or AVX-512) and Q5_K (AVX-512) (dot_row_k4); Q6_K, and Q5_K with AVX2, decode a
// super-block into bytes and widen them as they multiply (dot_row_bytes); the other types (Q5_0, Q5_1, Q2_K, Q3_K,
// which llama.cpp's *_K_M files mix in) decode a block into floats in L1 and multiply from there (dot_row_decoded).
// quant_gemv multiplies the activations as they are; quant_gemv_a8 and quant_gemv_a16 round them to int8 (as
// llama.cpp does on CPUs) or int16 blocks first and multiply integers: a block's dot product is a few integer
// instructions, exact (Q4_0, Q4_1, Q8_0). dequantize decodes whole rows for prefill-sized products.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <utility>
#include <vector>

#include "fw_cpu.h"

namespace {

constexpr int64_t kBlock = 32, kMaxRows = 8;
enum QType : int64_t {  // ggml's type ids
  Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14
};

// Weights and bytes of a block (ggml's block_q* structs; the K-quants' super-blocks hold 256 weights).
constexpr int64_t block_size(int64_t qtype) { return qtype >= Q2_K ? 256 : kBlock; }
constexpr int64_t block_bytes(int64_t qtype) {
  switch (qtype) {
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q5_0: return 22;
    case Q5_1: return 24;
    case Q8_0: return 34;
    case Q2_K: return 84;
    case Q3_K: return 110;
    case Q4_K: return 144;
    case Q5_K: return 176;
    case Q6_K: return 210;
    default: return 0;
  }
}
// The types with kernels of their own (and integer-activation ones).
constexpr bool own_kernel(int64_t qtype) { return qtype == Q4_0 || qtype == Q4_1 || qtype == Q8_0; }

inline float half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const int e = (h >> 10) & 0x1f, m = h & 0x3ff;
  const float f = e == 0 ? std::ldexp(float(m), -24) : e == 31 ? (m ? NAN : INFINITY) : std::ldexp(float(m | 0x400), e - 25);
  return h & 0x8000 ? -f : f;
#endif
}

// The 32 integer weights of a block (before the scale d and the offset), in element order.
inline void block_ints(const uint8_t* b, int64_t qtype, float* q) {
  if (qtype == Q8_0) {
    for (int j = 0; j < 32; ++j) q[j] = static_cast<int8_t>(b[2 + j]);
    return;
  }
  const uint8_t* qs = b + (qtype == Q4_0 ? 2 : 4);  // low nibbles are elements 0-15, high ones 16-31
  for (int j = 0; j < 16; ++j) {
    q[j] = qs[j] & 0x0f;
    q[j + 16] = qs[j] >> 4;
  }
}

// offset_b: the weight a zero integer stands for: m_b (Q4_1), -8 d_b (Q4_0), 0 (Q8_0).
inline float block_offset(const uint8_t* blk, int64_t qtype, float d) {
  return qtype == Q4_1 ? half(blk + 2) : qtype == Q4_0 ? -8.f * d : 0.f;
}

// A block's scale d and offset; Q4_1's adjacent d and m in one conversion.
template <int64_t T>
inline void block_scales(const uint8_t* blk, float& d, float& offset) {
#if defined(__F16C__)
  if constexpr (T == Q4_1) {
    int32_t dm;
    std::memcpy(&dm, blk, 4);
    const __m128 f = _mm_cvtph_ps(_mm_cvtsi32_si128(dm));
    d = _mm_cvtss_f32(f), offset = _mm_cvtss_f32(_mm_movehdup_ps(f));
    return;
  }
#endif
  d = half(blk), offset = block_offset(blk, T, d);
}

// What a row's float product reads besides x and the row: each x block's sum (the AVX2 and scalar kernels' offset
// terms), or the row's block scales as floats (the AVX-512 kernel's, converted for many rows at once).
struct RowAux {
  const float* xsum;
  const float* d;
  const float* m;
};

#if defined(__AVX2__) && defined(__FMA__)
// A row's products for M activation rows: block(b, acc, off) adds block b into one set of accumulators (vector
// and scalar offset terms); sets alternate between even and odd blocks up to 4 rows, where 16 registers hold two
// sets and a block, so that consecutive blocks do not wait on each other. Stores each row's total.
// A block's 32 weights (four vectors, in x's order) times x, in eight lanes.
inline __m256 dot32(const __m256* v, const float* x) {
  __m256 dot = _mm256_mul_ps(v[0], _mm256_loadu_ps(x));
  dot = _mm256_fmadd_ps(v[1], _mm256_loadu_ps(x + 8), dot);
  dot = _mm256_fmadd_ps(v[2], _mm256_loadu_ps(x + 16), dot);
  return _mm256_fmadd_ps(v[3], _mm256_loadu_ps(x + 24), dot);
}

template <int M, typename Block>
inline void sum_blocks(int64_t blocks, float* y, int64_t ldy, const Block& block) {
  constexpr int S = M <= 4 ? 2 : 1;
  __m256 acc[S][M];
  float off[S][M];
  for (int s = 0; s < S; ++s)
    for (int m = 0; m < M; ++m) acc[s][m] = _mm256_setzero_ps(), off[s][m] = 0.f;
  int64_t b = 0;
  for (; b + S <= blocks; b += S)
    for (int s = 0; s < S; ++s) block(b + s, acc[s], off[s]);
  for (; b < blocks; ++b) block(b, acc[0], off[0]);
  for (int m = 0; m < M; ++m) {
    if constexpr (S == 2) acc[0][m] = _mm256_add_ps(acc[0][m], acc[1][m]), off[0][m] += off[1][m];
    y[m * ldy] = fw::sum8(acc[0][m]) + off[0][m];
  }
}
#endif

#if defined(__AVX512F__)
constexpr int64_t kRun = 16;  // blocks whose scales convert together

// The scales d (and Q4_1's m) of n consecutive blocks (a span's rows follow each other, so the blocks of several
// rows have one stride) as floats: a gather and one conversion per 16 blocks, rather than a conversion and two
// broadcasts per block (the shuffle port is what a 1-row product waits on). The block loop then broadcasts them
// straight from memory, which costs no shuffle. d and m hold n rounded up to a multiple of kRun.
template <int64_t T>
void span_scales(const uint8_t* blk, int64_t n, float* d, float* m) {
  constexpr int bb = block_bytes(T);
  const __m512i index = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                           _mm512_set1_epi32(bb));
  for (int64_t i = 0; i < n; i += kRun, blk += kRun * bb) {
    // The first pass over these rows: a gather waits on each cold line in turn unless they are requested ahead.
    for (int64_t off = 0; off < kRun * bb; off += 64) fw::prefetch_ahead(blk + off);
    const __mmask16 live = n - i >= kRun ? __mmask16(0xffff) : __mmask16((1u << (n - i)) - 1);
    const __m512i dm = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, index, blk, 1);
    _mm512_storeu_ps(d + i, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dm)));
    if constexpr (T == Q4_1) _mm512_storeu_ps(m + i, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(dm, 16))));
  }
}

// A block's 32 weights (w = d q + offset) as floats: elements 0-15 and 16-31. A 4-bit block's 16 possible
// weights are computed once (one FMA over 0..15) and looked up by nibble (a permutation reads only the low 4 bits
// of each lane's index, so the low nibbles need no mask): two permutations instead of a mask, two conversions and
// two FMAs. Each weight is the same single rounding of d q + offset as decoding it (Q4_0's offset -8 d is exact,
// so (q - 8) d is that rounding too).
template <int64_t T>
inline void block_weights(const uint8_t* blk, const float* d, const float* m, __m512& lo, __m512& hi) {
  if constexpr (T == Q8_0) {  // its scale read here: Q8_0 waits on the conversions, not on the shuffles
    const __m512 dv = _mm512_set1_ps(half(blk));
    const __m256i qs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
    lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(qs))), dv);
    hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(qs, 1))), dv);
  } else {
    const __m512 dv = _mm512_set1_ps(*d);
    const __m512 table = T == Q4_1
        ? _mm512_fmadd_ps(_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), dv, _mm512_set1_ps(*m))
        : _mm512_mul_ps(_mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7), dv);
    // The bytes widened once: a lane's low nibble is element j, its high nibble element j + 16.
    const __m512i qs = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + (T == Q4_0 ? 2 : 4))));
    lo = _mm512_permutexvar_ps(qs, table);
    hi = _mm512_permutexvar_ps(_mm512_srli_epi32(qs, 4), table);
  }
}

// One output row for M activation rows (M a constant, so the accumulators live in registers). Each block is
// dequantized in registers once and then costs each row two FMAs with x from memory: verifying a few speculative
// tokens, or a small batch, adds little per row (the xsum form of the other paths spends a multiply, an FMA and a
// scalar FMA per row and block). Accumulators: a row's halves (elements 0-15 and 16-31) apart, and for one or two
// rows even and odd blocks apart too, so that no FMA waits on the previous one.
template <int64_t T, int M>
void dot_row(const float* x, const RowAux& aux, const uint8_t* row, float* y, int64_t ldy, int64_t blocks,
             int64_t K) {
  constexpr int64_t bb = block_bytes(T);
  constexpr int S = M <= 2 ? 2 : 1;
  __m512 acc[S][2][M];
  for (int s = 0; s < S; ++s)
    for (int m = 0; m < M; ++m) acc[s][0][m] = acc[s][1][m] = _mm512_setzero_ps();
  for (int64_t off = 0; off < blocks * bb; off += 64) fw::prefetch_far_and_near(row + off);  // a row's lines, once
  auto block = [&](int64_t b, __m512 (*a)[M]) {
    __m512 lo, hi;
    block_weights<T>(row + b * bb, aux.d + b, aux.m + b, lo, hi);
    for (int m = 0; m < M; ++m) {
      const float* xb = x + m * K + b * kBlock;
      a[0][m] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xb), a[0][m]);
      a[1][m] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xb + 16), a[1][m]);
    }
  };
  int64_t b = 0;
  for (; b + S <= blocks; b += S)
    for (int s = 0; s < S; ++s) block(b + s, acc[s]);
  for (; b < blocks; ++b) block(b, acc[0]);
  for (int m = 0; m < M; ++m) {
    __m512 sum = _mm512_add_ps(acc[0][0][m], acc[0][1][m]);
    if constexpr (S == 2) sum = _mm512_add_ps(sum, _mm512_add_ps(acc[1][0][m], acc[1][1][m]));
    y[m * ldy] = _mm512_reduce_add_ps(sum);
  }
}
#elif defined(__AVX2__) && defined(__FMA__)
// The integer weights of a block as floats, eight elements per vector (0-7, 8-15, 16-23, 24-31).
template <int64_t T>
inline void block_vectors(const uint8_t* blk, __m256 v[4]) {
  if constexpr (T == Q8_0) {
    for (int k = 0; k < 4; ++k)
      v[k] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 2 + 8 * k))));
  } else {
    // Each half of the nibble bytes widened to int32 lanes straight from memory: a lane's low nibble is element
    // j, its high nibble (the byte shifted: nothing to mask) element j + 16. Fewer shuffles than splitting the
    // bytes first, and Zen 3 has two shuffle pipes for four vector ALUs.
    const uint8_t* qs = blk + (T == Q4_0 ? 2 : 4);
    const __m256i mask = _mm256_set1_epi32(0x0f);
    const __m256i a = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs)));
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + 8)));
    v[0] = _mm256_cvtepi32_ps(_mm256_and_si256(a, mask));
    v[1] = _mm256_cvtepi32_ps(_mm256_and_si256(b, mask));
    v[2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(a, 4));
    v[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
  }
}

// As the AVX-512 version, with the accumulators of sum_blocks.
template <int64_t T, int M>
void dot_row(const float* x, const RowAux& aux, const uint8_t* row, float* y, int64_t ldy, int64_t blocks,
             int64_t K) {
  constexpr int64_t bb = block_bytes(T);
  sum_blocks<M>(blocks, y, ldy, [&](int64_t b, __m256* a, float* o) {
    const uint8_t* blk = row + b * bb;
    float d, offset;
    block_scales<T>(blk, d, offset);
    __m256 v[4];
    block_vectors<T>(blk, v);
    const __m256 dv = _mm256_set1_ps(d);
    for (int m = 0; m < M; ++m) {
      const float* xb = x + m * K + b * kBlock;
      a[m] = _mm256_fmadd_ps(dot32(v, xb), dv, a[m]);
      if constexpr (T != Q8_0) o[m] += offset * aux.xsum[m * blocks + b];
    }
  });
}
#else
template <int64_t T, int M>
void dot_row(const float* x, const RowAux& aux, const uint8_t* row, float* y, int64_t ldy, int64_t blocks,
             int64_t K) {
  constexpr int64_t qtype = T, bb = block_bytes(T);
  float acc[M] = {0.f};
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* blk = row + b * bb;
    const float d = half(blk), offset = block_offset(blk, qtype, d);
    float q[32];
    block_ints(blk, qtype, q);
    for (int m = 0; m < M; ++m) {
      const float* xb = x + m * K + b * kBlock;
      float dot = 0.f;
      for (int j = 0; j < 32; ++j) dot += q[j] * xb[j];
      acc[m] += d * dot + offset * aux.xsum[m * blocks + b];
    }
  }
  for (int m = 0; m < M; ++m) y[m * ldy] = acc[m];
}
#endif

// --- every type: blocks decoded into floats ---
// decode<T>(block, w): a block's weights as floats, in element order, each computed as dequant.py computes it
// (scale times integer, minus the min where there is one). The K-quants' layouts: see dequant.py's comments.
// The products are exact in float32 (an fp16 scale's 11 bits times a sub-block scale of at most 8 and an integer
// of at most 6 bits: 24 bits at most), so the one rounding is the min's, whether or not the compiler fuses the
// multiply and the subtraction into an FMA: the results equal torch's bit for bit.
template <int64_t T>
void decode(const uint8_t* b, float* w);

template <>
inline void decode<Q4_0>(const uint8_t* b, float* w) {
  const float d = half(b);
  float q[kBlock];
  block_ints(b, Q4_0, q);
  for (int j = 0; j < kBlock; ++j) w[j] = d * (q[j] - 8.f);
}

template <>
inline void decode<Q4_1>(const uint8_t* b, float* w) {
  const float d = half(b), m = half(b + 2);
  float q[kBlock];
  block_ints(b, Q4_1, q);
  for (int j = 0; j < kBlock; ++j) w[j] = d * q[j] + m;
}

template <>
inline void decode<Q8_0>(const uint8_t* b, float* w) {
  const float d = half(b);
  for (int j = 0; j < kBlock; ++j) w[j] = d * static_cast<float>(static_cast<int8_t>(b[2 + j]));
}

#if defined(__AVX512F__)
// q - b as floats, and 16 bytes as int32 lanes.
inline __m512 sub_int(__m512i q, int b) { return _mm512_cvtepi32_ps(_mm512_sub_epi32(q, _mm512_set1_epi32(b))); }
inline __m512i bytes16(const uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

// Q5_0 / Q5_1's integers, elements 0-15 and 16-31: the nibbles as Q4_0's, the fifth bits (bit j of the
// little-endian uint32 qh is element j's) straight from qh as lane masks.
inline void five_bit(const uint8_t* qh_bytes, const uint8_t* qs, __m512i& lo, __m512i& hi) {
  uint32_t qh;
  std::memcpy(&qh, qh_bytes, 4);
  const __m512i q = bytes16(qs), bit = _mm512_set1_epi32(16);
  lo = _mm512_and_si512(q, _mm512_set1_epi32(0x0f)), hi = _mm512_srli_epi32(q, 4);
  lo = _mm512_mask_or_epi32(lo, __mmask16(qh), lo, bit), hi = _mm512_mask_or_epi32(hi, __mmask16(qh >> 16), hi, bit);
}

template <>
inline void decode<Q5_0>(const uint8_t* b, float* w) {
  const __m512 d = _mm512_set1_ps(half(b));
  __m512i lo, hi;
  five_bit(b + 2, b + 6, lo, hi);
  _mm512_store_ps(w, _mm512_mul_ps(d, sub_int(lo, 16)));
  _mm512_store_ps(w + 16, _mm512_mul_ps(d, sub_int(hi, 16)));
}

template <>
inline void decode<Q5_1>(const uint8_t* b, float* w) {
  const __m512 d = _mm512_set1_ps(half(b)), m = _mm512_set1_ps(half(b + 2));
  __m512i lo, hi;
  five_bit(b + 4, b + 8, lo, hi);
  _mm512_store_ps(w, _mm512_add_ps(_mm512_mul_ps(d, _mm512_cvtepi32_ps(lo)), m));
  _mm512_store_ps(w + 16, _mm512_add_ps(_mm512_mul_ps(d, _mm512_cvtepi32_ps(hi)), m));
}
#elif defined(__AVX2__)
// Q5_0 / Q5_1's integers, eight elements a vector (0-7, 8-15, 16-23, 24-31): the nibbles as Q4_0's, each
// element's fifth bit shifted out of the little-endian uint32 qh by a shift per lane.
inline void five_bit(const uint8_t* qh_bytes, const uint8_t* qs, __m256i q[4]) {
  uint32_t qh;
  std::memcpy(&qh, qh_bytes, 4);
  const __m256i a = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs)));
  const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + 8)));
  const __m256i mask = _mm256_set1_epi32(0x0f), bits = _mm256_set1_epi32(static_cast<int>(qh)), one = _mm256_set1_epi32(1);
  q[0] = _mm256_and_si256(a, mask), q[1] = _mm256_and_si256(b, mask);
  q[2] = _mm256_srli_epi32(a, 4), q[3] = _mm256_srli_epi32(b, 4);
  for (int k = 0; k < 4; ++k) {
    const __m256i lane = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(8 * k));
    q[k] = _mm256_or_si256(q[k], _mm256_slli_epi32(_mm256_and_si256(_mm256_srlv_epi32(bits, lane), one), 4));
  }
}

template <>
inline void decode<Q5_0>(const uint8_t* b, float* w) {
  const __m256 d = _mm256_set1_ps(half(b));
  __m256i q[4];
  five_bit(b + 2, b + 6, q);
  for (int k = 0; k < 4; ++k)
    _mm256_store_ps(w + 8 * k, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(q[k], _mm256_set1_epi32(16)))));
}

template <>
inline void decode<Q5_1>(const uint8_t* b, float* w) {
  const __m256 d = _mm256_set1_ps(half(b)), m = _mm256_set1_ps(half(b + 2));
  __m256i q[4];
  five_bit(b + 4, b + 8, q);
  for (int k = 0; k < 4; ++k) _mm256_store_ps(w + 8 * k, _mm256_add_ps(_mm256_mul_ps(d, _mm256_cvtepi32_ps(q[k])), m));
}
#else
// Q5_0 / Q5_1: a little-endian uint32 whose bit j is element j's fifth bit, then the nibbles as Q4_0's.
inline void five_bit(const uint8_t* qh_bytes, const uint8_t* qs, float* q) {
  uint32_t qh;
  std::memcpy(&qh, qh_bytes, 4);
  for (int j = 0; j < 16; ++j) {
    q[j] = static_cast<float>((qs[j] & 0x0f) | (((qh >> j) & 1) << 4));
    q[j + 16] = static_cast<float>((qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4));
  }
}

template <>
inline void decode<Q5_0>(const uint8_t* b, float* w) {
  const float d = half(b);
  float q[kBlock];
  five_bit(b + 2, b + 6, q);
  for (int j = 0; j < kBlock; ++j) w[j] = d * (q[j] - 16.f);
}

template <>
inline void decode<Q5_1>(const uint8_t* b, float* w) {
  const float d = half(b), m = half(b + 2);
  float q[kBlock];
  five_bit(b + 4, b + 8, q);
  for (int j = 0; j < kBlock; ++j) w[j] = d * q[j] + m;
}
#endif

// Q2_K's scales (low nibbles) times d and mins (high nibbles) times dmin, of n 16-element groups from element e0.
inline void q2_scales(const uint8_t* b, int e0, int n, float* ds, float* dm) {
  const float d = half(b + 80), dmin = half(b + 82);
  for (int k = 0; k < n; ++k) {
    const uint8_t sc = b[e0 / 16 + k];
    ds[k] = d * static_cast<float>(sc & 0x0f), dm[k] = dmin * static_cast<float>(sc >> 4);
  }
}

// Q3_K's sixteen 6-bit scales (minus 32): low nibbles from bytes 0-7, top crumbs from bytes 8-11.
inline int q3_scale(const uint8_t* packed, int i) {
  const int low = i < 8 ? packed[i] & 0x0f : packed[i - 8] >> 4, high = (packed[8 + i % 4] >> (2 * (i / 4))) & 3;
  return (low | (high << 4)) - 32;
}

#if defined(__AVX2__)
inline __m256i load32(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// 32 signed bytes, 8 at a time as floats, times the scale of their 16-element half (and minus its min), into w.
template <bool kMin>
inline void store32(__m256i q, const float* ds, const float* dm, float* w) {
  for (int k = 0; k < 4; ++k) {
    const __m128i part = k < 2 ? _mm256_castsi256_si128(q) : _mm256_extracti128_si256(q, 1);
    const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(k % 2 ? _mm_unpackhi_epi64(part, part) : part));
    const __m256 scaled = _mm256_mul_ps(_mm256_set1_ps(ds[k / 2]), v);
    _mm256_store_ps(w + 8 * k, kMin ? _mm256_sub_ps(scaled, _mm256_set1_ps(dm[k / 2])) : scaled);
  }
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__)
// The 2-bit fields of Q2_K and Q3_K: element 128 h + 32 s + l is crumb s of qs[32 h + l]. Elements 128 h + 64 p
// on as 64 bytes: qs's 32 bytes in both halves of a vector, shifted by 4p and 4p + 2.
inline __m512i crumbs64(const uint8_t* qs, int h, int p) {
  const __m512i bytes = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * h)));
  const __m512i shift = _mm512_mask_blend_epi16(0xffff0000u, _mm512_set1_epi16(4 * p), _mm512_set1_epi16(4 * p + 2));
  return _mm512_and_si512(_mm512_srlv_epi16(bytes, shift), _mm512_set1_epi8(3));
}

// 64 signed bytes, 16 at a time times a scale (and minus a min), into w.
template <bool kMin>
inline void store64(__m512i q, const float* ds, const float* dm, float* w) {
  for (int k = 0; k < 4; ++k) {
    const __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(q, k)));
    const __m512 scaled = _mm512_mul_ps(_mm512_set1_ps(ds[k]), v);
    _mm512_store_ps(w + 16 * k, kMin ? _mm512_sub_ps(scaled, _mm512_set1_ps(dm[k])) : scaled);
  }
}

template <>
inline void decode<Q2_K>(const uint8_t* b, float* w) {  // scales[16] | qs[64] | d | dmin
  for (int e0 = 0; e0 < 256; e0 += 64) {
    float ds[4], dm[4];
    q2_scales(b, e0, 4, ds, dm);
    store64<true>(crumbs64(b + 16, e0 / 128, (e0 % 128) / 64), ds, dm, w + e0);
  }
}

template <>
inline void decode<Q3_K>(const uint8_t* b, float* w) {  // hmask[32] | qs[64] | scales[12] | d
  const float d = half(b + 108);
  const __m512i hmask = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)));
  for (int e0 = 0; e0 < 256; e0 += 64) {
    const int h = e0 / 128, p = (e0 % 128) / 64;
    float ds[4];
    for (int k = 0; k < 4; ++k) ds[k] = d * static_cast<float>(q3_scale(b + 96, e0 / 16 + k));
    // Element e's hmask bit is bit e / 32 = 4h + 2p (+ 1 in the second half) of hmask[e % 32]; clear: minus 4.
    const __m512i shift = _mm512_mask_blend_epi16(0xffff0000u, _mm512_set1_epi16(4 * h + 2 * p),
                                                  _mm512_set1_epi16(4 * h + 2 * p + 1));
    const __m512i bit = _mm512_and_si512(_mm512_srlv_epi16(hmask, shift), _mm512_set1_epi8(1));
    const __m512i q = _mm512_sub_epi8(_mm512_add_epi8(crumbs64(b + 32, h, p), _mm512_slli_epi16(bit, 2)),
                                      _mm512_set1_epi8(4));
    store64<false>(q, ds, nullptr, w + e0);
  }
}
#elif defined(__AVX2__)
// As the AVX-512 versions, 32 elements at a time: element 128 h + 32 s + l is crumb s of qs[32 h + l].
inline __m256i crumbs32(const uint8_t* qs, int e0) {
  return _mm256_and_si256(_mm256_srl_epi16(load32(qs + 32 * (e0 / 128)), _mm_cvtsi32_si128(2 * ((e0 % 128) / 32))),
                          _mm256_set1_epi8(3));
}

template <>
inline void decode<Q2_K>(const uint8_t* b, float* w) {  // scales[16] | qs[64] | d | dmin
  for (int e0 = 0; e0 < 256; e0 += 32) {
    float ds[2], dm[2];
    q2_scales(b, e0, 2, ds, dm);
    store32<true>(crumbs32(b + 16, e0), ds, dm, w + e0);
  }
}

template <>
inline void decode<Q3_K>(const uint8_t* b, float* w) {  // hmask[32] | qs[64] | scales[12] | d
  const float d = half(b + 108);
  const __m256i hmask = load32(b);
  for (int e0 = 0; e0 < 256; e0 += 32) {
    float ds[2];
    for (int k = 0; k < 2; ++k) ds[k] = d * static_cast<float>(q3_scale(b + 96, e0 / 16 + k));
    // Element e's hmask bit is bit e / 32 of hmask[e % 32]; clear: minus 4.
    const __m256i bit = _mm256_and_si256(_mm256_srl_epi16(hmask, _mm_cvtsi32_si128(e0 / 32)), _mm256_set1_epi8(1));
    const __m256i q = _mm256_sub_epi8(_mm256_add_epi8(crumbs32(b + 32, e0), _mm256_slli_epi16(bit, 2)),
                                      _mm256_set1_epi8(4));
    store32<false>(q, ds, nullptr, w + e0);
  }
}
#else
template <>
inline void decode<Q2_K>(const uint8_t* b, float* w) {  // scales[16] | qs[64] | d | dmin
  for (int e0 = 0; e0 < 256; e0 += 16) {  // a 16-element sub-block: one scale and min
    float ds, dm;
    q2_scales(b, e0, 1, &ds, &dm);
    const uint8_t* qs = b + 16 + 32 * (e0 / 128) + e0 % 32;
    const int shift = 2 * ((e0 % 128) / 32);
    for (int l = 0; l < 16; ++l) w[e0 + l] = ds * static_cast<float>((qs[l] >> shift) & 3) - dm;
  }
}

template <>
inline void decode<Q3_K>(const uint8_t* b, float* w) {  // hmask[32] | qs[64] | scales[12] | d
  const uint8_t* packed = b + 96;
  const float d = half(b + 108);
  for (int e0 = 0; e0 < 256; e0 += 16) {
    const int i = e0 / 16;
    const float ds = d * static_cast<float>(q3_scale(packed, i));
    const uint8_t* qs = b + 32 + 32 * (e0 / 128) + e0 % 32;
    const uint8_t* hm = b + e0 % 32;
    const int shift = 2 * ((e0 % 128) / 32), bit = e0 / 32;
    for (int l = 0; l < 16; ++l)  // a clear hmask bit subtracts 4
      w[e0 + l] = ds * static_cast<float>(((qs[l] >> shift) & 3) - (((hm[l] >> bit) & 1) ? 0 : 4));
  }
}
#endif

// Q4_K / Q5_K: eight 6-bit scales and mins packed in 12 bytes.
inline void k4_scale(const uint8_t* s, int j, int& scale, int& min) {
  if (j < 4) {
    scale = s[j] & 63, min = s[j + 4] & 63;
  } else {
    scale = (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4), min = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// high: Q5_K's qh[32] (bit j of byte l is sub-block j's element l's fifth bit), or null for Q4_K.
#if defined(__AVX512F__)
inline void decode_k4(const uint8_t* b, const uint8_t* high, const uint8_t* qs, float* w) {
  const float d = half(b), dmin = half(b + 2);
  const __m256i nibble = _mm256_set1_epi8(0x0f), one = _mm256_set1_epi8(1);
  const __m256i qh = high ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(high)) : _mm256_setzero_si256();
  for (int j = 0; j < 8; ++j) {  // sub-block j: nibbles of bytes 32 (j / 2) on, low ones for even j, as bytes
    int scale, min;
    k4_scale(b + 4, j, scale, min);
    const __m512 ds = _mm512_set1_ps(d * static_cast<float>(scale)), dm = _mm512_set1_ps(dmin * static_cast<float>(min));
    const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * (j / 2)));
    __m256i q = _mm256_and_si256(j % 2 ? _mm256_srli_epi16(bytes, 4) : bytes, nibble);
    if (high) q = _mm256_or_si256(q, _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(j)), one), 4));
    for (int k = 0; k < 2; ++k) {
      const __m128i part = k ? _mm256_extracti128_si256(q, 1) : _mm256_castsi256_si128(q);
      const __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(part));
      _mm512_store_ps(w + 32 * j + 16 * k, _mm512_sub_ps(_mm512_mul_ps(ds, v), dm));
    }
  }
}
#elif defined(__AVX2__)
// As the AVX-512 version, 8 elements at a time to floats.
inline void decode_k4(const uint8_t* b, const uint8_t* high, const uint8_t* qs, float* w) {
  const float d = half(b), dmin = half(b + 2);
  const __m256i nibble = _mm256_set1_epi8(0x0f), one = _mm256_set1_epi8(1);
  const __m256i qh = high ? load32(high) : _mm256_setzero_si256();
  for (int j = 0; j < 8; ++j) {
    int scale, min;
    k4_scale(b + 4, j, scale, min);
    const float ds[2] = {d * static_cast<float>(scale), d * static_cast<float>(scale)};
    const float dm[2] = {dmin * static_cast<float>(min), dmin * static_cast<float>(min)};
    const __m256i bytes = load32(qs + 32 * (j / 2));
    __m256i q = _mm256_and_si256(j % 2 ? _mm256_srli_epi16(bytes, 4) : bytes, nibble);
    if (high) q = _mm256_or_si256(q, _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(j)), one), 4));
    store32<true>(q, ds, dm, w + 32 * j);
  }
}
#else
inline void decode_k4(const uint8_t* b, const uint8_t* high, const uint8_t* qs, float* w) {
  const float d = half(b), dmin = half(b + 2);
  for (int j = 0; j < 8; ++j) {  // sub-block j: nibbles of bytes 32 (j / 2) on, low ones for even j
    int scale, min;
    k4_scale(b + 4, j, scale, min);
    const float ds = d * static_cast<float>(scale), dm = dmin * static_cast<float>(min);
    const uint8_t* q = qs + 32 * (j / 2);
    const int shift = 4 * (j % 2);
    for (int l = 0; l < 32; ++l) {
      const int h = high ? ((high[l] >> j) & 1) << 4 : 0;
      w[32 * j + l] = ds * static_cast<float>(((q[l] >> shift) & 0x0f) | h) - dm;
    }
  }
}
#endif

template <>
inline void decode<Q4_K>(const uint8_t* b, float* w) {  // d | dmin | scales[12] | qs[128]
  decode_k4(b, nullptr, b + 16, w);
}

template <>
inline void decode<Q5_K>(const uint8_t* b, float* w) {  // d | dmin | scales[12] | qh[32] | qs[128]
  decode_k4(b, b + 16, b + 48, w);
}

// The super-block kernels request each super-block's lines this far ahead as their loop reaches it, rather than
// a whole row's lines at its start kPrefetchAhead ahead as the 32-weight kernels do: K-quant rows are long (a
// 8960-feature Q4_K row is 5 KB) and the burst at a row's start kept too little of the stream in flight. On a
// Zen 5 at one row (Gweights/s): 1536 x 8960 Q4_K 47 -> 64, Q6_K 25 -> 47; 1536-feature rows 56 -> 58, 48 -> 50.
constexpr int64_t kSuperBlockAhead = 16384;
template <int64_t T>
inline void prefetch_super_block(const uint8_t* blk) {
  for (int64_t off = 0; off < block_bytes(T); off += 64) fw::prefetch_ahead<kSuperBlockAhead>(blk + off);
}

// Q6_K's integers minus 32 as signed bytes, in element order: (low nibble | high crumb << 4) - 32. Element
// 128 h + 32 k + l takes ql[64 h + 32 (k % 2) + l]'s low (k < 2) or high nibble and crumb k of qh[32 h + l].
#if defined(__AVX512F__) && defined(__AVX512BW__)
inline void q6k_ints(const uint8_t* b, int8_t* q) {  // ql[128] | qh[64] | scales[16] (int8) | d
  const __m512i nibble = _mm512_set1_epi8(0x0f), crumb = _mm512_set1_epi8(3), offset = _mm512_set1_epi8(32);
  for (int h = 0; h < 2; ++h) {  // elements 128 h on: ql's 64 bytes, qh's 32 (in both halves of a vector)
    const __m512i ql = _mm512_loadu_si512(b + 64 * h);
    const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * h)));
    for (int t = 0; t < 2; ++t) {  // elements 128 h + 64 t on: ql's low (t = 0) or high nibbles, qh's crumbs 2t, 2t + 1
      const __m512i low = _mm512_and_si512(t ? _mm512_srli_epi16(ql, 4) : ql, nibble);
      // 16-bit lanes 0-15 (qh's first copy) shift by 4t, lanes 16-31 by 4t + 2: a byte's crumb sits in its low bits.
      const __m512i shift = _mm512_mask_blend_epi16(0xffff0000u, _mm512_set1_epi16(4 * t), _mm512_set1_epi16(4 * t + 2));
      const __m512i high = _mm512_and_si512(_mm512_srlv_epi16(qh, shift), crumb);
      const __m512i ints = _mm512_sub_epi8(_mm512_or_si512(low, _mm512_slli_epi16(high, 4)), offset);
      _mm512_store_si512(q + 128 * h + 64 * t, ints);
    }
  }
}
#elif defined(__AVX2__)
// As the AVX-512 version, 32 elements at a time.
inline void q6k_ints(const uint8_t* b, int8_t* q) {
  const __m256i nibble = _mm256_set1_epi8(0x0f), crumb = _mm256_set1_epi8(3), offset = _mm256_set1_epi8(32);
  for (int e0 = 0; e0 < 256; e0 += 32) {  // ql's 32 bytes 64 h + 32 u, low nibbles for t = 0; qh's crumb 2t + u
    const int h = e0 / 128, t = (e0 % 128) / 64, u = (e0 % 64) / 32;
    const __m256i ql = load32(b + 64 * h + 32 * u), qh = load32(b + 128 + 32 * h);
    const __m256i low = _mm256_and_si256(t ? _mm256_srli_epi16(ql, 4) : ql, nibble);
    const __m256i high = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(4 * t + 2 * u)), crumb);
    _mm256_store_si256(reinterpret_cast<__m256i*>(q + e0),
                       _mm256_sub_epi8(_mm256_or_si256(low, _mm256_slli_epi16(high, 4)), offset));
  }
}
#else
inline void q6k_ints(const uint8_t* b, int8_t* q) {
  for (int e = 0; e < 256; ++e) {
    const int h = e / 128, k = e % 128 / 32, l = e % 32;
    const int low = (b[64 * h + 32 * (k % 2) + l] >> (4 * (k / 2))) & 0x0f;
    const int high = (b[128 + 32 * h + l] >> (2 * k)) & 3;
    q[e] = static_cast<int8_t>((low | high << 4) - 32);
  }
}
#endif

// Vectors of weights from integers as bytes (q6k_ints, q5k_ints): kByteLanes of them as floats times their
// sub-block's scale (Q6_K's q6k_scales: d times the int8 scale, exact in float32), less its min (Q5_K), as decoding
// rounds them. fma_x and lanes_sum: the byte kernel's arithmetic at that width.
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define FW_BYTE_VECTORS 1
constexpr int kByteLanes = 16;
inline __m512 byte_ints(const int8_t* q) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(q))));
}
inline __m512 byte_weights(const int8_t* q, float ds) { return _mm512_mul_ps(_mm512_set1_ps(ds), byte_ints(q)); }
inline __m512 byte_weights(const int8_t* q, float ds, float dm) {
  return _mm512_fmsub_ps(_mm512_set1_ps(ds), byte_ints(q), _mm512_set1_ps(dm));
}
inline void q6k_scales(const uint8_t* b, float* ds) {
  const __m512i scales = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192)));
  _mm512_store_ps(ds, _mm512_mul_ps(_mm512_set1_ps(half(b + 208)), _mm512_cvtepi32_ps(scales)));
}
inline __m512 fma_x(__m512 w, const float* x, __m512 a) { return _mm512_fmadd_ps(w, _mm512_loadu_ps(x), a); }
inline float lanes_sum(__m512 v) { return _mm512_reduce_add_ps(v); }
inline void store_ps(float* w, __m512 v) { _mm512_store_ps(w, v); }
#elif defined(__AVX2__) && defined(__FMA__)
#define FW_BYTE_VECTORS 1
constexpr int kByteLanes = 8;
inline __m256 byte_ints(const int8_t* q) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q))));
}
inline __m256 byte_weights(const int8_t* q, float ds) { return _mm256_mul_ps(_mm256_set1_ps(ds), byte_ints(q)); }
inline __m256 byte_weights(const int8_t* q, float ds, float dm) {
  return _mm256_fmsub_ps(_mm256_set1_ps(ds), byte_ints(q), _mm256_set1_ps(dm));
}
inline void q6k_scales(const uint8_t* b, float* ds) {
  const __m256 d = _mm256_set1_ps(half(b + 208));
  for (int h = 0; h < 2; ++h) {
    const __m256i scales = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 192 + 8 * h)));
    _mm256_store_ps(ds + 8 * h, _mm256_mul_ps(d, _mm256_cvtepi32_ps(scales)));
  }
}
inline __m256 fma_x(__m256 w, const float* x, __m256 a) { return _mm256_fmadd_ps(w, _mm256_loadu_ps(x), a); }
inline float lanes_sum(__m256 v) { return fw::sum8(v); }
inline void store_ps(float* w, __m256 v) { _mm256_store_ps(w, v); }
#endif

template <>
inline void decode<Q6_K>(const uint8_t* b, float* w) {
  alignas(64) int8_t q[256];
  q6k_ints(b, q);
#if defined(FW_BYTE_VECTORS)
  alignas(64) float ds[16];
  q6k_scales(b, ds);
  for (int v = 0; v < 256 / kByteLanes; ++v)
    store_ps(w + kByteLanes * v, byte_weights(q + kByteLanes * v, ds[kByteLanes * v / 16]));
#else
  const float d = half(b + 208);
  for (int e = 0; e < 256; ++e) w[e] = d * static_cast<float>(static_cast<int8_t>(b[192 + e / 16])) * q[e];
#endif
}

// M rows' sums of products of n floats (n a multiple of 32) with x, in two sets of accumulators so that
// consecutive FMAs do not wait on each other.
template <int M>
struct DotRows {
#if defined(__AVX512F__)
  __m512 a[2][M];
  DotRows() {
    for (int m = 0; m < M; ++m) a[0][m] = a[1][m] = _mm512_setzero_ps();
  }
  void add(const float* w, const float* x, int64_t ldx, int64_t n) {
    for (int64_t i = 0; i < n; i += 32) {
      const __m512 w0 = _mm512_load_ps(w + i), w1 = _mm512_load_ps(w + i + 16);
      for (int m = 0; m < M; ++m) {
        a[0][m] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + m * ldx + i), a[0][m]);
        a[1][m] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + m * ldx + i + 16), a[1][m]);
      }
    }
  }
  float sum(int m) const { return _mm512_reduce_add_ps(_mm512_add_ps(a[0][m], a[1][m])); }
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 a[2][M];
  DotRows() {
    for (int m = 0; m < M; ++m) a[0][m] = a[1][m] = _mm256_setzero_ps();
  }
  void add(const float* w, const float* x, int64_t ldx, int64_t n) {
    for (int64_t i = 0; i < n; i += 16) {
      const __m256 w0 = _mm256_load_ps(w + i), w1 = _mm256_load_ps(w + i + 8);
      for (int m = 0; m < M; ++m) {
        a[0][m] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + m * ldx + i), a[0][m]);
        a[1][m] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + m * ldx + i + 8), a[1][m]);
      }
    }
  }
  float sum(int m) const { return fw::sum8(_mm256_add_ps(a[0][m], a[1][m])); }
#else
  float a[M] = {0.f};
  void add(const float* w, const float* x, int64_t ldx, int64_t n) {
    for (int m = 0; m < M; ++m)
      for (int64_t i = 0; i < n; ++i) a[m] += w[i] * x[m * ldx + i];
  }
  float sum(int m) const { return a[m]; }
#endif
};

// One output row for M activation rows: each block decoded into floats (a block stays in L1) and multiplied from
// there. Slower per weight than the own kernels' decoding in registers, but one loop serves every layout.
template <int64_t T, int M>
void dot_row_decoded(const float* x, const RowAux&, const uint8_t* row, float* y, int64_t ldy, int64_t,
                     int64_t K) {
  constexpr int64_t bs = block_size(T), bb = block_bytes(T);
  for (int64_t off = 0; off < K / bs * bb; off += 64) fw::prefetch_ahead(row + off);  // a row's lines, once
  alignas(64) float w[bs];
  DotRows<M> dot;
  for (int64_t b = 0; b < K / bs; ++b) {
    decode<T>(row + b * bb, w);
    dot.add(w, x + b * bs, K, bs);
  }
  for (int m = 0; m < M; ++m) y[m * ldy] = dot.sum(m);
}

// --- Q4_K and Q5_K in registers ---
// The types read so (dot_row_k4, on x in q4k_order).
constexpr bool k4_registers(int64_t qtype) {
#if defined(__AVX512F__)
  return qtype == Q4_K || qtype == Q5_K;
#elif defined(__AVX2__) && defined(__FMA__)
  return qtype == Q4_K;
#else
  return false;
#endif
}

template <int64_t T, int M>
void dot_row_k4(const float* xk, const RowAux& aux, const uint8_t* row, float* y, int64_t ldy, int64_t blocks,
                int64_t K);

#if defined(__AVX2__) && defined(__FMA__)
// A super-block's nibbles go to both halves of a vector, 32 bytes (AVX-512: sub-blocks 2c and 2c + 1, low and
// high nibbles) or 16 at a time; shifting each 32-bit lane by its own count puts a nibble in its low 4 bits:
// lanes of the low half take byte 4i + o and those of the high half byte 4i + o + 1. With AVX-512 that is all a
// permutation of the sub-block's 16 possible weights (d scale n - dmin min, as decoding it rounds) reads, so a
// shift and a permutation give 16 weights without widening bytes (the shuffle port is what a 1-row product waits
// on); with AVX2 a mask and a conversion give 8 integers, whose sums the scales multiply (as the own kernels do).
// x is read in that order, permuted once per call (q4k_order).
constexpr int kQ4KShift[4][2] = {{0, 8}, {16, 24}, {4, 12}, {20, 28}};  // vector v's shifts: low | high half

// The element whose weight position p of a super-block's 256 holds, in the kernel's order.
constexpr int q4k_element(int p) {
#if defined(__AVX512F__)  // chunk c = p / 64: vectors v of 16 lanes, 8 a half, over its 32 bytes
  const int c = p / 64, v = p % 64 / 16, lane = p % 16, shift = kQ4KShift[v][lane / 8];
  return 32 * (2 * c + shift % 8 / 4) + 4 * (lane % 8) + shift / 8;
#else  // sub-block j = p / 32: bytes 16 g on (g = 0, 1), vectors v of 8 lanes, 4 a half
  const int j = p / 32, g = p % 32 / 16, v = 2 * (j % 2) + p % 16 / 8, lane = p % 8, shift = kQ4KShift[v][lane / 4];
  return 32 * j + 16 * g + 4 * (lane % 4) + shift / 8;
#endif
}

void q4k_order(const float* x, float* xk, int64_t n) {  // n: whole super-blocks of x, in rows
  static const auto order = [] {
    std::array<int, 256> o{};
    for (int p = 0; p < 256; ++p) o[p] = q4k_element(p);
    return o;
  }();
  for (int64_t b = 0; b < n; b += 256)
    for (int p = 0; p < 256; ++p) xk[b + p] = x[b + order[p]];
}

// A super-block's eight 6-bit scales (bytes 0-7) and mins (bytes 8-15), unpacked from their 12 bytes a word at a
// time (k4_scale's layout).
inline __m128i q4k_scale_bytes(const uint8_t* b) {
  uint32_t u[3];
  std::memcpy(u, b + 4, 12);
  const uint32_t scale_hi = (u[2] & 0x0f0f0f0f) | ((u[0] >> 2) & 0x30303030);
  const uint32_t min_hi = ((u[2] >> 4) & 0x0f0f0f0f) | ((u[1] >> 2) & 0x30303030);
  return _mm_setr_epi32(static_cast<int>(u[0] & 0x3f3f3f3f), static_cast<int>(scale_hi),
                        static_cast<int>(u[1] & 0x3f3f3f3f), static_cast<int>(min_hi));
}

// The super-block's eight d scale_j (out[0-7]) and dmin min_j (out[8-15]).
inline void q4k_scale_floats(const uint8_t* b, float* out) {
  const __m128i bytes = q4k_scale_bytes(b);
  _mm256_storeu_ps(out, _mm256_mul_ps(_mm256_set1_ps(half(b)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes))));
  _mm256_storeu_ps(out + 8, _mm256_mul_ps(_mm256_set1_ps(half(b + 2)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
                                                                          _mm_unpackhi_epi64(bytes, bytes)))));
}
#endif

#if defined(__AVX512F__)
// The super-block's eight d scale (lanes 0-7) and dmin min (lanes 8-15).
inline __m512 q4k_scales(const uint8_t* b) {
  const __m512 d = _mm512_mask_blend_ps(0xff00, _mm512_set1_ps(half(b)), _mm512_set1_ps(half(b + 2)));
  return _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q4k_scale_bytes(b))));
}

// One output row for M activation rows (xk: x in q4k_order), of Q4_K or Q5_K (the same nibbles and scales, and a
// fifth bit per weight in qh: bit j of byte l is sub-block j's element l's; rotating qh's lanes puts a lane's bit
// at bit 4 of its index, and a 32-entry permutation of two tables reads it). Four sets of accumulators for one or
// two rows, so that the FMAs of a row do not wait on each other.
template <int64_t T, int M>
void dot_row_k4(const float* xk, const RowAux&, const uint8_t* row, float* y, int64_t ldy, int64_t, int64_t K) {
  constexpr int64_t bb = block_bytes(T), qs_at = T == Q5_K ? 48 : 16;
  constexpr int kSets = M <= 2 ? 4 : 2;
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 iota16 = _mm512_add_ps(iota, _mm512_set1_ps(16.f));
  __m512i shift[4], rotate[4];  // rotate: lane's qh bit of sub-block 2c + v / 2 to bit 4, less 2c
  for (int v = 0; v < 4; ++v) {
    shift[v] = _mm512_mask_blend_epi32(0xff00, _mm512_set1_epi32(kQ4KShift[v][0]), _mm512_set1_epi32(kQ4KShift[v][1]));
    rotate[v] = _mm512_mask_blend_epi32(0xff00, _mm512_set1_epi32(kQ4KShift[v][0] / 8 * 8 + v / 2 - 4),
                                        _mm512_set1_epi32(kQ4KShift[v][1] / 8 * 8 + v / 2 - 4));
  }
  __m512 acc[kSets][M];
  for (int k = 0; k < kSets; ++k)
    for (int m = 0; m < M; ++m) acc[k][m] = _mm512_setzero_ps();
  // The scales of up to kScaleRun super-blocks first, apart from the products that read them (8% faster than
  // unpacking each super-block's in turn).
  constexpr int64_t kScaleRun = 64;
  alignas(64) float scales[kScaleRun * 16];
  for (int64_t b0 = 0; b0 < K / 256; b0 += kScaleRun) {
    const int64_t run = std::min(kScaleRun, K / 256 - b0);
    for (int64_t b = 0; b < run; ++b) _mm512_store_ps(scales + 16 * b, q4k_scales(row + (b0 + b) * bb));
    for (int64_t b = b0; b < b0 + run; ++b) {
      const uint8_t* blk = row + b * bb;
      prefetch_super_block<T>(blk);
      const float* sm = scales + 16 * (b - b0);
      const __m512i qh = T == Q5_K ? _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16)))
                                   : _mm512_setzero_si512();
      for (int c = 0; c < 4; ++c) {
        const __m512i q = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + qs_at + 32 * c)));
        __m512 table[2][2];  // sub-block 2c + t's weights for n = 0-15 (and Q5_K's 16-31)
        for (int t = 0; t < 2; ++t) {
          const __m512 ds = _mm512_set1_ps(sm[2 * c + t]), dm = _mm512_set1_ps(sm[8 + 2 * c + t]);
          table[t][0] = _mm512_fmsub_ps(ds, iota, dm);
          if constexpr (T == Q5_K) table[t][1] = _mm512_fmsub_ps(ds, iota16, dm);
        }
        for (int v = 0; v < 4; ++v) {
          __m512 w;
          if constexpr (T == Q5_K) {  // bit 4 of the index from qh, bits 0-3 from the nibble
            const __m512i high = _mm512_rorv_epi32(qh, _mm512_add_epi32(rotate[v], _mm512_set1_epi32(2 * c)));
            const __m512i index = _mm512_ternarylogic_epi32(_mm512_srlv_epi32(q, shift[v]), high, _mm512_set1_epi32(16), 0xd8);
            w = _mm512_permutex2var_ps(table[v / 2][0], index, table[v / 2][1]);
          } else {
            w = _mm512_permutexvar_ps(_mm512_srlv_epi32(q, shift[v]), table[v / 2][0]);
          }
          for (int m = 0; m < M; ++m) {
            __m512& a = acc[(4 * c + v) % kSets][m];
            a = _mm512_fmadd_ps(w, _mm512_loadu_ps(xk + m * K + 256 * b + 64 * c + 16 * v), a);
          }
        }
      }
    }
  }
  for (int m = 0; m < M; ++m) {
    __m512 total = acc[0][m];
    for (int k = 1; k < kSets; ++k) total = _mm512_add_ps(total, acc[k][m]);
    y[m * ldy] = _mm512_reduce_add_ps(total);
  }
}
#elif defined(__AVX2__) && defined(__FMA__)
// One output row for M activation rows (xk: x in q4k_order), with the accumulators of sum_blocks over the
// 32-weight sub-blocks: sum_j d scale_j (q_j . x_j) - dmin min_j sum(x_j).
template <int64_t T, int M>
void dot_row_k4(const float* xk, const RowAux& aux, const uint8_t* row, float* y, int64_t ldy, int64_t blocks,
                int64_t K) {
  static_assert(T == Q4_K, "AVX2 reads Q4_K in registers only");
  constexpr int64_t bb = block_bytes(Q4_K);
  thread_local std::vector<float> scales;  // each super-block's d scale_j and dmin min_j, j = 0..7
  scales.resize(K / 256 * 16);
  for (int64_t sup = 0; sup < K / 256; ++sup) {  // ahead of the products that read them
    prefetch_super_block<Q4_K>(row + sup * bb);
    q4k_scale_floats(row + sup * bb, scales.data() + 16 * sup);
  }
  __m256i shift[4];
  for (int v = 0; v < 4; ++v)
    shift[v] = _mm256_setr_epi32(kQ4KShift[v][0], kQ4KShift[v][0], kQ4KShift[v][0], kQ4KShift[v][0],
                                 kQ4KShift[v][1], kQ4KShift[v][1], kQ4KShift[v][1], kQ4KShift[v][1]);
  const __m256i nibble = _mm256_set1_epi32(0x0f);
  sum_blocks<M>(blocks, y, ldy, [&](int64_t b, __m256* a, float* o) {
    const int j = static_cast<int>(b % 8);
    const uint8_t* qs = row + b / 8 * bb + 16 + 32 * (j / 2);
    const float* sm = scales.data() + 16 * (b / 8);
    __m256 v[4];
    for (int g = 0; g < 2; ++g) {
      const __m256i q = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + 16 * g)));
      for (int h = 0; h < 2; ++h)
        v[2 * g + h] = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(q, shift[2 * (j % 2) + h]), nibble));
    }
    const __m256 dv = _mm256_set1_ps(sm[j]);
    for (int m = 0; m < M; ++m) {
      const float* xb = xk + m * K + b * kBlock;
      a[m] = _mm256_fmadd_ps(dot32(v, xb), dv, a[m]);
      o[m] -= sm[8 + j] * aux.xsum[m * blocks + b];
    }
  });
}
#endif

// --- Q6_K (and Q5_K without AVX-512): integers as bytes ---
// One output row for M activation rows: each super-block's integers decoded into bytes (q6k_ints, q5k_ints),
// widened a vector at a time, scaled (less the min) as decoding rounds them (byte_weights) and multiplied by x: the
// weights never go through L1 as floats (the store and load of dot_row_decoded, and one shuffle a vector fewer).
// The sub-block scales of up to kScaleRun super-blocks are converted first, apart from the products that read them
// (a fifth faster than each super-block's in turn). Four sets of accumulators for one or two rows, two for more.
#if defined(__AVX2__)
// Q5_K's integers (0-31) as bytes, in element order: element 32 j + l is the low (j even) or high nibble of
// qs[32 (j / 2) + l], with bit j of qh[l] as its fifth bit.
inline void q5k_ints(const uint8_t* b, int8_t* q) {  // d | dmin | scales[12] | qh[32] | qs[128]
  const __m256i nibble = _mm256_set1_epi8(0x0f), one = _mm256_set1_epi8(1), high = load32(b + 16);
  for (int j = 0; j < 8; ++j) {
    const __m256i qs = load32(b + 48 + 32 * (j / 2));
    const __m256i low = _mm256_and_si256(j % 2 ? _mm256_srli_epi16(qs, 4) : qs, nibble);
    const __m256i bit = _mm256_and_si256(_mm256_srl_epi16(high, _mm_cvtsi32_si128(j)), one);
    _mm256_store_si256(reinterpret_cast<__m256i*>(q + 32 * j), _mm256_or_si256(low, _mm256_slli_epi16(bit, 4)));
  }
}
#endif

#if defined(FW_BYTE_VECTORS)
constexpr bool byte_kernel(int64_t qtype) { return qtype == Q6_K || (qtype == Q5_K && !k4_registers(Q5_K)); }

template <int64_t T, int M>
void dot_row_bytes(const float* x, const RowAux&, const uint8_t* row, float* y, int64_t ldy, int64_t, int64_t K) {
  using Vec = decltype(byte_ints(nullptr));
  constexpr int64_t bb = block_bytes(T), group = T == Q6_K ? 16 : 32;  // weights a scale covers
  constexpr int kSets = M <= 2 ? 4 : 2, kVectors = 256 / kByteLanes;
  Vec acc[kSets][M];
  for (int k = 0; k < kSets; ++k)
    for (int m = 0; m < M; ++m) acc[k][m] = Vec{};
  constexpr int64_t kScaleRun = 64;
  alignas(64) float scales[kScaleRun * 16];  // Q6_K: 16 d scale_g; Q5_K: 8 d scale_j, then 8 dmin min_j
  alignas(64) int8_t q[256];
  for (int64_t b0 = 0; b0 < K / 256; b0 += kScaleRun) {
    const int64_t run = std::min(kScaleRun, K / 256 - b0);
    for (int64_t b = 0; b < run; ++b) {
      if constexpr (T == Q6_K) q6k_scales(row + (b0 + b) * bb, scales + 16 * b);
      else q4k_scale_floats(row + (b0 + b) * bb, scales + 16 * b);
    }
    for (int64_t b = b0; b < b0 + run; ++b) {
      prefetch_super_block<T>(row + b * bb);
      if constexpr (T == Q6_K) q6k_ints(row + b * bb, q);
      else q5k_ints(row + b * bb, q);
      const float* ds = scales + 16 * (b - b0);
#pragma GCC unroll 32  // constant accumulator indices: a loop would keep them in memory
      for (int v = 0; v < kVectors; ++v) {
        const int g = kByteLanes * v / group;
        Vec w;
        if constexpr (T == Q6_K) w = byte_weights(q + kByteLanes * v, ds[g]);
        else w = byte_weights(q + kByteLanes * v, ds[g], ds[8 + g]);
        for (int m = 0; m < M; ++m) {
          Vec& a = acc[v % kSets][m];
          a = fma_x(w, x + m * K + 256 * b + kByteLanes * v, a);
        }
      }
    }
  }
  for (int m = 0; m < M; ++m) {
    Vec total = acc[0][m];
    for (int k = 1; k < kSets; ++k) total = total + acc[k][m];
    y[m * ldy] = lanes_sum(total);
  }
}
#else
constexpr bool byte_kernel(int64_t) { return false; }
template <int64_t T, int M>
void dot_row_bytes(const float*, const RowAux&, const uint8_t*, float*, int64_t, int64_t, int64_t);
#endif

// --- integer activations ---
// Each block of 32 activation values becomes xq = round(x / dx), half to even as torch.round, with
// dx = absmax / L: L = 127 for int8 (as llama.cpp) and 32767 for int16 (fw.layers.linear.int_blocks is the same
// rounding in torch), and xs = dx * sum(xq), which the block offsets multiply. |x / dx| <= L up to rounding, so
// no clamp is needed. int16 keeps the float product to about 1e-5 (relative to a block's largest value) while
// its integer products take a third of the instructions of widening the weights to float.
template <typename A>
constexpr float kLevels = sizeof(A) == 1 ? 127.f : 32767.f;

#if defined(__AVX2__)
template <typename A>
inline void quantize_block(const float* x, A* q, float& dx, float& xs) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 v[4], amax = _mm256_setzero_ps();
  for (int k = 0; k < 4; ++k) v[k] = _mm256_loadu_ps(x + 8 * k), amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[k]));
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  dx = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m))) / kLevels<A>;
  const __m256 div = _mm256_set1_ps(dx > 0.f ? dx : 1.f);
  __m256i i[4];
  for (int k = 0; k < 4; ++k)
    i[k] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_div_ps(v[k], div), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  // The packs interleave 128-bit lanes; the permutations put their groups back in order.
  const __m256i lo = _mm256_packs_epi32(i[0], i[1]), hi = _mm256_packs_epi32(i[2], i[3]);
  if constexpr (sizeof(A) == 1) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm256_permutevar8x32_epi32(
        _mm256_packs_epi16(lo, hi), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  } else {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm256_permute4x64_epi64(lo, 0xd8));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 16), _mm256_permute4x64_epi64(hi, 0xd8));
  }
  const __m256i sum = _mm256_add_epi32(_mm256_add_epi32(i[0], i[1]), _mm256_add_epi32(i[2], i[3]));
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
  xs = dx * static_cast<float>(_mm_cvtsi128_si32(s));
}
#else
template <typename A>
inline void quantize_block(const float* x, A* q, float& dx, float& xs) {
  float amax = 0.f;
  for (int j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(x[j]));
  dx = amax / kLevels<A>;
  const float div = dx > 0.f ? dx : 1.f;
  int32_t sum = 0;
  for (int j = 0; j < kBlock; ++j) sum += q[j] = static_cast<A>(std::nearbyint(x[j] / div));
  xs = dx * static_cast<float>(sum);
}
#endif

// One output row for M activation rows: y = sum_b d_b dx_b (q_b . xq_b) + offset_b xs_b, with the 4-bit types'
// unsigned nibbles as q (Q4_0's -8 is in its offset) and Q8_0's signed bytes. One row at a time: several rows
// sharing each load of x (as the GPTQ kernel does) measured slower here, as they interleave the weight streams.
#if defined(__AVX2__) && defined(__FMA__)
// The 32 integer weights of a block as bytes, in element order.
template <int64_t T>
inline __m256i block_bytes_int(const uint8_t* blk) {
  if constexpr (T == Q8_0) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
  const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + (T == Q4_0 ? 2 : 4)));
  const __m128i mask = _mm_set1_epi8(0x0f);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(qs, 4), mask), _mm_and_si128(qs, mask));
}

// Eight int32 sums of 4 products each of unsigned bytes u and signed bytes s: one instruction with VNNI. Without
// it the pairs' int16 sums cannot saturate: |u| <= 128 (Q8_0 as |w|), |s| <= 127.
inline __m256i dot_bytes(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

// A block's weights, ready for A activations; dot(xq) gives eight int32 partial sums of q . xq.
template <int64_t T, typename A>
struct IntBlock;

template <int64_t T>
struct IntBlock<T, int8_t> {  // unsigned times signed bytes: Q8_0 as |w| times x with w's sign
  __m256i w, u;
  explicit IntBlock(const uint8_t* blk) : w(block_bytes_int<T>(blk)), u(T == Q8_0 ? _mm256_sign_epi8(w, w) : w) {}
  __m256i dot(const int8_t* xq) const {
    const __m256i xb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq));
    return dot_bytes(u, T == Q8_0 ? _mm256_sign_epi8(xb, w) : xb);
  }
};

template <int64_t T>
struct IntBlock<T, int16_t> {  // int16 pairs: |q| <= 128 and |xq| <= 32767 cannot overflow the int32 sums
  __m256i lo, hi;  // elements 0-15 and 16-31
  explicit IntBlock(const uint8_t* blk) {
    const __m256i w = block_bytes_int<T>(blk);
    if constexpr (T == Q8_0) {
      lo = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(w)), hi = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(w, 1));
    } else {
      lo = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(w)), hi = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(w, 1));
    }
  }
  __m256i dot(const int16_t* xq) const {
    return _mm256_add_epi32(_mm256_madd_epi16(lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq))),
                            _mm256_madd_epi16(hi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 16))));
  }
};

template <int64_t T, typename A, int M>
void dot_row_int(const A* xq, const float* dx, const float* xs, const uint8_t* row, float* y, int64_t ldy,
                 int64_t blocks, int64_t K) {
  constexpr int64_t bb = block_bytes(T);
  for (int64_t off = 0; off < blocks * bb; off += 64) fw::prefetch_far_and_near(row + off);  // a row's lines, once
  sum_blocks<M>(blocks, y, ldy, [&](int64_t b, __m256* a, float* o) {
    const uint8_t* blk = row + b * bb;
    float d, offset;
    block_scales<T>(blk, d, offset);
    const IntBlock<T, A> w(blk);
    for (int m = 0; m < M; ++m) {
      const __m256i dot = w.dot(xq + m * K + b * kBlock);
      a[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(d * dx[m * blocks + b]), a[m]);
      if constexpr (T != Q8_0) o[m] += offset * xs[m * blocks + b];
    }
  });
}
#else
template <int64_t T, typename A, int M>
void dot_row_int(const A* xq, const float* dx, const float* xs, const uint8_t* row, float* y, int64_t ldy,
                 int64_t blocks, int64_t K) {
  constexpr int64_t bb = block_bytes(T);
  float acc[M] = {0.f};
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* blk = row + b * bb;
    const float d = half(blk), offset = block_offset(blk, T, d);
    int32_t q[kBlock];
    for (int j = 0; j < 16; ++j) {
      q[j] = T == Q8_0 ? static_cast<int8_t>(blk[2 + j]) : blk[bb - 16 + j] & 0x0f;
      q[j + 16] = T == Q8_0 ? static_cast<int8_t>(blk[18 + j]) : blk[bb - 16 + j] >> 4;
    }
    for (int m = 0; m < M; ++m) {
      int32_t dot = 0;
      for (int j = 0; j < kBlock; ++j) dot += q[j] * xq[m * K + b * kBlock + j];
      acc[m] += d * dx[m * blocks + b] * static_cast<float>(dot) + offset * xs[m * blocks + b];
    }
  }
  for (int m = 0; m < M; ++m) y[m * ldy] = acc[m];
}
#endif

// --- the operators ---

int64_t row_bytes(int64_t qtype, int64_t K) { return K / block_size(qtype) * block_bytes(qtype); }

// Checks the (byte offset, rows, ggml type) triples against the weight (the types with kernels of their own
// only, for the integer products); returns their total rows.
int64_t check_shards(const at::Tensor& x, const at::Tensor& weight, at::IntArrayRef shards, bool own_only = false) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % kBlock == 0, "x must be [rows, 32k]");
  TORCH_CHECK(weight.scalar_type() == at::kByte && weight.is_contiguous(), "weight must be contiguous uint8");
  TORCH_CHECK(!shards.empty() && shards.size() % 3 == 0, "shards must be (offset, rows, type) triples");
  int64_t total = 0;
  for (size_t i = 0; i < shards.size(); i += 3) {
    const int64_t offset = shards[i], rows = shards[i + 1], qtype = shards[i + 2];
    TORCH_CHECK(block_bytes(qtype) && (own_kernel(qtype) || !own_only), "unsupported ggml type ", qtype);
    TORCH_CHECK(x.size(1) % block_size(qtype) == 0, "x's features must be whole blocks of ", block_size(qtype));
    TORCH_CHECK(offset >= 0 && offset + rows * row_bytes(qtype, x.size(1)) <= weight.numel(), "shard out of range");
    total += rows;
  }
  return total;
}

// span(qtype, first row's blocks, bytes per row, first output column, columns) over every output column of
// all the shards (side by side), in one parallel region: a fused layer's shards share its start-up cost.
template <typename Span>
void for_each_span(const uint8_t* w, at::IntArrayRef shards, int64_t K, int64_t total, const Span& span) {
  at::parallel_for(0, total, 16, [&](int64_t begin, int64_t end) {
    int64_t first = 0;  // shard i's first column
    for (size_t i = 0; i < shards.size() && first < end; first += shards[i + 1], i += 3) {
      const int64_t lo = std::max(begin, first), hi = std::min(end, first + shards[i + 1]);
      if (lo >= hi) continue;
      const int64_t bytes = row_bytes(shards[i + 2], K);
      span(shards[i + 2], w + shards[i] + (lo - first) * bytes, bytes, lo, hi - lo);
    }
  });
}

using RowFn = void (*)(const float*, const RowAux&, const uint8_t*, float*, int64_t, int64_t, int64_t);

template <int64_t T, size_t... I>
constexpr std::array<RowFn, kMaxRows> float_kernels(std::index_sequence<I...>) {  // for 1 .. kMaxRows rows
  if constexpr (own_kernel(T))
    return {dot_row<T, I + 1>...};
  else if constexpr (k4_registers(T))
    return {dot_row_k4<T, I + 1>...};
  else if constexpr (byte_kernel(T))
    return {dot_row_bytes<T, I + 1>...};
  else
    return {dot_row_decoded<T, I + 1>...};
}

// The row functions of a type without a kernel of its own.
const std::array<RowFn, kMaxRows>& decoded_kernels(int64_t qtype) {
  static constexpr auto kQ5_0 = float_kernels<Q5_0>(std::make_index_sequence<kMaxRows>());
  static constexpr auto kQ5_1 = float_kernels<Q5_1>(std::make_index_sequence<kMaxRows>());
  static constexpr auto kQ2_K = float_kernels<Q2_K>(std::make_index_sequence<kMaxRows>());
  static constexpr auto kQ3_K = float_kernels<Q3_K>(std::make_index_sequence<kMaxRows>());
  static constexpr auto kQ4_K = float_kernels<Q4_K>(std::make_index_sequence<kMaxRows>());
  static constexpr auto kQ5_K = float_kernels<Q5_K>(std::make_index_sequence<kMaxRows>());
  static constexpr auto kQ6_K = float_kernels<Q6_K>(std::make_index_sequence<kMaxRows>());
  switch (qtype) {
    case Q5_0: return kQ5_0;
    case Q5_1: return kQ5_1;
    case Q2_K: return kQ2_K;
    case Q3_K: return kQ3_K;
    case Q4_K: return kQ4_K;
    case Q5_K: return kQ5_K;
    default: return kQ6_K;
  }
}

// x [M, K] (K whole blocks of every type); weight: uint8, holding sub-matrices given as (byte offset, rows,
// ggml type) triples in `shards`, each rows x K weights in blocks. Returns x.dtype [M, total rows], the
// sub-matrices' outputs side by side (q | k | v, gate | up): one call per fused layer. Activation rows go
// in groups of at most kMaxRows, so that the accumulators stay in registers.
at::Tensor quant_gemv(const at::Tensor& x, const at::Tensor& weight, at::IntArrayRef shards) {
  const int64_t total = check_shards(x, weight, shards), M = x.size(0), K = x.size(1), blocks = K / kBlock;
  auto xf = x.to(at::kFloat).contiguous();
  const float* xp = xf.data_ptr<float>();
  auto y = at::empty({M, total}, xf.options());
  static constexpr auto kQ4_0 = float_kernels<Q4_0>(std::make_index_sequence<kMaxRows>());
  static constexpr auto kQ4_1 = float_kernels<Q4_1>(std::make_index_sequence<kMaxRows>());
  static constexpr auto kQ8_0 = float_kernels<Q8_0>(std::make_index_sequence<kMaxRows>());
  float* yp = y.data_ptr<float>();
  // products(type, fns, first row, count, aux of the first row): the products of `count` rows from `first`.
  // More than kMaxRows rows of x pass over the same weight rows once per group of x rows: a few weight rows at a
  // time (kPassBytes), which stay in L1 and L2 between the passes instead of streaming from memory again.
  constexpr int64_t kPassBytes = 32 << 10;
  std::vector<float> xk;  // x in the order of the types read in registers by dot_row_k4 (q4k_order)
#if defined(__AVX2__) && defined(__FMA__)
  for (size_t i = 2; i < shards.size() && xk.empty(); i += 3)
    if (k4_registers(shards[i])) xk.resize(M * K), q4k_order(xp, xk.data(), M * K);
#endif
  auto products = [&](int64_t qtype, const std::array<RowFn, kMaxRows>& fns, const uint8_t* first, int64_t bytes,
                      int64_t c, int64_t count, const auto& aux) {
    const float* xs = k4_registers(qtype) ? xk.data() : xp;
    const int64_t pass = M <= kMaxRows ? count : std::max<int64_t>(1, kPassBytes / bytes);
    for (int64_t n0 = 0; n0 < count; n0 += pass)
      for (int64_t m = 0; m < M; m += kMaxRows)
        for (int64_t n = n0; n < std::min(count, n0 + pass); ++n)
          fns[std::min(kMaxRows, M - m) - 1](xs + m * K, aux(m, n), first + n * bytes, yp + m * total + c + n, total,
                                             blocks, K);
  };
#if defined(__AVX512F__)
  // The scales of up to kScaleBlocks blocks (a few rows) at a time.
  constexpr int64_t kScaleBlocks = 1024;
  const int64_t group = std::max<int64_t>(1, kScaleBlocks / blocks);
  for_each_span(weight.data_ptr<uint8_t>(), shards, K, total,
                [&](int64_t qtype, const uint8_t* rows, int64_t bytes, int64_t c, int64_t count) {
                  if (!own_kernel(qtype) || qtype == Q8_0)
                    return products(qtype, qtype == Q8_0 ? kQ8_0 : decoded_kernels(qtype), rows, bytes, c, count,
                                    [](int64_t, int64_t) { return RowAux{nullptr, nullptr, nullptr}; });
                  const auto& fns = qtype == Q4_0 ? kQ4_0 : kQ4_1;
                  const auto scales = qtype == Q4_0 ? span_scales<Q4_0> : span_scales<Q4_1>;
                  const int64_t padded = (std::min(group, count) * blocks + kRun - 1) / kRun * kRun;
                  std::vector<float> d(padded), o(padded);
                  for (int64_t n0 = 0; n0 < count; n0 += group) {
                    const int64_t g = std::min(group, count - n0);
                    scales(rows + n0 * bytes, g * blocks, d.data(), o.data());
                    products(qtype, fns, rows + n0 * bytes, bytes, c + n0, g, [&](int64_t, int64_t n) {
                      return RowAux{nullptr, d.data() + n * blocks, o.data() + n * blocks};
                    });
                  }
                });
#else
  // Each block's sum of x (for the offsets), here rather than as torch ops: a decode step makes hundreds of
  // these calls, and each op's dispatch cost more than its arithmetic.
  std::vector<float> xsum(M * blocks);
  for (int64_t b = 0; b < M * blocks; ++b) {
    float s = 0.f;
    for (int64_t j = 0; j < kBlock; ++j) s += xp[b * kBlock + j];
    xsum[b] = s;
  }
  for_each_span(weight.data_ptr<uint8_t>(), shards, K, total,
                [&](int64_t qtype, const uint8_t* rows, int64_t bytes, int64_t c, int64_t count) {
                  products(qtype,
                           qtype == Q4_0   ? kQ4_0
                           : qtype == Q4_1 ? kQ4_1
                           : qtype == Q8_0 ? kQ8_0
                                           : decoded_kernels(qtype),
                           rows, bytes, c, count,
                           [&](int64_t m, int64_t) { return RowAux{xsum.data() + m * blocks, nullptr, nullptr}; });
                });
#endif
  return y.to(x.scalar_type());
}

template <typename A>
using IntFn = void (*)(const A*, const float*, const float*, const uint8_t*, float*, int64_t, int64_t, int64_t);

template <int64_t T, typename A, size_t... I>
constexpr std::array<IntFn<A>, kMaxRows> int_kernels(std::index_sequence<I...>) {  // for 1 .. kMaxRows rows
  return {dot_row_int<T, A, I + 1>...};
}

// As quant_gemv, with each block of x rounded to A (int8 or int16) first (quantize_block).
template <typename A>
at::Tensor quant_gemv_int(const at::Tensor& x, const at::Tensor& weight, at::IntArrayRef shards) {
  const int64_t total = check_shards(x, weight, shards, true), M = x.size(0), K = x.size(1), blocks = K / kBlock;
  auto xf = x.to(at::kFloat).contiguous();
  const float* xp = xf.data_ptr<float>();
  std::vector<A> xq(M * K);
  std::vector<float> dx(M * blocks), xs(M * blocks);
  for (int64_t b = 0; b < M * blocks; ++b) quantize_block(xp + b * kBlock, xq.data() + b * kBlock, dx[b], xs[b]);
  auto y = at::empty({M, total}, xf.options());
  static constexpr auto kQ4_0 = int_kernels<Q4_0, A>(std::make_index_sequence<kMaxRows>());
  static constexpr auto kQ4_1 = int_kernels<Q4_1, A>(std::make_index_sequence<kMaxRows>());
  static constexpr auto kQ8_0 = int_kernels<Q8_0, A>(std::make_index_sequence<kMaxRows>());
  float* yp = y.data_ptr<float>();
  for_each_span(weight.data_ptr<uint8_t>(), shards, K, total,
                [&](int64_t qtype, const uint8_t* rows, int64_t bytes, int64_t c, int64_t count) {
                  const auto& fns = qtype == Q4_0 ? kQ4_0 : qtype == Q4_1 ? kQ4_1 : kQ8_0;
                  for (int64_t m = 0; m < M; m += kMaxRows)
                    for (int64_t n = 0; n < count; ++n)
                      fns[std::min(kMaxRows, M - m) - 1](xq.data() + m * K, dx.data() + m * blocks,
                                                         xs.data() + m * blocks, rows + n * bytes,
                                                         yp + m * total + c + n, total, blocks, K);
                });
  return y.to(x.scalar_type());
}

using DecodeFn = void (*)(const uint8_t*, float*);

DecodeFn decoder(int64_t qtype) {
  switch (qtype) {
    case Q4_0: return decode<Q4_0>;
    case Q4_1: return decode<Q4_1>;
    case Q5_0: return decode<Q5_0>;
    case Q5_1: return decode<Q5_1>;
    case Q8_0: return decode<Q8_0>;
    case Q2_K: return decode<Q2_K>;
    case Q3_K: return decode<Q3_K>;
    case Q4_K: return decode<Q4_K>;
    case Q5_K: return decode<Q5_K>;
    case Q6_K: return decode<Q6_K>;
    default: return nullptr;
  }
}

// blocks [rows, row bytes] of one ggml type -> [rows, K] in dtype (float32 or bfloat16, rounded to nearest even
// as a conversion in torch), rows in parallel: what prefill-sized products multiply densely, a chunk of rows at a
// time. The same values as dequant.py's torch decoding, several times faster.
at::Tensor dequantize(const at::Tensor& blocks, int64_t qtype, at::ScalarType dtype) {
  const DecodeFn decode_block = decoder(qtype);
  TORCH_CHECK(decode_block, "unsupported ggml type ", qtype);
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "dtype must be float32 or bfloat16");
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.is_contiguous() &&
                  blocks.size(1) % block_bytes(qtype) == 0,
              "blocks must be contiguous uint8 [rows, whole blocks]");
  const int64_t bb = block_bytes(qtype), bs = block_size(qtype), rows = blocks.size(0), per_row = blocks.size(1) / bb;
  auto out = at::empty({rows, per_row * bs}, blocks.options().dtype(dtype));
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  // float32 decodes straight into the output: a block's 128 or 1024 bytes keep the allocator's 64-byte alignment,
  // which the decoders' aligned stores need.
  float* out_f = dtype == at::kFloat ? out.data_ptr<float>() : nullptr;
  at::BFloat16* out_b = dtype == at::kFloat ? nullptr : out.data_ptr<at::BFloat16>();
  at::parallel_for(0, rows * per_row, 64, [&](int64_t begin, int64_t end) {
    alignas(64) float w[256];
    for (int64_t b = begin; b < end; ++b) {
      if (out_f) {
        decode_block(src + b * bb, out_f + b * bs);
        continue;
      }
      decode_block(src + b * bb, w);
      for (int64_t j = 0; j < bs; ++j) out_b[b * bs + j] = at::BFloat16(w[j]);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(fw_quant_gguf, m) {
  m.def("quant_gemv(Tensor x, Tensor weight, int[] shards) -> Tensor");
  m.impl("quant_gemv", c10::DispatchKey::CPU, TORCH_FN(quant_gemv));
  m.def("quant_gemv_a8(Tensor x, Tensor weight, int[] shards) -> Tensor");
  m.impl("quant_gemv_a8", c10::DispatchKey::CPU, TORCH_FN(quant_gemv_int<int8_t>));
  m.def("quant_gemv_a16(Tensor x, Tensor weight, int[] shards) -> Tensor");
  m.impl("quant_gemv_a16", c10::DispatchKey::CPU, TORCH_FN(quant_gemv_int<int16_t>));
  m.def("dequantize(Tensor blocks, int qtype, ScalarType dtype) -> Tensor");
  m.impl("dequantize", c10::DispatchKey::CPU, TORCH_FN(dequantize));
}

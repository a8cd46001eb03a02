// Products of a few activation rows with ggml-quantized weights (Q4_0, Q4_1, Q8_0), decoding each
// 32-weight block in registers as it streams by: the weights are read once, in their packed size,
// instead of being dequantized into a full float matrix first. For decode steps (few rows).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "fw_cpu.h"

namespace {

constexpr int64_t kBlock = 32, kMaxRows = 8;
enum QType : int64_t { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8 };  // ggml's type ids

int64_t block_bytes(int64_t qtype) { return qtype == Q4_0 ? 18 : qtype == Q4_1 ? 20 : 34; }

inline float half(const uint8_t* p) { return _cvtsh_ss(*reinterpret_cast<const uint16_t*>(p)); }

// The 32 integer weights of a block (before the scale d and the offset), in element order.
[[maybe_unused]] inline void block_ints(const uint8_t* b, int64_t qtype, float* q) {
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

#if defined(__AVX512F__)
// The integer weights of a block as floats: elements 0-15 and 16-31.
inline void block_vectors(const uint8_t* blk, int64_t qtype, __m512& lo, __m512& hi) {
  if (qtype == Q8_0) {
    const __m256i qs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
    lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(qs)));
    hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(qs, 1)));
  } else {
    const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + (qtype == Q4_0 ? 2 : 4)));
    const __m128i mask = _mm_set1_epi8(0x0f);
    lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(qs, mask)));
    hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(qs, 4), mask)));
  }
}

// One output row for M activation rows (M a constant, so the accumulators live in registers). Two sets of
// accumulators, even and odd blocks, halve the dependency chains through them.
template <int M>
void dot_row(const float* x, const float* xsum, const uint8_t* row, float* y, int64_t ldy, int64_t blocks,
             int64_t bb, int64_t K, int64_t qtype) {
  __m512 acc[2][M];
  float off[2][M];
  for (int s = 0; s < 2; ++s)
    for (int m = 0; m < M; ++m) acc[s][m] = _mm512_setzero_ps(), off[s][m] = 0.f;
  auto block = [&](int64_t b, __m512* a, float* o) {
    const uint8_t* blk = row + b * bb;
    const float d = half(blk), offset = block_offset(blk, qtype, d);
    __m512 lo, hi;
    block_vectors(blk, qtype, lo, hi);
    const __m512 dv = _mm512_set1_ps(d);
    for (int m = 0; m < M; ++m) {
      const float* xb = x + m * K + b * kBlock;
      const __m512 dot = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xb + 16), _mm512_mul_ps(lo, _mm512_loadu_ps(xb)));
      a[m] = _mm512_fmadd_ps(dot, dv, a[m]);
      o[m] += offset * xsum[m * blocks + b];
    }
  };
  int64_t b = 0;
  for (; b + 2 <= blocks; b += 2) {
    block(b, acc[0], off[0]);
    block(b + 1, acc[1], off[1]);
  }
  if (b < blocks) block(b, acc[0], off[0]);
  for (int m = 0; m < M; ++m) y[m * ldy] = _mm512_reduce_add_ps(_mm512_add_ps(acc[0][m], acc[1][m])) + off[0][m] + off[1][m];
}
#elif defined(__AVX2__) && defined(__FMA__)
// The integer weights of a block as floats, eight elements per vector (0-7, 8-15, 16-23, 24-31).
inline void block_vectors(const uint8_t* blk, int64_t qtype, __m256 v[4]) {
  if (qtype == Q8_0) {
    for (int k = 0; k < 4; ++k)
      v[k] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 2 + 8 * k))));
    return;
  }
  const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + (qtype == Q4_0 ? 2 : 4)));
  const __m128i mask = _mm_set1_epi8(0x0f);
  const __m128i lo = _mm_and_si128(qs, mask), hi = _mm_and_si128(_mm_srli_epi16(qs, 4), mask);
  v[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
  v[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
  v[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
  v[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
}

inline float reduce_add(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

// As the AVX-512 version, with one set of accumulators: 16 registers hold M <= 8 of them and a block.
template <int M>
void dot_row(const float* x, const float* xsum, const uint8_t* row, float* y, int64_t ldy, int64_t blocks,
             int64_t bb, int64_t K, int64_t qtype) {
  __m256 acc[M];
  float off[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps(), off[m] = 0.f;
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* blk = row + b * bb;
    const float d = half(blk), offset = block_offset(blk, qtype, d);
    __m256 v[4];
    block_vectors(blk, qtype, v);
    const __m256 dv = _mm256_set1_ps(d);
    for (int m = 0; m < M; ++m) {
      const float* xb = x + m * K + b * kBlock;
      __m256 dot = _mm256_mul_ps(v[0], _mm256_loadu_ps(xb));
      dot = _mm256_fmadd_ps(v[1], _mm256_loadu_ps(xb + 8), dot);
      dot = _mm256_fmadd_ps(v[2], _mm256_loadu_ps(xb + 16), dot);
      dot = _mm256_fmadd_ps(v[3], _mm256_loadu_ps(xb + 24), dot);
      acc[m] = _mm256_fmadd_ps(dot, dv, acc[m]);
      off[m] += offset * xsum[m * blocks + b];
    }
  }
  for (int m = 0; m < M; ++m) y[m * ldy] = reduce_add(acc[m]) + off[m];
}
#else
template <int M>
void dot_row(const float* x, const float* xsum, const uint8_t* row, float* y, int64_t ldy, int64_t blocks,
             int64_t bb, int64_t K, int64_t qtype) {
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
      acc[m] += d * dot + offset * xsum[m * blocks + b];
    }
  }
  for (int m = 0; m < M; ++m) y[m * ldy] = acc[m];
}
#endif

// y[m, n] = sum_b d_b (x_b . q_b) + offset_b sum(x_b), for the N rows of blocks at w.
void gemv(const float* x, const float* xsum, const uint8_t* w, float* y, int64_t ldy, int64_t M, int64_t N,
          int64_t K, int64_t qtype) {
  const int64_t blocks = K / kBlock, bb = block_bytes(qtype);
  using RowFn = void (*)(const float*, const float*, const uint8_t*, float*, int64_t, int64_t, int64_t, int64_t,
                         int64_t);
  static constexpr RowFn kRows[kMaxRows] = {dot_row<1>, dot_row<2>, dot_row<3>, dot_row<4>,
                                            dot_row<5>, dot_row<6>, dot_row<7>, dot_row<8>};
  if (M == 0) return;
  const RowFn fn = kRows[M - 1];
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) fn(x, xsum, w + n * blocks * bb, y + n, ldy, blocks, bb, K, qtype);
  });
}

// x [M, K] (K a multiple of 32); weight: uint8, holding sub-matrices given as (byte offset, rows,
// ggml type) triples in `shards`, each rows x K weights in blocks. Returns x.dtype [M, total rows], the
// sub-matrices' outputs side by side (q | k | v, gate | up): one call per fused layer.
at::Tensor quant_gemv(const at::Tensor& x, const at::Tensor& weight, at::IntArrayRef shards) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % kBlock == 0, "x must be [rows, 32k]");
  TORCH_CHECK(weight.scalar_type() == at::kByte && weight.is_contiguous(), "weight must be contiguous uint8");
  TORCH_CHECK(!shards.empty() && shards.size() % 3 == 0, "shards must be (offset, rows, type) triples");
  const int64_t M = x.size(0), K = x.size(1);
  int64_t total = 0;
  for (size_t i = 0; i < shards.size(); i += 3) {
    const int64_t offset = shards[i], rows = shards[i + 1], qtype = shards[i + 2];
    TORCH_CHECK(qtype == Q4_0 || qtype == Q4_1 || qtype == Q8_0, "unsupported ggml type ", qtype);
    TORCH_CHECK(offset >= 0 && offset + rows * (K / kBlock) * block_bytes(qtype) <= weight.numel(), "shard out of range");
    total += rows;
  }
  auto xf = x.to(at::kFloat).contiguous();
  // Each block's sum of x (for the offsets), here rather than as torch ops: a decode step makes hundreds of
  // these calls, and each op's dispatch cost more than its arithmetic.
  const int64_t blocks = M * (K / kBlock);
  std::vector<float> xsum(blocks);
  const float* xp = xf.data_ptr<float>();
  for (int64_t b = 0; b < blocks; ++b) {
    float s = 0.f;
    for (int64_t j = 0; j < kBlock; ++j) s += xp[b * kBlock + j];
    xsum[b] = s;
  }
  auto y = at::empty({M, total}, xf.options());
  int64_t column = 0;
  for (size_t i = 0; i < shards.size(); i += 3) {
    for (int64_t m = 0; m < M; m += kMaxRows) {  // rows in groups that fit the register accumulators
      gemv(xp + m * K, xsum.data() + m * (K / kBlock),
           weight.data_ptr<uint8_t>() + shards[i], y.data_ptr<float>() + m * total + column, total,
           std::min(kMaxRows, M - m), shards[i + 1], K, shards[i + 2]);
    }
    column += shards[i + 1];
  }
  return y.to(x.scalar_type());
}

}  // namespace

TORCH_LIBRARY(fw_quant_gguf, m) {
  m.def("quant_gemv(Tensor x, Tensor weight, int[] shards) -> Tensor");
  m.impl("quant_gemv", c10::DispatchKey::CPU, TORCH_FN(quant_gemv));
}

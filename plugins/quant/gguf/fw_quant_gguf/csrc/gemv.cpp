// Products of a few activation rows with ggml-quantized weights (Q4_0, Q4_1, Q8_0), decoding each
// 32-weight block in registers as it streams by: the weights are read once, in their packed size,
// instead of being dequantized into a full float matrix first. For decode steps (few rows).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

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

// y[m, n] = sum_b d_b (x_b . q_b) + offset_b sum(x_b), where offset is m_b (Q4_1), -8 d_b (Q4_0), 0 (Q8_0).
void gemv(const float* x, const float* xsum, const uint8_t* w, float* y, int64_t M, int64_t N, int64_t K,
          int64_t qtype) {
  const int64_t blocks = K / kBlock, bb = block_bytes(qtype);
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const uint8_t* row = w + n * blocks * bb;
#if defined(__AVX512F__)
      __m512 acc[kMaxRows];
      for (int64_t m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
#endif
      float offset_sum[kMaxRows] = {0.f}, scalar[kMaxRows] = {0.f};
      for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* blk = row + b * bb;
        const float d = half(blk);
        const float offset = qtype == Q4_1 ? half(blk + 2) : qtype == Q4_0 ? -8.f * d : 0.f;
#if defined(__AVX512F__)
        __m512 lo, hi;
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
        const __m512 dv = _mm512_set1_ps(d);
        for (int64_t m = 0; m < M; ++m) {
          const float* xb = x + m * K + b * kBlock;
          const __m512 dot = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xb + 16), _mm512_mul_ps(lo, _mm512_loadu_ps(xb)));
          acc[m] = _mm512_fmadd_ps(dot, dv, acc[m]);
          offset_sum[m] += offset * xsum[m * blocks + b];
        }
#else
        float q[32];
        block_ints(blk, qtype, q);
        for (int64_t m = 0; m < M; ++m) {
          const float* xb = x + m * K + b * kBlock;
          float dot = 0.f;
          for (int j = 0; j < 32; ++j) dot += q[j] * xb[j];
          scalar[m] += d * dot;
          offset_sum[m] += offset * xsum[m * blocks + b];
        }
#endif
      }
      for (int64_t m = 0; m < M; ++m) {
#if defined(__AVX512F__)
        scalar[m] = _mm512_reduce_add_ps(acc[m]);
#endif
        y[m * N + n] = scalar[m] + offset_sum[m];
      }
    }
  });
}

// x [M, K] (M <= 8, K a multiple of 32); weight: N rows of packed blocks, as uint8. Returns x.dtype [M, N].
at::Tensor quant_gemv(const at::Tensor& x, const at::Tensor& weight, int64_t rows, int64_t qtype) {
  TORCH_CHECK(qtype == Q4_0 || qtype == Q4_1 || qtype == Q8_0, "unsupported ggml type ", qtype);
  TORCH_CHECK(x.dim() == 2 && x.size(0) <= kMaxRows && x.size(1) % kBlock == 0, "x must be [<=8, 32k]");
  TORCH_CHECK(weight.scalar_type() == at::kByte && weight.is_contiguous(), "weight must be contiguous uint8");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(weight.numel() == rows * (K / kBlock) * block_bytes(qtype), "weight size does not match");
  auto xf = x.to(at::kFloat).contiguous();
  auto xsum = xf.view({M, K / kBlock, kBlock}).sum(-1).contiguous();
  auto y = at::empty({M, rows}, xf.options());
  gemv(xf.data_ptr<float>(), xsum.data_ptr<float>(), weight.data_ptr<uint8_t>(), y.data_ptr<float>(), M, rows, K,
       qtype);
  return y.to(x.scalar_type());
}

}  // namespace

TORCH_LIBRARY(fw_quant_gguf, m) {
  m.def("quant_gemv(Tensor x, Tensor weight, int rows, int qtype) -> Tensor");
  m.impl("quant_gemv", c10::DispatchKey::CPU, TORCH_FN(quant_gemv));
}

// Products of a few activation rows with 8-bit weights (FP8 e4m3fn, or int8 for the int8 plugin), widening each
// weight in registers as it streams by: the weights are read once at one byte each, half of bf16's traffic, which
// is what bounds a decode step. The CPU has no FP8 arithmetic; a weight's bits move into a float32's exponent and
// mantissa and one multiply by 2^120 rebiases the exponent (subnormals included), so the widening is exact.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>

#include "fw_cpu.h"

namespace {

constexpr int64_t kMaxRows = 8;
constexpr float kRebias = 1.329227995784915872903807060280344576e36f;  // 2^120

inline float widen_fp8(uint8_t b) {
  const uint32_t bits = (static_cast<uint32_t>(b & 0x80) << 24) | (static_cast<uint32_t>(b & 0x7f) << 20);
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f * kRebias;
}

inline float widen_int8(uint8_t b) { return static_cast<float>(static_cast<int8_t>(b)); }

#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;
using Vec = __m512;
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float vsum(Vec v) { return _mm512_reduce_add_ps(v); }
inline Vec vwiden_fp8(const uint8_t* w) {
  const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
  const __m512i bits = _mm512_or_si512(_mm512_slli_epi32(_mm512_and_si512(v, _mm512_set1_epi32(0x80)), 24),
                                       _mm512_slli_epi32(_mm512_and_si512(v, _mm512_set1_epi32(0x7f)), 20));
  return _mm512_mul_ps(_mm512_castsi512_ps(bits), _mm512_set1_ps(kRebias));
}
inline Vec vwiden_int8(const uint8_t* w) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w))));
}
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int64_t kLanes = 8;
using Vec = __m256;
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline float vsum(Vec v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}
inline Vec vwiden_fp8(const uint8_t* w) {
  const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w)));
  const __m256i bits = _mm256_or_si256(_mm256_slli_epi32(_mm256_and_si256(v, _mm256_set1_epi32(0x80)), 24),
                                       _mm256_slli_epi32(_mm256_and_si256(v, _mm256_set1_epi32(0x7f)), 20));
  return _mm256_mul_ps(_mm256_castsi256_ps(bits), _mm256_set1_ps(kRebias));
}
inline Vec vwiden_int8(const uint8_t* w) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w))));
}
#else
constexpr int64_t kLanes = 1;
using Vec = float;
inline Vec vzero() { return 0.f; }
inline Vec vload(const float* p) { return *p; }
inline Vec vfma(Vec a, Vec b, Vec c) { return a * b + c; }
inline float vsum(Vec v) { return v; }
inline Vec vwiden_fp8(const uint8_t* w) { return widen_fp8(*w); }
inline Vec vwiden_int8(const uint8_t* w) { return widen_int8(*w); }
#endif

// The element types: how one weight byte, and kLanes of them, widen to float32.
struct Fp8 {
  static float one(uint8_t b) { return widen_fp8(b); }
  static Vec lanes(const uint8_t* w) { return vwiden_fp8(w); }
};
struct Int8 {
  static float one(uint8_t b) { return widen_int8(b); }
  static Vec lanes(const uint8_t* w) { return vwiden_int8(w); }
};

// One output row for M activation rows (M a constant: the accumulators live in registers). Per scale group,
// sum w * x, then scale the group's sum: the same products as widening w * scale first, in float32.
template <class E, int M>
void dot_row(const float* x, const uint8_t* w, const float* scale, float* y, int64_t ldy, int64_t K,
             int64_t group, int64_t groups) {
  float out[M] = {0.f};
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t begin = g * group, end = std::min(K, begin + group);
    Vec acc[M];
    for (int m = 0; m < M; ++m) acc[m] = vzero();
    int64_t k = begin;
    for (; k + kLanes <= end; k += kLanes) {
      const Vec wv = E::lanes(w + k);
      for (int m = 0; m < M; ++m) acc[m] = vfma(wv, vload(x + m * K + k), acc[m]);
    }
    for (int m = 0; m < M; ++m) {
      float sum = vsum(acc[m]);
      for (int64_t j = k; j < end; ++j) sum += E::one(w[j]) * x[m * K + j];
      out[m] += sum * scale[g];
    }
  }
  for (int m = 0; m < M; ++m) y[m * ldy] = out[m];
}

// x [M, K]; weight: the 8-bit values' bits [N, K] as uint8; scale float32 [N, groups], each for `group` input
// features (the last group may be short). Returns float32 [M, N].
template <class E>
at::Tensor gemv(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale, int64_t group) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && weight.size(1) == x.size(1), "x [M, K] and weight [N, K]");
  TORCH_CHECK(weight.scalar_type() == at::kByte && weight.is_contiguous(), "weight must be contiguous uint8");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.dim() == 2 && scale.size(0) == weight.size(0),
              "scale must be float32 [N, groups]");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0), groups = scale.size(1);
  TORCH_CHECK(group > 0 && (groups - 1) * group < K && groups * group >= K, "groups do not cover K");
  const auto xf = x.to(at::kFloat).contiguous();
  const auto sc = scale.contiguous();
  auto y = at::empty({M, N}, xf.options());
  using RowFn = void (*)(const float*, const uint8_t*, const float*, float*, int64_t, int64_t, int64_t, int64_t);
  static constexpr RowFn kRows[kMaxRows] = {dot_row<E, 1>, dot_row<E, 2>, dot_row<E, 3>, dot_row<E, 4>,
                                            dot_row<E, 5>, dot_row<E, 6>, dot_row<E, 7>, dot_row<E, 8>};
  const float* xp = xf.data_ptr<float>();
  const uint8_t* wp = weight.data_ptr<uint8_t>();
  const float* sp = sc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  for (int64_t m = 0; m < M; m += kMaxRows) {  // rows in groups that fit the register accumulators
    const RowFn fn = kRows[std::min(kMaxRows, M - m) - 1];
    at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
      for (int64_t n = begin; n < end; ++n)
        fn(xp + m * K, wp + n * K, sp + n * groups, yp + m * N + n, N, K, group, groups);
    });
  }
  return y;
}

}  // namespace

TORCH_LIBRARY(fw_quant_fp8, m) {
  m.def("fp8_gemv(Tensor x, Tensor weight, Tensor scale, int group) -> Tensor");
  m.impl("fp8_gemv", c10::DispatchKey::CPU, TORCH_FN(gemv<Fp8>));
  m.def("int8_gemv(Tensor x, Tensor weight, Tensor scale, int group) -> Tensor");
  m.impl("int8_gemv", c10::DispatchKey::CPU, TORCH_FN(gemv<Int8>));
}

// W8A8 products: each activation row is rounded to int8 with its own scale, exactly as compressed-tensors'
// reference does in the activation's dtype (scale = absmax / 127.5, q = round(clamp(x / scale, -128, 127))), and
// multiplied with the int8 weight rows in integers. The int32 dot product is exact, so only the final
// `dot * x_scale * w_scale` rounds; the weights stream by once at one byte each.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <vector>

#include "fw_cpu.h"

namespace {

constexpr int64_t kMaxRows = 4;
constexpr int64_t kLanes = 16;  // int16 products per step

// A value of the activation dtype after an operation computed in float32 (bf16: rounded to nearest even).
inline float as_dtype(float v, bool bf16) { return bf16 ? fw::f32(fw::round_bf16(v)) : v; }

// One activation row as int16 (zero-padded to `padded`), and its scale.
float quantize_row(const float* x, int64_t K, bool bf16, const float* static_scale, int16_t* q) {
  float scale;
  if (static_scale) {
    scale = as_dtype(*static_scale, bf16);
  } else {
    float amax = 0.f;
    for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(x[k]));
    scale = as_dtype(amax / 127.5f, bf16);
    if (scale == 0.f) scale = bf16 ? 0.0078125f : FLT_EPSILON;  // the dtype's eps, as the reference
  }
  for (int64_t k = 0; k < K; ++k) {
    const float v = std::min(std::max(as_dtype(x[k] / scale, bf16), -128.f), 127.f);
    q[k] = static_cast<int16_t>(std::nearbyint(v));  // the default rounding mode: half to even, as torch.round
  }
  return scale;
}

// Dot products of M activation rows (int16, padded with zeros to a multiple of kLanes) with one int8 weight row.
template <int M>
void dot_row(const int16_t* q, int64_t ldq, const int8_t* w, int64_t K, int32_t* out) {
  int64_t k = 0;
#if defined(__AVX2__)
  __m256i acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_si256();
  for (; k + kLanes <= K; k += kLanes) {
    const __m256i wv = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k)));
    for (int m = 0; m < M; ++m) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + m * ldq + k));
      acc[m] = _mm256_add_epi32(acc[m], _mm256_madd_epi16(wv, xv));  // pairs of |products| <= 2^15: no overflow
    }
  }
  for (int m = 0; m < M; ++m) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(acc[m]), _mm256_extracti128_si256(acc[m], 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    out[m] = _mm_cvtsi128_si32(s);
  }
#else
  for (int m = 0; m < M; ++m) out[m] = 0;
#endif
  for (; k < K; ++k)
    for (int m = 0; m < M; ++m) out[m] += int32_t(w[k]) * q[m * ldq + k];
}

// x [M, K] float32 or bfloat16; weight int8 [N, K]; scale float32 [N, 1]; input_scale: a static activation scale
// (float32, one element), else per-row dynamic scales. Returns float32 [M, N].
at::Tensor w8a8_gemv(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale,
                     const c10::optional<at::Tensor>& input_scale) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && weight.size(1) == x.size(1), "x [M, K] and weight [N, K]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "x must be float32 or bfloat16");
  TORCH_CHECK(weight.scalar_type() == at::kChar && weight.is_contiguous(), "weight must be contiguous int8");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == weight.size(0), "scale must be float32 [N, 1]");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const auto xf = x.to(at::kFloat).contiguous();
  const auto sc = scale.contiguous();
  float static_scale = 0.f;
  if (input_scale.has_value()) static_scale = input_scale->to(at::kFloat).item<float>();
  const int64_t ldq = (K + kLanes - 1) / kLanes * kLanes;
  std::vector<int16_t> q(M * ldq, 0);
  std::vector<float> row_scale(M);
  for (int64_t m = 0; m < M; ++m)
    row_scale[m] = quantize_row(xf.data_ptr<float>() + m * K, K, bf16,
                                input_scale.has_value() ? &static_scale : nullptr, q.data() + m * ldq);
  auto y = at::empty({M, N}, xf.options());
  using RowFn = void (*)(const int16_t*, int64_t, const int8_t*, int64_t, int32_t*);
  static constexpr RowFn kRows[kMaxRows] = {dot_row<1>, dot_row<2>, dot_row<3>, dot_row<4>};
  const int8_t* wp = weight.data_ptr<int8_t>();
  const float* sp = sc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  for (int64_t m = 0; m < M; m += kMaxRows) {  // rows in groups that fit the register accumulators
    const int64_t rows = std::min(kMaxRows, M - m);
    at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
      int32_t dot[kMaxRows];
      for (int64_t n = begin; n < end; ++n) {
        kRows[rows - 1](q.data() + m * ldq, ldq, wp + n * K, K, dot);
        for (int64_t r = 0; r < rows; ++r) yp[(m + r) * N + n] = float(dot[r]) * row_scale[m + r] * sp[n];
      }
    });
  }
  return y;
}

}  // namespace

TORCH_LIBRARY(fw_quant_int8, m) {
  m.def("w8a8_gemv(Tensor x, Tensor weight, Tensor scale, Tensor? input_scale) -> Tensor");
  m.impl("w8a8_gemv", c10::DispatchKey::CPU, TORCH_FN(w8a8_gemv));
}

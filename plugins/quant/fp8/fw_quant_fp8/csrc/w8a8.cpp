// W8A8 products: each activation row is rounded to int8 with its own scale, exactly as compressed-tensors'
// reference does in the activation's dtype (scale = absmax / 127.5, q = round(clamp(x / scale, -128, 127))), and
// multiplied with the int8 weight rows in integers. The int32 dot product is exact, so only the final
// `dot * x_scale * w_scale` rounds; the weights stream by once at one byte each.
// Two products: w8a8_gemv widens the bytes to int16 pairs (AVX2's vpmaddwd, 16 products an instruction), and
// w8a8_gemv_vnni, built where the CPU has AVX-512 VNNI, multiplies bytes (vpdpbusd, 64 an instruction). The same
// integer dots and the same final rounding: their outputs are equal bit for bit. Kernel choice times both.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cfloat>
#include <cmath>
#include <vector>

#include "fw_cpu.h"

namespace {

constexpr int64_t kMaxRows = 4;
constexpr int64_t kLanes = 16;  // int16 products per step

// A value of the activation dtype after an operation computed in float32 (bf16: rounded to nearest even).
inline float as_dtype(float v, bool bf16) { return bf16 ? fw::f32(fw::round_bf16(v)) : v; }

// One activation row as integers q + kBias (int16 q for the widening product, unsigned bytes q + 128 for VNNI's
// unsigned-times-signed products), and its scale.
template <typename Q, int kBias>
float quantize_row(const float* x, int64_t K, bool bf16, const float* static_scale, Q* q) {
  float scale;
  if (static_scale) {
    scale = as_dtype(*static_scale, bf16);
  } else {
    float amax = 0.f;
    int64_t k = 0;
#if defined(__AVX512F__)
    __m512 vmax = _mm512_setzero_ps();
    for (; k + 16 <= K; k += 16) vmax = _mm512_max_ps(vmax, _mm512_abs_ps(_mm512_loadu_ps(x + k)));
    amax = _mm512_reduce_max_ps(vmax);
#endif
    for (; k < K; ++k) amax = std::max(amax, std::fabs(x[k]));
    scale = as_dtype(amax / 127.5f, bf16);
    if (scale == 0.f) scale = bf16 ? 0.0078125f : FLT_EPSILON;  // the dtype's eps, as the reference
  }
  int64_t k = 0;
#if defined(__AVX512F__)
  // The same operations 16 at a time (a division, the bf16 rounding, the clamp, rounding half to even): a 1-row
  // product of a small layer otherwise spends a third of its time here.
  const __m512 div = _mm512_set1_ps(scale), lo = _mm512_set1_ps(-128.f), hi = _mm512_set1_ps(127.f);
  for (; k + 16 <= K; k += 16) {
    __m512 v = _mm512_div_ps(_mm512_loadu_ps(x + k), div);
    if (bf16) v = fw::round_bf16x16(v);
    const __m512i i = _mm512_add_epi32(_mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(v, lo), hi)),
                                       _mm512_set1_epi32(kBias));
    if constexpr (sizeof(Q) == 1)
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + k), _mm512_cvtepi32_epi8(i));
    else
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + k), _mm512_cvtepi32_epi16(i));
  }
#endif
  for (; k < K; ++k) {
    const float v = std::min(std::max(as_dtype(x[k] / scale, bf16), -128.f), 127.f);
    q[k] = static_cast<Q>(std::nearbyint(v) + kBias);  // the default rounding mode: half to even, as torch.round
  }
  return scale;
}

// Dot products of M activation rows (int16, padded with zeros to a multiple of kLanes) with one int8 weight row.
template <int M>
void dot_row(const int16_t* q, int64_t ldq, const int8_t* w, int64_t K, int32_t /*row_sum*/, int32_t* out) {
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

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// As dot_row with VNNI: M rows of unsigned bytes q + 128 (ldq apart) times one int8 weight row, 64 products a
// step; row_sum (the weight row's sum) times 128 comes off at the end: sum (q + 128) w - 128 sum w = sum q w.
// A row's tail is a masked load (zeros).
template <int M>
void dot_row_vnni(const uint8_t* q, int64_t ldq, const int8_t* w, int64_t K, int32_t row_sum, int32_t* out) {
  __m512i acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_si512();
  int64_t k = 0;
  for (; k + 64 <= K; k += 64) {
    fw::prefetch_far_and_near(w + k);
    const __m512i wv = _mm512_loadu_si512(w + k);
    for (int m = 0; m < M; ++m) acc[m] = _mm512_dpbusd_epi32(acc[m], _mm512_loadu_si512(q + m * ldq + k), wv);
  }
  if (k < K) {
    const __mmask64 live = (__mmask64(1) << (K - k)) - 1;
    const __m512i wv = _mm512_maskz_loadu_epi8(live, w + k);
    for (int m = 0; m < M; ++m)
      acc[m] = _mm512_dpbusd_epi32(acc[m], _mm512_maskz_loadu_epi8(live, q + m * ldq + k), wv);
  }
  for (int m = 0; m < M; ++m) out[m] = _mm512_reduce_add_epi32(acc[m]) - 128 * row_sum;
}

// One row of x (q + 128) against R weight rows at once (w[r], the strands of fw::strands), each row's sum in
// row_sums[r]: R runs of weight streamed side by side (see fw::strands), the same integers as dot_row_vnni<1>.
struct VnniStrands {
  template <int R>
  void dot(const uint8_t* q, const int8_t* const* w, int64_t K, const int32_t* row_sums, int32_t* out) const {
    __m512i acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_si512();
    for (int64_t k = 0; k < K; k += 64) {
      const __mmask64 live = K - k >= 64 ? ~__mmask64(0) : (__mmask64(1) << (K - k)) - 1;
      const __m512i qv = _mm512_maskz_loadu_epi8(live, q + k);
      for (int r = 0; r < R; ++r) {
        fw::prefetch_far_and_near(w[r] + k);
        acc[r] = _mm512_dpbusd_epi32(acc[r], qv, _mm512_maskz_loadu_epi8(live, w[r] + k));
      }
    }
    for (int r = 0; r < R; ++r) out[r] = _mm512_reduce_add_epi32(acc[r]) - 128 * row_sums[r];
  }
};
#endif

// For product: no strands kernel, every weight row through the Dot of one row.
struct NoStrands {};

// x [M, K] float32 or bfloat16; weight int8 [N, K]; scale float32 [N, 1]; input_scale: a static activation scale
// (float32, one element), else per-row dynamic scales; row_sums (VNNI): int32 [N], each weight row's sum. Each
// group of up to kRows activation rows runs Dot on every weight row. Returns x.dtype [M, N] with the bias
// (fw::Outputs).
template <typename Q, int kBias, int64_t kRows, typename Dot, typename Strands = NoStrands>
at::Tensor product(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale,
                   const c10::optional<at::Tensor>& input_scale, const c10::optional<at::Tensor>& bias,
                   const int32_t* row_sums, int64_t ldq, const std::array<Dot, kRows>& dots,
                   const Strands& strands = {}) {
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
  std::vector<Q> q(M * ldq, Q(kBias));
  std::vector<float> row_scale(M);
  for (int64_t m = 0; m < M; ++m)
    row_scale[m] = quantize_row<Q, kBias>(xf.data_ptr<float>() + m * K, K, bf16,
                                          input_scale.has_value() ? &static_scale : nullptr, q.data() + m * ldq);
  const fw::Outputs out(x, M, N, x.scalar_type(), bias);
  const int8_t* wp = weight.data_ptr<int8_t>();
  const float* sp = sc.data_ptr<float>();
  if constexpr (!std::is_same_v<Strands, NoStrands>) {
    if (M == 1) {  // decode: weight rows in strands
      at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
        fw::strands<fw::kStrands>(begin, end, [&](const int64_t* n, auto count) {
          constexpr int R = decltype(count)::value;
          const int8_t* w[R];
          int32_t sums[R], dot[R];
          for (int r = 0; r < R; ++r) w[r] = wp + n[r] * K, sums[r] = row_sums[n[r]];
          strands.template dot<R>(q.data(), w, K, sums, dot);
          for (int r = 0; r < R; ++r) out.put(0, n[r], float(dot[r]) * row_scale[0] * sp[n[r]]);
        });
      });
      return out.y;
    }
  }
  for (int64_t m = 0; m < M; m += kRows) {  // rows in groups that fit the register accumulators
    const int64_t rows = std::min(kRows, M - m);
    at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
      int32_t dot[kRows];
      for (int64_t n = begin; n < end; ++n) {
        dots[rows - 1](q.data() + m * ldq, ldq, wp + n * K, K, row_sums ? row_sums[n] : 0, dot);
        for (int64_t r = 0; r < rows; ++r) out.put(m + r, n, float(dot[r]) * row_scale[m + r] * sp[n]);
      }
    });
  }
  return out.y;
}

using RowFn = void (*)(const int16_t*, int64_t, const int8_t*, int64_t, int32_t, int32_t*);

at::Tensor w8a8_gemv(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale,
                     const c10::optional<at::Tensor>& input_scale, const c10::optional<at::Tensor>& bias) {
  static constexpr std::array<RowFn, kMaxRows> kDots = {dot_row<1>, dot_row<2>, dot_row<3>, dot_row<4>};
  const int64_t K = x.size(-1);
  return product<int16_t, 0, kMaxRows>(x, weight, scale, input_scale, bias, nullptr,
                                       (K + kLanes - 1) / kLanes * kLanes, kDots);
}

bool has_vnni() {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  return true;
#else
  return false;
#endif
}

at::Tensor w8a8_gemv_vnni(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale,
                          const c10::optional<at::Tensor>& input_scale, const c10::optional<at::Tensor>& bias,
                          const at::Tensor& row_sums) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  TORCH_CHECK(row_sums.scalar_type() == at::kInt && row_sums.is_contiguous() && row_sums.numel() == weight.size(0),
              "row_sums must be contiguous int32 [N]");
  // 255 * 128 * K bounds the int32 sums
  TORCH_CHECK(x.dim() == 2 && x.size(1) < 65536, "VNNI products take rows of under 65536 features");
  using VnniFn = void (*)(const uint8_t*, int64_t, const int8_t*, int64_t, int32_t, int32_t*);
  static constexpr std::array<VnniFn, 8> kDots = {dot_row_vnni<1>, dot_row_vnni<2>, dot_row_vnni<3>, dot_row_vnni<4>,
                                                  dot_row_vnni<5>, dot_row_vnni<6>, dot_row_vnni<7>, dot_row_vnni<8>};
  return product<uint8_t, 128, 8>(x, weight, scale, input_scale, bias, row_sums.data_ptr<int32_t>(), x.size(1),
                                  kDots, VnniStrands{});
#else
  TORCH_CHECK(false, "w8a8_gemv_vnni: built without AVX-512 VNNI (has_vnni() is false)");
#endif
}

#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
// W8A8 through AMX-INT8 tiles with the weight as it is: 16 weight rows x 64 input features, row-major K bytes
// apart, are a left-hand tile, and the activations, rounded to int8, are laid out once per call as right-hand tiles
// (16 rows of 4 input features x 16 activation rows: xt [groups][K / 4][16][4]). A tile multiply (tdpbssd, signed
// bytes, no bias) then gives a 16 x 16 block of y transposed, [weight row][activation row]. So no copy of the
// weight is kept for it, and several activation rows (batched decode, prefill) cost about what one does.
constexpr int64_t kAmxDepth = 64, kAmxRows = 16;  // input features per tile multiply; activation rows per group

// y [M, N] = (x . W^T) * row_scale[m] * scale[n] (fw::Outputs: the dtype and bias), from xt (ceil(M / 16) groups)
// and w int8 [N, K]; N a multiple of 16, K of 64.
void amx_w8a8(const int8_t* w, int64_t N, int64_t K, const int8_t* xt, int64_t M, const float* row_scale,
              const float* scale, const fw::Outputs& y) {
  const int64_t blocks = N / 16, groups = (M + kAmxRows - 1) / kAmxRows, group_bytes = K * kAmxRows;
  at::parallel_for(0, (blocks + 1) / 2, 1, [&](int64_t begin, int64_t end) {
    fw::configure_tiles();  // C 0-3, A 4-5 (weight rows), B 6-7 (activations)
    alignas(64) int32_t c[16][16];
    // One C tile's [n][m] into y's rows m0.. and columns n0..: the same final rounding as the other kernels
    auto put = [&](int tile, int64_t n0, int64_t m0) {
      fw::store_c_tile(tile, c);
      for (int64_t m = m0; m < std::min(M, m0 + kAmxRows); ++m)
        for (int n = 0; n < 16; ++n) y.put(m, n0 + n, float(c[n][m - m0]) * row_scale[m] * scale[n0 + n]);
    };
    for (int64_t b = begin; b < end; ++b) {
      const int64_t j = 2 * b;
      const bool two = j + 1 < blocks;
      const int8_t* w0 = w + j * 16 * K;
      for (int64_t g = 0; g < groups; g += 2) {
        const bool pair = g + 1 < groups;
        const int8_t* x0 = xt + g * group_bytes;
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        fw::amx_int8_steps<false>(w0, K, x0, pair ? x0 + group_bytes : nullptr, K, two);
        put(0, j * 16, g * kAmxRows);
        if (pair) put(1, j * 16, (g + 1) * kAmxRows);
        if (two) {
          put(2, (j + 1) * 16, g * kAmxRows);
          if (pair) put(3, (j + 1) * 16, (g + 1) * kAmxRows);
        }
      }
    }
    _tile_release();
  });
}
#endif

bool amx_supported() {
#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
  return fw::amx_permitted();
#else
  return false;
#endif
}

// w8a8_gemv's product through AMX-INT8 tiles (amx_w8a8): the same rounding of x and the same integer dots, so the
// same output bit for bit. N a multiple of 16, K of 64.
at::Tensor w8a8_gemm_amx(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale,
                         const c10::optional<at::Tensor>& input_scale,
                         const c10::optional<at::Tensor>& bias) {
#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
  TORCH_CHECK(fw::amx_permitted(), "w8a8_gemm_amx: the kernel did not grant AMX tiles to this process");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && weight.size(1) == x.size(1), "x [M, K] and weight [N, K]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "x must be float32 or bfloat16");
  TORCH_CHECK(weight.scalar_type() == at::kChar && weight.is_contiguous(), "weight must be contiguous int8");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == weight.size(0), "scale must be float32 [N, 1]");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(N % 16 == 0 && K % kAmxDepth == 0 && K < 65536, "AMX tiles take N a multiple of 16, K of 64");
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const auto xf = x.to(at::kFloat).contiguous();
  float static_scale = 0.f;
  if (input_scale.has_value()) static_scale = input_scale->to(at::kFloat).item<float>();
  const int64_t groups = (M + kAmxRows - 1) / kAmxRows;
  std::vector<int8_t> q(K), xt(groups * K * kAmxRows, 0);
  std::vector<float> row_scale(M);
  for (int64_t m = 0; m < M; ++m) {
    row_scale[m] = quantize_row<int8_t, 0>(xf.data_ptr<float>() + m * K, K, bf16,
                                           input_scale.has_value() ? &static_scale : nullptr, q.data());
    int8_t* dst = xt.data() + (m / kAmxRows) * K * kAmxRows + (m % kAmxRows) * 4;
    for (int64_t k = 0; k < K; k += 4) std::memcpy(dst + k * kAmxRows, q.data() + k, 4);
  }
  const fw::Outputs out(x, M, N, x.scalar_type(), bias);
  amx_w8a8(weight.data_ptr<int8_t>(), N, K, xt.data(), M, row_scale.data(), scale.contiguous().data_ptr<float>(),
           out);
  return out.y;
#else
  TORCH_CHECK(false, "w8a8_gemm_amx: built without AMX-INT8 (amx_supported() is false)");
#endif
}

}  // namespace

TORCH_LIBRARY(fw_quant_int8, m) {
  m.def("w8a8_gemv(Tensor x, Tensor weight, Tensor scale, Tensor? input_scale, Tensor? bias) -> Tensor");
  m.impl("w8a8_gemv", c10::DispatchKey::CPU, TORCH_FN(w8a8_gemv));
  m.def("w8a8_gemv_vnni(Tensor x, Tensor weight, Tensor scale, Tensor? input_scale, Tensor? bias, "
        "Tensor row_sums) -> Tensor");
  m.impl("w8a8_gemv_vnni", c10::DispatchKey::CPU, TORCH_FN(w8a8_gemv_vnni));
  m.def("has_vnni() -> bool", TORCH_FN(has_vnni));
  m.def("w8a8_gemm_amx(Tensor x, Tensor weight, Tensor scale, Tensor? input_scale, Tensor? bias) -> Tensor");
  m.impl("w8a8_gemm_amx", c10::DispatchKey::CPU, TORCH_FN(w8a8_gemm_amx));
  m.def("amx_supported() -> bool", TORCH_FN(amx_supported));
}

// bf16 matrix products against a weight stored in "pair-interleaved" blocks: for every 16 output
// columns and every pair of input features, the 16 x 2 weights form one 64-byte vector, which the
// AVX-512 bf16 dot-product instruction multiplies by one broadcast pair of activations. No
// horizontal sums, so one kernel serves single-row decode (streaming the weights once, at memory
// bandwidth) and many-row prefill (a register tile of rows x columns, the weight panel kept in L2).
// The output is bf16, or float32 for the LM head: logits rounded to bf16 (an ulp of 0.125 at 20)
// turn near-ties into exact ties that greedy decoding then breaks by token id.
//
// `logits` serves CPUs without AVX512-BF16: a plain [N, K] bf16 weight, float32 out, in portable
// code the compiler vectorizes for the machine (-march=native).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "fw_cpu.h"

namespace {

using fw::bf16;

#if defined(__AVX512BF16__)
constexpr int64_t kCols = 16, kTileCols = 3, kTileRows = 8;

inline void store16(bf16* y, __m512 v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(y), (__m256i)_mm512_cvtneps_pbh(v)); }
inline void store16(float* y, __m512 v) { _mm512_storeu_ps(y, v); }

// y[rows, cols] (+)= x[rows, K] . W^T for `rows` <= kTileRows and `nb` <= kTileCols column blocks.
template <int MR, int NB, typename Out>
inline void tile(const bf16* x, int64_t ldx, const bf16* w, int64_t K, const float* bias, Out* y, int64_t ldy) {
  __m512 acc[MR][NB];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NB; ++j) acc[m][j] = bias ? _mm512_loadu_ps(bias + j * kCols) : _mm512_setzero_ps();
  const int64_t pairs = K / 2, block = pairs * 2 * kCols;  // elements per column block
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh b[NB];
    for (int j = 0; j < NB; ++j) b[j] = (__m512bh)_mm512_loadu_si512(w + j * block + p * 2 * kCols);
    for (int m = 0; m < MR; ++m) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(*reinterpret_cast<const int32_t*>(x + m * ldx + 2 * p));
      for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], b[j], a);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NB; ++j) store16(y + m * ldy + j * kCols, acc[m][j]);
}

template <int NB, typename Out>
void row_tiles(const bf16* x, int64_t M, int64_t K, const bf16* w, const float* bias, Out* y, int64_t N) {
  int64_t m = 0;
  for (; m + kTileRows <= M; m += kTileRows) tile<kTileRows, NB>(x + m * K, K, w, K, bias, y + m * N, N);
  const bf16* xr = x + m * K;
  Out* yr = y + m * N;
  switch (M - m) {  // the last rows
    case 7: tile<7, NB>(xr, K, w, K, bias, yr, N); break;
    case 6: tile<6, NB>(xr, K, w, K, bias, yr, N); break;
    case 5: tile<5, NB>(xr, K, w, K, bias, yr, N); break;
    case 4: tile<4, NB>(xr, K, w, K, bias, yr, N); break;
    case 3: tile<3, NB>(xr, K, w, K, bias, yr, N); break;
    case 2: tile<2, NB>(xr, K, w, K, bias, yr, N); break;
    case 1: tile<1, NB>(xr, K, w, K, bias, yr, N); break;
    default: break;
  }
}

template <typename Out>
void packed_product(const bf16* xp, int64_t M, int64_t K, const bf16* wp, const float* bp, Out* yp, int64_t N) {
  const int64_t blocks = N / kCols, groups = (blocks + kTileCols - 1) / kTileCols;
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const int64_t first = g * kTileCols, nb = std::min(kTileCols, blocks - first);
      const bf16* w = wp + first * K * kCols;
      const float* b = bp ? bp + first * kCols : nullptr;
      Out* out = yp + first * kCols;
      if (nb == 3) row_tiles<3>(xp, M, K, w, b, out, N);
      else if (nb == 2) row_tiles<2>(xp, M, K, w, b, out, N);
      else row_tiles<1>(xp, M, K, w, b, out, N);
    }
  });
}
#endif

// x [M, K] bf16; weight [N / 16, K / 2, 16, 2] bf16 (see pack in fw/layers/dense.py); bias [N] or None.
// Returns [M, N] in x's dtype, or float32 when `float_out`.
at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias, bool float_out) {
#if defined(__AVX512BF16__)
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16, "bad x");
  TORCH_CHECK(weight.dim() == 4 && weight.size(2) == kCols && weight.size(3) == 2 && weight.is_contiguous(), "bad w");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0) * kCols;
  TORCH_CHECK(weight.size(1) * 2 == K, "weight and x disagree on the input size");
  auto xc = x.contiguous();
  auto y = at::empty({M, N}, x.options().dtype(float_out ? at::kFloat : at::kBFloat16));
  at::Tensor bias_f;
  if (bias.has_value()) bias_f = bias->to(at::kFloat).contiguous();
  const bf16* xp = reinterpret_cast<const bf16*>(xc.data_ptr());
  const bf16* wp = reinterpret_cast<const bf16*>(weight.data_ptr());
  const float* bp = bias.has_value() ? bias_f.data_ptr<float>() : nullptr;
  if (float_out) packed_product(xp, M, K, wp, bp, y.data_ptr<float>(), N);
  else packed_product(xp, M, K, wp, bp, reinterpret_cast<bf16*>(y.data_ptr()), N);
  return y;
#else
  TORCH_CHECK(false, "fw_dense.linear needs AVX512-BF16");
#endif
}

// Float32 logits x [M, K] . weight [N, K]^T for a plain bf16 weight (any CPU): each weight row is read
// from memory once and reused from L1 for every activation row, four rows of dot products at a time.
at::Tensor logits(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && weight.scalar_type() == at::kBFloat16, "bad arguments");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(weight.size(1) == K, "weight and x disagree on the input size");
  const auto xf = x.to(at::kFloat).contiguous();
  const auto wc = weight.contiguous();
  auto y = at::empty({M, N}, x.options().dtype(at::kFloat));
  const float* xp = xf.data_ptr<float>();
  const bf16* wp = reinterpret_cast<const bf16*>(wc.data_ptr());
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> row(K);
    for (int64_t n = begin; n < end; ++n) {
      const bf16* w = wp + n * K;
      for (int64_t k = 0; k < K; ++k) row[k] = fw::f32(w[k]);
      int64_t m = 0;
      for (; m + 4 <= M; m += 4) {
        const float *x0 = xp + m * K, *x1 = x0 + K, *x2 = x1 + K, *x3 = x2 + K;
        float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
#pragma omp simd reduction(+ : a0, a1, a2, a3)
        for (int64_t k = 0; k < K; ++k) {
          a0 += x0[k] * row[k];
          a1 += x1[k] * row[k];
          a2 += x2[k] * row[k];
          a3 += x3[k] * row[k];
        }
        yp[m * N + n] = a0, yp[(m + 1) * N + n] = a1, yp[(m + 2) * N + n] = a2, yp[(m + 3) * N + n] = a3;
      }
      for (; m < M; ++m) {
        const float* xr = xp + m * K;
        float a = 0.f;
#pragma omp simd reduction(+ : a)
        for (int64_t k = 0; k < K; ++k) a += xr[k] * row[k];
        yp[m * N + n] = a;
      }
    }
  });
  return y;
}

// Whether this build (for this machine's CPU) has the kernel.
bool supported() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY(fw_dense, m) {
  m.def("linear(Tensor x, Tensor weight, Tensor? bias, bool float_out=False) -> Tensor");
  m.impl("linear", c10::DispatchKey::CPU, TORCH_FN(linear));
  m.def("logits(Tensor x, Tensor weight) -> Tensor");
  m.impl("logits", c10::DispatchKey::CPU, TORCH_FN(logits));
  m.def("supported() -> bool", TORCH_FN(supported));
}

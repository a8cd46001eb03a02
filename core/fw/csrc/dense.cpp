// bf16 matrix products against a weight stored in "pair-interleaved" blocks: for every 16 output
// columns and every pair of input features, the 16 x 2 weights form one 64-byte vector, which the
// AVX-512 bf16 dot-product instruction multiplies by one broadcast pair of activations. No
// horizontal sums, so one kernel serves single-row decode (streaming the weights once, at memory
// bandwidth) and many-row prefill (a register tile of rows x columns, the weight panel kept in L2).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "fw_cpu.h"

namespace {

using fw::bf16;

#if defined(__AVX512BF16__)
constexpr int64_t kCols = 16, kTileCols = 3, kTileRows = 8;

// y[rows, cols] (+)= x[rows, K] . W^T for `rows` <= kTileRows and `nb` <= kTileCols column blocks.
template <int MR, int NB>
inline void tile(const bf16* x, int64_t ldx, const bf16* w, int64_t K, const float* bias, bf16* y, int64_t ldy) {
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
    for (int j = 0; j < NB; ++j)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + m * ldy + j * kCols), (__m256i)_mm512_cvtneps_pbh(acc[m][j]));
}

template <int NB>
void row_tiles(const bf16* x, int64_t M, int64_t K, const bf16* w, const float* bias, bf16* y, int64_t N) {
  int64_t m = 0;
  for (; m + kTileRows <= M; m += kTileRows) tile<kTileRows, NB>(x + m * K, K, w, K, bias, y + m * N, N);
  const bf16* xr = x + m * K;
  bf16* yr = y + m * N;
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
#endif

// x [M, K] bf16; weight [N / 16, K / 2, 16, 2] bf16 (see pack in fw/layers/dense.py); bias [N] or None.
at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
#if defined(__AVX512BF16__)
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16, "bad x");
  TORCH_CHECK(weight.dim() == 4 && weight.size(2) == kCols && weight.size(3) == 2 && weight.is_contiguous(), "bad w");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0) * kCols;
  TORCH_CHECK(weight.size(1) * 2 == K, "weight and x disagree on the input size");
  auto xc = x.contiguous();
  auto y = at::empty({M, N}, x.options());
  at::Tensor bias_f;
  if (bias.has_value()) bias_f = bias->to(at::kFloat).contiguous();
  const bf16* xp = reinterpret_cast<const bf16*>(xc.data_ptr());
  const bf16* wp = reinterpret_cast<const bf16*>(weight.data_ptr());
  bf16* yp = reinterpret_cast<bf16*>(y.data_ptr());
  const float* bp = bias.has_value() ? bias_f.data_ptr<float>() : nullptr;
  const int64_t blocks = N / kCols, groups = (blocks + kTileCols - 1) / kTileCols;
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const int64_t first = g * kTileCols, nb = std::min(kTileCols, blocks - first);
      const bf16* w = wp + first * K * kCols;
      const float* b = bp ? bp + first * kCols : nullptr;
      bf16* out = yp + first * kCols;
      if (nb == 3) row_tiles<3>(xp, M, K, w, b, out, N);
      else if (nb == 2) row_tiles<2>(xp, M, K, w, b, out, N);
      else row_tiles<1>(xp, M, K, w, b, out, N);
    }
  });
  return y;
#else
  TORCH_CHECK(false, "fw_dense.linear needs AVX512-BF16");
#endif
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
  m.def("linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.impl("linear", c10::DispatchKey::CPU, TORCH_FN(linear));
  m.def("supported() -> bool", TORCH_FN(supported));
}

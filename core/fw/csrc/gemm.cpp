// x [M, K] . W^T for a plain bf16 weight W [N, K], at float32 GEMM speed on CPUs without bf16 arithmetic,
// with no widened copy of the weight kept: a blocked GEMM whose packing step widens the weight.
//
// The output columns go in chunks of four 16-column panels, which threads claim one at a time. For every
// Kc-deep slice of K a thread packs its chunk's W[n : n + 64, k : k + Kc] into a thread-local float32
// buffer, transposed so that each k holds 16 consecutive columns (Kc x 16 floats per panel: one panel
// stays in L1, the chunk in L2), while it prefetches the weights it packs next. The micro-kernel keeps
// a 6 x 16 tile of outputs in twelve ymm accumulators and, per k, loads two vectors of the panel and
// broadcasts six activations straight from x (float32, converted once): 12 FMAs per 8 loads. Partial
// sums go to a thread-local float32 block [M, 64]; after the last slice it gets the bias and is
// written out in x's dtype.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <vector>

#include "fw_cpu.h"

namespace {

using fw::bf16;

constexpr int64_t kNR = 16;      // output columns per panel (two ymm)
constexpr int64_t kMR = 6;       // output rows per register tile
constexpr int64_t kKc = 256;     // panel depth: 256 x 16 floats = 16 KiB, beside 6 x 256 activations in L1
constexpr int64_t kPanels = 4;   // panels per packed block (64 KiB, in L2), the unit of work of a thread
constexpr int64_t kMc = 96;      // rows per sweep over the packed block: their activations stay in L2

// A float buffer per thread that only grows, aligned for full cache lines: the GEMM runs once per layer
// and token batch, and fresh large allocations would fault their pages in every time.
float* scratch(std::vector<float>& store, int64_t floats) {
  if (int64_t(store.size()) < floats + 16) store.resize(floats + 16);
  const auto address = reinterpret_cast<uintptr_t>(store.data());
  return reinterpret_cast<float*>((address + 63) & ~uintptr_t(63));
}

// Panel layout: dst[k * 16 + j] = W[n0 + j, k0 + k] widened; columns past `cols` are zero.
void pack_panel_scalar(const bf16* w, int64_t ldw, int64_t cols, int64_t kc, float* dst) {
  for (int64_t k = 0; k < kc; ++k)
    for (int64_t j = 0; j < kNR; ++j) dst[k * kNR + j] = j < cols ? fw::f32(w[j * ldw + k]) : 0.f;
}

#if defined(__AVX2__) && defined(__FMA__)
inline __m256 load_bf16x8(const bf16* p) {  // bf16 is the top half of a float32
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

// Eight weight rows x eight k, widened and transposed into eight 8-column vectors of the panel.
inline void pack_8x8(const bf16* w, int64_t ldw, float* dst) {
  __m256 r[8], t[8];
  for (int i = 0; i < 8; ++i) r[i] = load_bf16x8(w + i * ldw);
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xee);
    r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xee);
  }
  for (int i = 0; i < 4; ++i) {  // r[i] holds k = i and i + 4 of rows 0-3 (low lane) and 4-7 (high lane)
    _mm256_storeu_ps(dst + i * kNR, _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
    _mm256_storeu_ps(dst + (i + 4) * kNR, _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
  }
}

void pack_panel(const bf16* w, int64_t ldw, int64_t cols, int64_t kc, float* dst) {
  if (cols < kNR) return pack_panel_scalar(w, ldw, cols, kc, dst);
  int64_t k = 0;
  for (; k + 8 <= kc; k += 8) {
    pack_8x8(w + k, ldw, dst + k * kNR);
    pack_8x8(w + 8 * ldw + k, ldw, dst + k * kNR + 8);
  }
  if (k < kc) pack_panel_scalar(w + k, ldw, cols, kc - k, dst + k * kNR);
}

// c[MR, 16] (+)= a[MR, kc] . panel: `a` rows lda apart, `c` rows ldc apart; `first` starts from zero.
template <int MR>
void tile(const float* a, int64_t lda, const float* panel, int64_t kc, float* c, int64_t ldc, bool first) {
  __m256 acc[MR][2];
#pragma GCC unroll 6
  for (int m = 0; m < MR; ++m) {
    acc[m][0] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(c + m * ldc);
    acc[m][1] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(c + m * ldc + 8);
  }
#pragma GCC unroll 4
  for (int64_t k = 0; k < kc; ++k) {
    const __m256 b0 = _mm256_load_ps(panel + k * kNR), b1 = _mm256_load_ps(panel + k * kNR + 8);
#pragma GCC unroll 6
    for (int m = 0; m < MR; ++m) {
      const __m256 x = _mm256_broadcast_ss(a + m * lda + k);
      acc[m][0] = _mm256_fmadd_ps(x, b0, acc[m][0]);
      acc[m][1] = _mm256_fmadd_ps(x, b1, acc[m][1]);
    }
  }
#pragma GCC unroll 6
  for (int m = 0; m < MR; ++m) {
    _mm256_storeu_ps(c + m * ldc, acc[m][0]);
    _mm256_storeu_ps(c + m * ldc + 8, acc[m][1]);
  }
}
#else
void pack_panel(const bf16* w, int64_t ldw, int64_t cols, int64_t kc, float* dst) {
  pack_panel_scalar(w, ldw, cols, kc, dst);
}

template <int MR>
void tile(const float* a, int64_t lda, const float* panel, int64_t kc, float* c, int64_t ldc, bool first) {
  float acc[MR][kNR];
  for (int m = 0; m < MR; ++m)
    for (int64_t j = 0; j < kNR; ++j) acc[m][j] = first ? 0.f : c[m * ldc + j];
  for (int64_t k = 0; k < kc; ++k)
    for (int m = 0; m < MR; ++m)
      for (int64_t j = 0; j < kNR; ++j) acc[m][j] += a[m * lda + k] * panel[k * kNR + j];
  for (int m = 0; m < MR; ++m)
    for (int64_t j = 0; j < kNR; ++j) c[m * ldc + j] = acc[m][j];
}
#endif

// c[rows, 16] (+)= a[rows, kc] . panel, in register tiles of kMR rows and one of the rest.
void panel_rows(const float* a, int64_t lda, int64_t rows, const float* panel, int64_t kc, float* c, int64_t ldc,
                bool first) {
  int64_t m = 0;
  for (; m + kMR <= rows; m += kMR) tile<kMR>(a + m * lda, lda, panel, kc, c + m * ldc, ldc, first);
  a += m * lda, c += m * ldc;
  switch (rows - m) {
    case 5: tile<5>(a, lda, panel, kc, c, ldc, first); break;
    case 4: tile<4>(a, lda, panel, kc, c, ldc, first); break;
    case 3: tile<3>(a, lda, panel, kc, c, ldc, first); break;
    case 2: tile<2>(a, lda, panel, kc, c, ldc, first); break;
    case 1: tile<1>(a, lda, panel, kc, c, ldc, first); break;
    default: break;
  }
}

// Asks for rows x kc weights (rows ldw apart) ahead of packing them, so that their memory latency
// overlaps the FMAs of the block before: the packing reads only a few lines per row, too few for the
// hardware prefetchers to pick up the streams.
void prefetch_rows(const bf16* w, int64_t ldw, int64_t rows, int64_t kc) {
  if (kc <= 0) return;
  for (int64_t j = 0; j < rows; ++j) {
    const char* row = reinterpret_cast<const char*>(w + j * ldw);
    for (int64_t b = 0; b < kc * int64_t(sizeof(bf16)); b += 64) __builtin_prefetch(row + b, 0, 2);
    __builtin_prefetch(row + kc * int64_t(sizeof(bf16)) - 1, 0, 2);
  }
}

template <typename Out>
inline Out to_out(float v);
template <>
inline float to_out<float>(float v) { return v; }
template <>
inline bf16 to_out<bf16>(float v) { return fw::round_bf16(v); }

// y[M, N] = x[M, K] . w[N, K]^T (+ bias), x float32, a chunk of kPanels panels at a time.
template <typename Out>
void product(const float* x, int64_t M, int64_t K, const bf16* w, int64_t N, const float* bias, Out* y) {
  const int64_t panels = (N + kNR - 1) / kNR, chunks = (panels + kPanels - 1) / kPanels;
  const int64_t slices = std::max<int64_t>(1, (K + kKc - 1) / kKc);
  const int64_t depth = (K + slices - 1) / slices;  // equal slices: no short last one
  // Threads claim chunks one at a time rather than splitting them evenly up front: on a shared machine a
  // thread the system holds back then takes fewer, instead of keeping the others waiting for it.
  std::atomic<int64_t> claimed{0};
  at::parallel_for(0, std::min<int64_t>(chunks, at::get_num_threads()), 1, [&](int64_t, int64_t) {
    thread_local std::vector<float> packed_store, sums_store;
    const int64_t width = kPanels * kNR;
    float* packed = scratch(packed_store, kPanels * kNR * depth);
    float* sums = scratch(sums_store, M * width);
    for (int64_t chunk = claimed++, after = chunks; chunk < chunks; chunk = after) {
      const int64_t p0 = chunk * kPanels, count = std::min(kPanels, panels - p0), n0 = p0 * kNR;
      for (int64_t s = 0; s < slices; ++s) {
        const int64_t k0 = s * depth, kc = std::min(depth, K - k0);
        for (int64_t p = 0; p < count; ++p) {
          const int64_t n = n0 + p * kNR;
          pack_panel(w + n * K + k0, K, std::min(kNR, N - n), kc, packed + p * kNR * depth);
        }
        // The block packed next, this chunk's next slice or the next chunk's first, is asked for a panel at
        // a time between the micro-kernels of this one.
        const bool last = s + 1 == slices;
        if (last) after = claimed++;
        const int64_t next_p0 = last ? after * kPanels : p0, next_k0 = last ? 0 : k0 + depth;
        const int64_t next_cols = last && after >= chunks ? 0 : std::min(width, N - next_p0 * kNR);
        for (int64_t m0 = 0; m0 < M; m0 += kMc) {
          const int64_t rows = std::min(kMc, M - m0);
          for (int64_t p = 0; p < count; ++p) {
            if (m0 == 0 && p * kNR < next_cols)
              prefetch_rows(w + (next_p0 + p) * kNR * K + next_k0, K, std::min(kNR, next_cols - p * kNR),
                            std::min(depth, K - next_k0));
            panel_rows(x + m0 * K + k0, K, rows, packed + p * kNR * depth, kc, sums + m0 * width + p * kNR, width,
                       s == 0);
          }
        }
      }
      const int64_t cols = std::min(width, N - n0);
      for (int64_t m = 0; m < M; ++m)
        for (int64_t j = 0; j < cols; ++j)
          y[m * N + n0 + j] = to_out<Out>(sums[m * width + j] + (bias ? bias[n0 + j] : 0.f));
    }
  });
}

// x [M, K] bf16 or float32; weight [N, K] bf16; bias [N] of any float dtype, or None.
// Returns [M, N] in x's dtype, accumulated in float32 (bf16 rounded to nearest even).
at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "fw_gemm.linear: x must be [M, K] bf16 or float32");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16, "fw_gemm.linear: weight must be [N, K] bf16");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(weight.size(1) == K, "fw_gemm.linear: weight and x disagree on the input size");
  TORCH_CHECK(!bias.has_value() || (bias->dim() == 1 && bias->size(0) == N), "fw_gemm.linear: bias must be [N]");
  auto y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const auto xf = x.to(at::kFloat).contiguous();
  const auto wc = weight.contiguous();
  at::Tensor bias_f;
  if (bias.has_value()) bias_f = bias->to(at::kFloat).contiguous();
  const float* bp = bias.has_value() ? bias_f.data_ptr<float>() : nullptr;
  const bf16* wp = reinterpret_cast<const bf16*>(wc.data_ptr());
  if (x.scalar_type() == at::kFloat) product(xf.data_ptr<float>(), M, K, wp, N, bp, y.data_ptr<float>());
  else product(xf.data_ptr<float>(), M, K, wp, N, bp, reinterpret_cast<bf16*>(y.data_ptr()));
  return y;
}

// Whether this build (for this machine's CPU) has the AVX2 micro-kernel rather than the portable one.
bool supported() {
#if defined(__AVX2__) && defined(__FMA__)
  return true;
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY(fw_gemm, m) {
  m.def("linear(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor");
  m.impl("linear", c10::DispatchKey::CPU, TORCH_FN(linear));
  m.def("supported() -> bool", TORCH_FN(supported));
}

// bf16 matrix products against a weight stored in "pair-interleaved" blocks: for every 16 output
// columns and every pair of input features, the 16 x 2 weights form one 64-byte vector, which the
// AVX-512 bf16 dot-product instruction multiplies by one broadcast pair of activations. No
// horizontal sums, so one kernel serves single-row decode (streaming the weights once, at memory
// bandwidth) and many-row prefill (a register tile of rows x columns, the weight panel kept in L2).
// The output is bf16, or float32 for the LM head: logits rounded to bf16 (an ulp of 0.125 at 20)
// turn near-ties into exact ties that greedy decoding then breaks by token id.
//
// `plain_linear` serves CPUs without AVX512-BF16 (dense.linear and the LM head alike): the plain
// [N, K] bf16 weight torch reads, no second copy. Decode is memory-bound, so it streams each weight
// row once, widening bf16 to float32 in registers, and dots it with the few activation rows held as
// float32 (AVX2 + FMA; portable code the compiler vectorizes elsewhere), one horizontal sum per output.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <type_traits>

#include "fw_cpu.h"

namespace {

using fw::bf16;

constexpr int64_t kCols = fw::kPairCols;

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// AMX (Sapphire Rapids and later): the same pair-interleaved blocks are AMX's layout of a right-hand tile as they
// stand (16 pairs of input features x 16 columns x 2 = 1 KiB, contiguous), so a tile multiply takes 16 rows x 32
// input features of x against 16 such pairs, accumulating a 16 x 16 float32 tile. Rows go in tiles of 16, two
// at a time, so x is padded with zero rows to a multiple of 32: several rows (batched decode, prefill, the LM
// head over a batch) cost about what one does, and the float32 accumulators give the LM head its float32 logits.
constexpr int64_t kAmxRows = 32, kAmxDepth = 32;  // rows of x per pass (two tiles), input features per tile

// y [M, N] = xpad [Mp, K] . W^T (+ bias), Out float32 or bf16; Mp a multiple of kAmxRows, K of kAmxDepth. Each
// 16 x 16 float32 accumulator tile goes through a 1 KiB buffer into y, rounded there: a float32 copy of y and a
// second pass over it cost more than the tile products themselves at prefill sizes (2048 x 9728: 80 MB).
template <typename Out>
void amx_product(const bf16* x, int64_t M, int64_t Mp, int64_t K, const bf16* w, const float* bias, Out* y,
                 int64_t N) {
  const int64_t blocks = N / kCols, block = K * kCols;  // elements per column block
  // Column-block pairs whose weights (4 * block bytes a pair) fit in a share of L2 go together, so that a group of
  // x's rows is read from L2 once per group of pairs, not once per pair. The share: 1 MiB where x is long (its
  // re-reads dominate), 256 KiB up to 1023 rows, where the weight comes from memory once and smaller groups
  // measured faster (AMX Xeon, 24 layers of Qwen2-0.5B streamed at 128 rows: 80 -> 72 ms; even at 512).
  const int64_t share = Mp >= 1024 ? int64_t(1) << 20 : int64_t(1) << 18;
  const int64_t group = std::max<int64_t>(1, share / (4 * block));
  at::parallel_for(0, (blocks + 1) / 2, 1, [&](int64_t begin, int64_t end) {
    fw::configure_tiles();  // C 0-3, A 4-5, B 6-7
    alignas(64) float buf[16 * kCols];
    auto put = [&](int64_t row0, int64_t col0) {  // buf's rows into y (those below M), with the bias
      const __m512 b = bias ? _mm512_loadu_ps(bias + col0) : _mm512_setzero_ps();
      for (int64_t r = 0; r < 16 && row0 + r < M; ++r) {
        const __m512 v = _mm512_add_ps(_mm512_load_ps(buf + r * kCols), b);
        if constexpr (std::is_same_v<Out, float>) _mm512_storeu_ps(y + (row0 + r) * N + col0, v);
        else fw::store_bf16x16(y + (row0 + r) * N + col0, fw::round_bf16x16(v));
      }
    };
    for (int64_t g0 = begin; g0 < end; g0 += group) {
      const int64_t g1 = std::min(end, g0 + group);
      for (int64_t m = 0; m < Mp; m += kAmxRows) {
        const bf16* xm = x + m * K;
        for (int64_t g = g0; g < g1; ++g) {
          const int64_t j = 2 * g;
          const bool two = j + 1 < blocks;
          const bf16* w0 = w + j * block;
          _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
          fw::amx_bf16_steps(xm, K, w0, two ? w0 + block : nullptr, 0, K);
          const int64_t col = j * kCols;
          _tile_stored(0, buf, 64); put(m, col);
          _tile_stored(2, buf, 64); put(m + 16, col);
          if (two) {
            _tile_stored(1, buf, 64); put(m, col + kCols);
            _tile_stored(3, buf, 64); put(m + 16, col + kCols);
          }
        }
      }
    }
    _tile_release();
  });
}
#endif

// `linear` through AMX tiles (same weight, bias and output as `linear`); K a multiple of 32.
at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                      bool float_out) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  TORCH_CHECK(fw::amx_permitted(), "fw_dense.amx_linear: the kernel did not grant AMX tiles to this process");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16, "bad x");
  TORCH_CHECK(weight.dim() == 4 && weight.size(2) == kCols && weight.size(3) == 2 && weight.is_contiguous(), "bad w");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0) * kCols;
  TORCH_CHECK(weight.size(1) * 2 == K && K % kAmxDepth == 0, "weight and x disagree, or K is not a multiple of 32");
  const int64_t Mp = (M + kAmxRows - 1) / kAmxRows * kAmxRows;
  auto xp = Mp == M ? x.contiguous() : at::constant_pad_nd(x, {0, 0, 0, Mp - M});
  at::Tensor bias_f;
  if (bias.has_value()) bias_f = bias->to(at::kFloat).contiguous();
  const float* bp = bias.has_value() ? bias_f.data_ptr<float>() : nullptr;
  const bf16* xb = reinterpret_cast<const bf16*>(xp.data_ptr());
  const bf16* wb = reinterpret_cast<const bf16*>(weight.data_ptr());
  auto y = at::empty({M, N}, x.options().dtype(float_out ? at::kFloat : at::kBFloat16));
  if (float_out) amx_product(xb, M, Mp, K, wb, bp, y.data_ptr<float>(), N);
  else amx_product(xb, M, Mp, K, wb, bp, reinterpret_cast<bf16*>(y.data_ptr()), N);
  return y;
#else
  TORCH_CHECK(false, "fw_dense.amx_linear needs AMX-BF16");
#endif
}

// Whether this build has `amx_linear` and the kernel lets this process use AMX tiles.
bool amx_supported() {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  return fw::amx_permitted();
#else
  return false;
#endif
}

// x [M, K] bf16; weight [N / 16, K / 2, 16, 2] bf16 (see pack in fw/sdk/dense.py); bias [N] or None.
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
  auto blocks = [&](int64_t first, int64_t) { return wp + first * K * kCols; };
  if (float_out) fw::pair_product(xp, M, K, blocks, bp, y.data_ptr<float>(), N, nullptr, wp);
  else fw::pair_product(xp, M, K, blocks, bp, reinterpret_cast<bf16*>(y.data_ptr()), N, nullptr, wp);
  return y;
#else
  TORCH_CHECK(false, "fw_dense.linear needs AVX512-BF16");
#endif
}

// A 256-bit load holds kBlock bf16 weights: shifting each 32-bit lane left by 16 gives the even ones as
// float32, masking off its low half the odd ones (no shuffles). The activations are stored in the same
// order (per block: the 8 even, then the 8 odd), so a block costs one load, two integer ops and two FMAs
// per activation row.
constexpr int64_t kBlock = 16;

// Input features [0, blocked(K)) go through the vector loop; the rest (all of them without AVX2) through
// a loop the compiler vectorizes.
inline int64_t blocked(int64_t K) {
#if defined(__AVX2__) && defined(__FMA__)
  return K / kBlock * kBlock;
#else
  return 0;
#endif
}

inline void store(float* y, float v) { *y = v; }
inline void store(bf16* y, float v) { *y = fw::round_bf16(v); }

// y[m, j] = x[m] . w[j] (+ bias[j]) for MR activation rows (x: float32, in the order above, row
// stride K) and NR weight rows of K bf16 each. MR x NR independent accumulators hide the FMA latency.
template <int MR, int NR, typename Out>
inline void tile(const float* x, const bf16* w, int64_t K, const float* bias, Out* y, int64_t ldy) {
  float sum[MR][NR] = {};
  const int64_t vk = blocked(K);
#if defined(__AVX2__) && defined(__FMA__)
  __m256 acc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NR; ++j) acc[m][j] = _mm256_setzero_ps();
  const __m256i high = _mm256_set1_epi32(int(0xffff0000u));
  // The next tile's rows (the thread's rows are contiguous), fetched as these are read: at K = 896 a row is only
  // 28 cache lines, too short a stream for the hardware prefetcher. Non-temporal, so that streaming the weights
  // evicts less of what the rest of the step (Python, small kernels) keeps in cache.
  const char* ahead = reinterpret_cast<const char*>(w + NR * K);
  for (int64_t k = 0; k < vk; k += kBlock) {
    for (int b = 0; b < NR * kBlock * 2; b += 64) _mm_prefetch(ahead + k * NR * 2 + b, _MM_HINT_NTA);
    for (int j = 0; j < NR; ++j) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + j * K + k));
      const __m256 even = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
      const __m256 odd = _mm256_castsi256_ps(_mm256_and_si256(raw, high));
      for (int m = 0; m < MR; ++m) {
        acc[m][j] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * K + k), even, acc[m][j]);
        acc[m][j] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * K + k + 8), odd, acc[m][j]);
      }
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NR; ++j) sum[m][j] = fw::sum8(acc[m][j]);
#endif
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NR; ++j) {
      const float* xr = x + m * K;
      const bf16* wr = w + j * K;
      float s = sum[m][j];
#pragma omp simd reduction(+ : s)
      for (int64_t k = vk; k < K; ++k) s += xr[k] * fw::f32(wr[k]);
      store(y + m * ldy + j, bias ? s + bias[j] : s);
    }
}

constexpr int64_t kRows = 4;  // weight rows streamed together (and activation rows per tile)

// The outputs of MR activation rows for `nr` <= kRows weight rows: 4 weight rows at a time for 1-2
// activation rows, 2 for 3-4 (16 ymm registers), then one at a time.
template <int MR, typename Out>
void tiles(const float* x, const bf16* w, int64_t nr, int64_t K, const float* bias, Out* y, int64_t ldy) {
  constexpr int NR = MR <= 2 ? 4 : 2;
  int64_t j = 0;
  for (; j + NR <= nr; j += NR) tile<MR, NR>(x, w + j * K, K, bias ? bias + j : nullptr, y + j, ldy);
  for (; j < nr; ++j) tile<MR, 1>(x, w + j * K, K, bias ? bias + j : nullptr, y + j, ldy);
}

template <typename Out>
void plain_product(const float* x, int64_t M, int64_t K, const bf16* w, const float* bias, Out* y, int64_t N) {
  const int64_t groups = (N + kRows - 1) / kRows;
  // A thread's share is at least 64K weights: below that, waking the other thread costs more than it saves.
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 16) / (kRows * K));
  at::parallel_for(0, groups, grain, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const int64_t n = g * kRows, nr = std::min(kRows, N - n);
      const bf16* wg = w + n * K;
      const float* b = bias ? bias + n : nullptr;
      // Every activation row against these weight rows while they are in L1: each is read from memory once.
      for (int64_t m = 0; m < M; m += kRows) {
        const float* xm = x + m * K;
        Out* ym = y + m * N + n;
        switch (std::min(kRows, M - m)) {
          case 4: tiles<4>(xm, wg, nr, K, b, ym, N); break;
          case 3: tiles<3>(xm, wg, nr, K, b, ym, N); break;
          case 2: tiles<2>(xm, wg, nr, K, b, ym, N); break;
          default: tiles<1>(xm, wg, nr, K, b, ym, N); break;
        }
      }
    }
  });
}

// x [M, K] (any float dtype); weight [N, K] bf16, as torch stores it; bias [N] or None. Returns [M, N]
// in bf16 (rounded to nearest even), or float32 when `float_out`; float32 accumulation either way.
at::Tensor plain_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                        bool float_out) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && weight.scalar_type() == at::kBFloat16, "bad arguments");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(weight.size(1) == K, "weight and x disagree on the input size");
  const auto xf = x.to(at::kFloat).contiguous();
  const auto wc = weight.contiguous();
  at::Tensor bias_f;
  if (bias.has_value()) bias_f = bias->to(at::kFloat).contiguous();
  // The activations in the vector loop's order (see kBlock).
  auto xs = at::empty({M, K}, xf.options());
  const float* src = xf.data_ptr<float>();
  float* xp = xs.data_ptr<float>();
  const int64_t vk = blocked(K);
  for (int64_t m = 0; m < M; ++m) {
    const float* row = src + m * K;
    float* out = xp + m * K;
    for (int64_t b = 0; b < vk; b += kBlock)
      for (int64_t i = 0; i < kBlock / 2; ++i) out[b + i] = row[b + 2 * i], out[b + kBlock / 2 + i] = row[b + 2 * i + 1];
    std::copy(row + vk, row + K, out + vk);
  }
  auto y = at::empty({M, N}, x.options().dtype(float_out ? at::kFloat : at::kBFloat16));
  const bf16* wp = reinterpret_cast<const bf16*>(wc.data_ptr());
  const float* bp = bias.has_value() ? bias_f.data_ptr<float>() : nullptr;
  if (float_out) plain_product(xp, M, K, wp, bp, y.data_ptr<float>(), N);
  else plain_product(xp, M, K, wp, bp, reinterpret_cast<bf16*>(y.data_ptr()), N);
  return y;
}

// Whether this build (for this machine's CPU) has `linear` (plain_linear runs anywhere).
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
  m.def("plain_linear(Tensor x, Tensor weight, Tensor? bias, bool float_out=False) -> Tensor");
  m.impl("plain_linear", c10::DispatchKey::CPU, TORCH_FN(plain_linear));
  m.def("supported() -> bool", TORCH_FN(supported));
  m.def("amx_linear(Tensor x, Tensor weight, Tensor? bias, bool float_out=False) -> Tensor");
  m.impl("amx_linear", c10::DispatchKey::CPU, TORCH_FN(amx_linear));
  m.def("amx_supported() -> bool", TORCH_FN(amx_supported));
}

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
#include <atomic>
#include <cmath>
#include <mutex>
#include <type_traits>
#include <vector>

#include "fw_cpu.h"

namespace {

using fw::bf16;

constexpr int64_t kCols = fw::kPairCols;

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
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
    alignas(64) float buf[16 * 2 * kCols];  // two C tiles side by side: 16 rows of 32 columns
    // buf's rows (those below M) into y's columns col0 .. col0 + 31 (+ 15 without `two`), with the bias. bf16 rows
    // round in one instruction (nearest even, as round_bf16x16; float32 subnormals become zero) and go out 64 bytes
    // a row. Against rounding and storing each tile's 16 columns apart, Qwen2-0.5B's 96 products streamed (AMX Xeon,
    // medians of 6): 65.5 -> 64.0 ms at 128 rows, 202 -> 197 at 512.
    auto put = [&](int64_t row0, int64_t col0, bool two) {
      const __m512 b0 = bias ? _mm512_loadu_ps(bias + col0) : _mm512_setzero_ps();
      const __m512 b1 = bias && two ? _mm512_loadu_ps(bias + col0 + kCols) : _mm512_setzero_ps();
      for (int64_t r = 0; r < 16 && row0 + r < M; ++r) {
        const __m512 v0 = _mm512_add_ps(_mm512_load_ps(buf + r * 2 * kCols), b0);
        const __m512 v1 = _mm512_add_ps(_mm512_load_ps(buf + r * 2 * kCols + kCols), b1);
        Out* out = y + (row0 + r) * N + col0;
        if constexpr (std::is_same_v<Out, float>) {
          _mm512_storeu_ps(out, v0);
          if (two) _mm512_storeu_ps(out + kCols, v1);
        } else if (two) {
          _mm512_storeu_si512(out, (__m512i)_mm512_cvtne2ps_pbh(v1, v0));
        } else {
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), (__m256i)_mm512_cvtneps_pbh(v0));
        }
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
          _tile_stored(0, buf, 128);
          if (two) _tile_stored(1, buf + kCols, 128);
          put(m, col, two);
          _tile_stored(2, buf, 128);
          if (two) _tile_stored(3, buf + kCols, 128);
          put(m + 16, col, two);
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
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
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
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
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

#if defined(__AVX512BF16__) && defined(__AVX512VNNI__)
// Greedy decoding reads one thing of the LM head's logits: each row's largest. So it need not compute them all in
// bf16: an int8 copy of the head (a scale per column) gives every logit within a bound that holds whatever the
// values, and only the columns whose upper bound reaches the best lower bound can be the argmax. Their blocks of 16
// are computed as the logits' kernel computes them (`linear`'s tile, or `amx_linear`'s, on the same pair-interleaved
// block: every lane's sums in the same order), so the token is the argmax of those logits, bit for bit, while the
// head's bytes read are halved (decode is memory-bound) and its multiply-adds run four to an int32 lane (AVX-512
// VNNI), or on AMX-INT8 tiles.
//
// The bound of logit j, x . w_j against its int8 estimate a_j = s_x s_j (q_x . q_j): with x = h + dx (h = s_x q_x)
// and w_j = s_j q_j + dw_j, x . w_j - a_j = h . dw_j + dx . w_j, so it is at most
//   min(|h|_1 |dw_j|_max, |h|_2 |dw_j|_2) + min(|dx|_max |w_j|_1, |dx|_2 |w_j|_2)
// (|dw_j|_max <= s_j / 2, |dx|_max <= s_x / 2; the second forms are Cauchy-Schwarz: on the Qwen2-0.5B-shaped
// benchmark model's decode steps the first forms alone left 126 columns a row, both 35), plus what the bf16 kernel's
// float32 sums round: K errors of 2^-24 |x|_1 max|w_j| at most (max|w_j| = 127 s_j). The packed head holds s_j,
// |dw_j|_2, |w_j|_1 and |w_j|_2 per column (fw/sdk/dense.py, pack_greedy). Slack of 1e-4 relative, 1e-6 of |a_j|
// and 1e-20 absolute covers the float32 arithmetic of the bound itself and products the bf16 instruction flushes.
constexpr int64_t kQ8Quad = 4;  // int8 values a lane sums per instruction

struct GreedyRow {  // what the bound needs of a row of x
  float sx, h1, h2, dx2, x1;  // s_x, |h|_1, |h|_2, |dx|_2, a bound on |x|_1
};

struct Greedy {
  const uint8_t* xu;  // [M, K]: x quantized, q + 128 (the instruction multiplies unsigned by signed bytes)
  const GreedyRow* rows;
  const int8_t* q8;   // [V / 16, K / 4, 16, 4]: the head's int8 columns, 16 to a block, 4 input features a lane
  const float* s;     // [4, V]: s_j, |dw_j|_2, |w_j|_1, |w_j|_2
  const int32_t* qsum;  // [V] sum of q_j: the + 128 taken off again
  float* upper;       // [M, V / 16]: per block, the largest a_j + bound of its columns
  int64_t M, K, V, vocab;
  float rounding;     // 127 K 2^-24, with margin: the float32 sums' share, per s_j |x|_1
};

// The sums as GCC's vector of 16 int32, the type its dot-product builtin takes: through __m512i (8 int64) every
// call converts, and GCC 12 then kept a tile's 24 sums on the stack, loading and storing them around every
// instruction (the products ran at a third of the speed).
#if defined(__GNUC__) && !defined(__clang__)
typedef int Sums16 __attribute__((vector_size(64)));
inline Sums16 dpbusd(Sums16 acc, __m512i a, __m512i b) {
  return __builtin_ia32_vpdpbusd_v16si(acc, reinterpret_cast<Sums16>(a), reinterpret_cast<Sums16>(b));
}
#else
typedef __m512i Sums16;
inline Sums16 dpbusd(Sums16 acc, __m512i a, __m512i b) { return _mm512_dpbusd_epi32(acc, a, b); }
#endif

// sums[m][j] = the int32 products of row m0 + m of x (as q + 128) with block first + j, 16 columns each. `ahead`: the
// next group's blocks to request while these are read, as pair_tile does.
template <int MR, int NB>
void greedy_sums(const Greedy& g, int64_t m0, int64_t first, const int8_t* ahead, int64_t stride, int32_t* sums) {
  Sums16 acc[MR][NB];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NB; ++j) acc[m][j] = Sums16{};
  const int64_t quads = g.K / kQ8Quad, block = g.K * kCols;  // bytes per column block
  const int8_t* w = g.q8 + first * block;
  const uint8_t* x = g.xu + m0 * g.K;
  const int64_t K = g.K;
  for (int64_t q = 0; q < quads; ++q) {
    if (ahead)
      for (int j = 0; j < fw::kPairBlocks; ++j) _mm_prefetch(reinterpret_cast<const char*>(ahead + j * stride + q * 64), _MM_HINT_T1);
    __m512i b[NB];
    for (int j = 0; j < NB; ++j) b[j] = _mm512_loadu_si512(w + j * block + q * 64);
    for (int m = 0; m < MR; ++m) {
      const __m512i a = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(x + m * K + q * kQ8Quad));
      for (int j = 0; j < NB; ++j) acc[m][j] = dpbusd(acc[m][j], a, b[j]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NB; ++j) _mm512_storeu_si512(sums + (m * NB + j) * kCols, reinterpret_cast<__m512i>(acc[m][j]));
}

// The bounds of block `block`'s 16 columns for rows m0 .. m0 + rows of x, from their int32 sums (row m's at
// sums + m * ld): the block's largest upper bound stored, each row's largest lower bound kept in lower[m] (16 lanes).
inline void greedy_block_bounds(const Greedy& g, int64_t m0, int64_t rows, int64_t block, const int32_t* sums,
                                int64_t ld, __m512* lower) {
  const __m512 half = _mm512_set1_ps(0.5f), rel = _mm512_set1_ps(1 + 1e-4f), of_a = _mm512_set1_ps(1e-6f);
  const __m512 floor = _mm512_set1_ps(1e-20f), none = _mm512_set1_ps(-INFINITY);
  const int64_t col = block * kCols;
  const __m512i offset = _mm512_slli_epi32(_mm512_loadu_si512(g.qsum + col), 7);
  const __m512 s = _mm512_loadu_ps(g.s + col), dw2 = _mm512_loadu_ps(g.s + g.V + col);
  const __m512 w1 = _mm512_loadu_ps(g.s + 2 * g.V + col), w2 = _mm512_loadu_ps(g.s + 3 * g.V + col);
  const __mmask16 real = col + kCols <= g.vocab ? 0xFFFF : (col >= g.vocab ? 0 : (1u << (g.vocab - col)) - 1);
  for (int64_t m = 0; m < rows; ++m) {
    const GreedyRow& r = g.rows[m0 + m];
    const __m512 sx = _mm512_set1_ps(r.sx);
    const __m512i sum = _mm512_loadu_si512(sums + m * ld);
    const __m512 a = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(sum, offset)), _mm512_mul_ps(s, sx));
    const __m512 t1 = _mm512_min_ps(_mm512_mul_ps(_mm512_mul_ps(half, s), _mm512_set1_ps(r.h1)),
                                    _mm512_mul_ps(dw2, _mm512_set1_ps(r.h2)));
    const __m512 t2 = _mm512_min_ps(_mm512_mul_ps(_mm512_mul_ps(half, sx), w1), _mm512_mul_ps(w2, _mm512_set1_ps(r.dx2)));
    __m512 e = _mm512_fmadd_ps(s, _mm512_set1_ps(g.rounding * r.x1), _mm512_add_ps(t1, t2));
    e = _mm512_add_ps(_mm512_fmadd_ps(e, rel, floor), _mm512_mul_ps(_mm512_abs_ps(a), of_a));
    g.upper[(m0 + m) * (g.V / kCols) + block] = _mm512_reduce_max_ps(_mm512_mask_blend_ps(real, none, _mm512_add_ps(a, e)));
    lower[m0 + m] = _mm512_max_ps(lower[m0 + m], _mm512_mask_blend_ps(real, none, _mm512_sub_ps(a, e)));
  }
}

// Rows m0 .. m0 + MR of x against NB blocks from `first`, through VNNI.
template <int MR, int NB>
void greedy_bounds(const Greedy& g, int64_t m0, int64_t first, const int8_t* ahead, int64_t stride, __m512* lower) {
  alignas(64) int32_t sums[MR * NB * kCols];
  greedy_sums<MR, NB>(g, m0, first, ahead, stride, sums);
  for (int j = 0; j < NB; ++j) greedy_block_bounds(g, m0, MR, first + j, sums + j * kCols, NB * kCols, lower);
}

template <int NB>
void greedy_row_tiles(const Greedy& g, int64_t first, const int8_t* ahead, __m512* lower) {
  const bool spread = g.M >= fw::kSpreadRows;  // as pair_row_tiles: three tiles or more share the requests
  const int64_t block = g.K * kCols, stride = spread ? 0 : block;
  auto tile_ahead = [&](int64_t tile) {
    return ahead && tile < (spread ? fw::kPairBlocks : 1) ? ahead + tile * block : nullptr;
  };
  int64_t m = 0;
  for (; m + fw::kPairRows <= g.M; m += fw::kPairRows)
    greedy_bounds<fw::kPairRows, NB>(g, m, first, tile_ahead(m / fw::kPairRows), stride, lower);
  const int8_t* ar = tile_ahead(m / fw::kPairRows);
  switch (g.M - m) {
    case 7: greedy_bounds<7, NB>(g, m, first, ar, stride, lower); break;
    case 6: greedy_bounds<6, NB>(g, m, first, ar, stride, lower); break;
    case 5: greedy_bounds<5, NB>(g, m, first, ar, stride, lower); break;
    case 4: greedy_bounds<4, NB>(g, m, first, ar, stride, lower); break;
    case 3: greedy_bounds<3, NB>(g, m, first, ar, stride, lower); break;
    case 2: greedy_bounds<2, NB>(g, m, first, ar, stride, lower); break;
    case 1: greedy_bounds<1, NB>(g, m, first, ar, stride, lower); break;
    default: break;
  }
}

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AMX_BF16__)
#define FW_GREEDY_AMX 1
// The int32 sums through AMX-INT8 tiles, blocks [begin, end) two at a time: a block of q8 ([K / 4, 16, 4]) is AMX's
// right-hand int8 layout as it stands (64 input features x 16 columns a tile, 1 KiB), x's bytes (q + 128, rows
// padded with zeros to a multiple of 32) the left-hand one, so TDPBUSD sums the integers vpdpbusd sums. Where the
// products run on tiles, 32 rows cost what one does and the int8 head streams at memory speed.
void greedy_amx_bounds(const Greedy& g, int64_t Mp, int64_t begin, int64_t end, __m512* lower) {
  fw::configure_tiles();  // C 0-3, A 4-5, B 6-7
  alignas(64) int32_t sums[kAmxRows * 2 * kCols];  // row r of a pass, block j of the two: (r * 2 + j) * 16
  const int64_t K = g.K, block = K * kCols, ld = 2 * kCols;
  for (int64_t j = begin; j < end; j += 2) {
    const bool two = j + 1 < end;
    const int8_t* b0 = g.q8 + j * block;
    for (int64_t m = 0; m < Mp; m += kAmxRows) {
      const bool low = m + 16 < g.M;  // rows 16-31 of the pass hold some of x
      _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
      fw::amx_int8_steps<true>(g.xu + m * K, K, b0, two ? b0 + block : nullptr, K, low);
      _tile_stored(0, sums, ld * 4);
      if (two) _tile_stored(1, sums + kCols, ld * 4);
      if (low) {
        _tile_stored(2, sums + 16 * ld, ld * 4);
        if (two) _tile_stored(3, sums + 16 * ld + kCols, ld * 4);
      }
      const int64_t rows = std::min(kAmxRows, g.M - m);
      greedy_block_bounds(g, m, rows, j, sums, ld, lower);
      if (two) greedy_block_bounds(g, m, rows, j + 1, sums + kCols, ld, lower);
    }
  }
  _tile_release();
}
#endif

// Whether logit v at column j beats the best so far (bv at bj), as torch's argmax orders them: a NaN first, then
// the largest, ties to the lowest column.
inline bool beats(float v, int64_t j, float bv, int64_t bj) {
  if (std::isnan(bv)) return std::isnan(v) && j < bj;
  return std::isnan(v) || v > bv || (v == bv && j < bj);
}
#endif

// x [M, K] bf16; tiles the head as `linear` reads it; q8, scales [4, V] and qsum [V] as pack_greedy in
// fw/sdk/dense.py builds them. Returns [M] int64: each row's argmax over the first `vocab` columns of the logits
// linear(x, tiles, float_out=True) gives, or amx_linear's where `amx_exact` (each kernel adds a column's products in
// its own order, and the columns the bounds leave are computed by the same one). `amx_bounds`: the int8 sums through
// AMX-INT8 tiles, else AVX-512 VNNI (the same integers). A row with a value that is not finite (or beyond 1e18)
// takes every column.
at::Tensor greedy_head(const at::Tensor& x, const at::Tensor& tiles, const at::Tensor& q8, const at::Tensor& scales,
                       const at::Tensor& qsum, int64_t vocab, bool amx_bounds, bool amx_exact) {
#if defined(__AVX512BF16__) && defined(__AVX512VNNI__)
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && tiles.scalar_type() == at::kBFloat16, "bad x");
  TORCH_CHECK(q8.scalar_type() == at::kChar && q8.is_contiguous() && scales.is_contiguous() && qsum.is_contiguous() &&
              tiles.is_contiguous(), "bad head");
  const int64_t M = x.size(0), K = x.size(1), V = tiles.size(0) * kCols;
  TORCH_CHECK(K % kQ8Quad == 0 && K <= 65536 && tiles.size(1) * 2 == K && q8.numel() == V * K && scales.numel() == 4 * V &&
              qsum.numel() == V && vocab > 0 && vocab <= V, "the packed head and x disagree");
#ifdef FW_GREEDY_AMX
  TORCH_CHECK(!(amx_bounds || amx_exact) || fw::amx_permitted(), "fw_dense.greedy_head: no AMX tiles for this process");
  TORCH_CHECK(!amx_bounds || K % 64 == 0, "fw_dense.greedy_head: AMX bounds need K a multiple of 64");
  TORCH_CHECK(!amx_exact || K % kAmxDepth == 0, "fw_dense.greedy_head: AMX logits need K a multiple of 32");
  const int64_t Mp = (M + kAmxRows - 1) / kAmxRows * kAmxRows;  // rows AMX passes read: x padded with zeros
#else
  TORCH_CHECK(!amx_bounds && !amx_exact, "fw_dense.greedy_head: this build has no AMX-INT8 and AMX-BF16");
  const int64_t Mp = M;
#endif
  auto xc = amx_exact && Mp != M ? at::constant_pad_nd(x, {0, 0, 0, Mp - M}) : x.contiguous();
  auto tokens = at::empty({M}, x.options().dtype(at::kLong));
  if (M == 0) return tokens;
  const bf16* xp = reinterpret_cast<const bf16*>(xc.data_ptr());
  std::vector<uint8_t> xu((amx_bounds ? Mp : M) * K, 128);  // padding rows: q = 0
  std::vector<GreedyRow> rows(M);
  std::vector<char> every(M, 0);  // rows that take every column
  for (int64_t m = 0; m < M; ++m) {
    const bf16* row = xp + m * K;
    float peak = 0;
    bool finite = true;
    for (int64_t k = 0; k < K; ++k) {
      const float v = std::abs(fw::f32(row[k]));
      finite = finite && v < 1e18f;  // false for NaN too
      peak = std::max(peak, v);
    }
    every[m] = !finite;
    const float scale = finite && peak > 0 ? peak / 127 : 0;
    double h1 = 0, h2 = 0, d2 = 0;  // in integers and doubles: no rounding worth a margin
    for (int64_t k = 0; k < K; ++k) {
      const float v = fw::f32(row[k]);
      const int q = scale > 0 ? std::clamp(static_cast<int>(std::nearbyint(v / scale)), -127, 127) : 0;
      xu[m * K + k] = static_cast<uint8_t>(q + 128);
      const double d = double(v) - double(scale) * q;
      h1 += std::abs(q), h2 += double(q) * q, d2 += d * d;
    }
    rows[m] = {scale, float(scale * h1), float(scale * std::sqrt(h2)), float(std::sqrt(d2) * (1 + 1e-6)),
               float(scale * (h1 + 0.5 * K))};
  }
  auto upper = at::empty({M, V / kCols}, x.options().dtype(at::kFloat));
  const Greedy g{xu.data(), rows.data(), q8.data_ptr<int8_t>(), scales.data_ptr<float>(), qsum.data_ptr<int32_t>(),
                 upper.data_ptr<float>(), M, K, V, vocab, float(127 * 1.05 * K * std::ldexp(1.0, -24))};
  const int64_t count = V / kCols, block = K * kCols;
  std::vector<float> threshold(M, -INFINITY);
  std::mutex merge;
  at::parallel_for(0, count, fw::kPairBlocks, [&](int64_t begin, int64_t end) {
    std::vector<__m512> lower(M, _mm512_set1_ps(-INFINITY));
#ifdef FW_GREEDY_AMX
    if (amx_bounds) greedy_amx_bounds(g, Mp, begin, end, lower.data());
#endif
    for (int64_t first = begin, nb; !amx_bounds && first < end; first += nb) {
      nb = end - first == fw::kPairBlocks + 1 ? 2 : std::min(fw::kPairBlocks, end - first);
      const int8_t* ahead = M > 1 && first + nb + fw::kPairBlocks <= end ? g.q8 + (first + nb) * block : nullptr;
      if (nb == 3) greedy_row_tiles<3>(g, first, ahead, lower.data());
      else if (nb == 2) greedy_row_tiles<2>(g, first, ahead, lower.data());
      else greedy_row_tiles<1>(g, first, ahead, lower.data());
    }
    std::lock_guard<std::mutex> hold(merge);
    for (int64_t m = 0; m < M; ++m) threshold[m] = std::max(threshold[m], _mm512_reduce_max_ps(lower[m]));
  });
  // The columns that can be the argmax, computed exactly: a block at a time, by the tile of the logits' kernel.
  const bf16* wp = reinterpret_cast<const bf16*>(tiles.data_ptr());
  std::vector<float> best(M, -INFINITY);
  std::vector<int64_t> at(M, INT64_MAX);
  at::parallel_for(0, count, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> own(M, -INFINITY);
    std::vector<int64_t> own_at(M, INT64_MAX);
    std::vector<__mmask16> open(M);
    auto take = [&](int64_t m, int64_t col, const float* exact) {
      for (int l = 0; l < kCols; ++l)
        if ((open[m] >> l & 1) && beats(exact[l], col + l, own[m], own_at[m])) own[m] = exact[l], own_at[m] = col + l;
    };
#ifdef FW_GREEDY_AMX
    alignas(64) float exact[kAmxRows * kCols];
    if (amx_exact) fw::configure_tiles();
#else
    alignas(64) float exact[kCols];
#endif
    for (int64_t b = begin; b < end; ++b) {
      const int64_t col = b * kCols;
      if (col >= vocab) break;
      const __mmask16 real = col + kCols <= vocab ? 0xFFFF : (1u << (vocab - col)) - 1;
      for (int64_t m = 0; m < M; ++m)
        open[m] = every[m] || g.upper[m * count + b] >= threshold[m] ? real : 0;
#ifdef FW_GREEDY_AMX
      if (amx_exact) {  // as amx_product: 32 rows of x against the block, K in order from 0
        for (int64_t m0 = 0; m0 < M; m0 += kAmxRows) {
          const int64_t rows_here = std::min(kAmxRows, M - m0);
          if (std::all_of(open.begin() + m0, open.begin() + m0 + rows_here, [](__mmask16 o) { return o == 0; }))
            continue;
          _tile_zero(0); _tile_zero(2);
          fw::amx_bf16_steps(xp + m0 * K, K, wp + b * block, nullptr, 0, K);
          _tile_stored(0, exact, kCols * 4);
          _tile_stored(2, exact + 16 * kCols, kCols * 4);
          for (int64_t m = m0; m < m0 + rows_here; ++m)
            if (open[m]) take(m, col, exact + (m - m0) * kCols);
        }
        continue;
      }
#endif
      for (int64_t m = 0; m < M; ++m) {
        if (!open[m]) continue;
        fw::pair_tile<1, 1>(xp + m * K, K, wp + b * block, K, nullptr, nullptr, exact, kCols, nullptr, 0);
        take(m, col, exact);
      }
    }
#ifdef FW_GREEDY_AMX
    if (amx_exact) _tile_release();
#endif
    std::lock_guard<std::mutex> hold(merge);
    for (int64_t m = 0; m < M; ++m)
      if (beats(own[m], own_at[m], best[m], at[m])) best[m] = own[m], at[m] = own_at[m];
  });
  auto* out = tokens.data_ptr<int64_t>();
  for (int64_t m = 0; m < M; ++m) out[m] = at[m];
  return tokens;
#else
  TORCH_CHECK(false, "fw_dense.greedy_head needs AVX512-BF16 and AVX512-VNNI");
#endif
}

// The int8 head greedy_head reads, from the plain bf16 head [V, K] (V a multiple of 16, K of 4): q8 [V / 16, K / 4,
// 16, 4], per column [4, V] s_j = max|w_j| / 127, |dw_j|_2, |w_j|_1, |w_j|_2 (dw_j = w_j - s_j q_j; the norms in
// double, rounded up), and qsum [V]. Empty where a weight, or a column's norm in float32, is not finite.
std::vector<at::Tensor> greedy_pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16, "a bf16 [V, K] head");
  const auto w = weight.contiguous();
  const int64_t V = w.size(0), K = w.size(1);
  TORCH_CHECK(V % kCols == 0 && K % 4 == 0, "the head's shape must be [16 n, 4 m]");
  auto q8 = at::empty({V / kCols, K / 4, kCols, 4}, w.options().dtype(at::kChar));
  auto terms = at::empty({4, V}, w.options().dtype(at::kFloat));
  auto qsum = at::empty({V}, w.options().dtype(at::kInt));
  const bf16* wp = reinterpret_cast<const bf16*>(w.data_ptr());
  int8_t* qp = q8.data_ptr<int8_t>();
  float* tp = terms.data_ptr<float>();
  int32_t* sp = qsum.data_ptr<int32_t>();
  std::atomic<bool> finite{true};
  at::parallel_for(0, V, 256, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      const bf16* row = wp + j * K;
      float peak = 0;
      for (int64_t k = 0; k < K; ++k) {
        const float v = std::abs(fw::f32(row[k]));
        if (!(v <= 3.4e38f)) finite = false;
        peak = std::max(peak, v);
      }
      const float s = peak / 127;
      int8_t* out = qp + (j / kCols) * K * kCols + j % kCols * 4;  // byte k at out + (k / 4) * 64 + k % 4
      double d2 = 0, w1 = 0, w2 = 0;
      int64_t total = 0;
      for (int64_t k = 0; k < K; ++k) {
        const double v = fw::f32(row[k]);
        const int q = s > 0 ? std::clamp(static_cast<int>(std::nearbyint(v / s)), -127, 127) : 0;
        out[(k / 4) * 4 * kCols + k % 4] = static_cast<int8_t>(q);
        const double d = v - double(s) * q;  // exact: a float times an int below 2^7
        d2 += d * d, w1 += std::abs(v), w2 += v * v, total += q;
      }
      const double up = 1 + 1e-6;
      tp[j] = s, tp[V + j] = float(std::sqrt(d2) * up), tp[2 * V + j] = float(w1 * up);
      tp[3 * V + j] = float(std::sqrt(w2) * up), sp[j] = static_cast<int32_t>(total);
      if (!std::isfinite(tp[2 * V + j]) || !std::isfinite(tp[3 * V + j])) finite = false;  // a bound of 0 * inf
    }
  });
  if (!finite) return {};
  return {q8, terms, qsum};
}

// Whether this build has `greedy_head`.
bool greedy_supported() {
#if defined(__AVX512BF16__) && defined(__AVX512VNNI__)
  return true;
#else
  return false;
#endif
}

// Whether this build's `greedy_head` takes `amx_bounds` and `amx_exact`, and the kernel grants this process AMX tiles.
bool greedy_amx_supported() {
#ifdef FW_GREEDY_AMX
  return fw::amx_permitted();
#else
  return false;
#endif
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
  m.def("greedy_head(Tensor x, Tensor tiles, Tensor q8, Tensor scales, Tensor qsum, int vocab, bool amx_bounds=False, "
        "bool amx_exact=False) -> Tensor");
  m.impl("greedy_head", c10::DispatchKey::CPU, TORCH_FN(greedy_head));
  m.def("greedy_supported() -> bool", TORCH_FN(greedy_supported));
  m.def("greedy_amx_supported() -> bool", TORCH_FN(greedy_amx_supported));
  m.def("greedy_pack(Tensor weight) -> Tensor[]", TORCH_FN(greedy_pack));
}

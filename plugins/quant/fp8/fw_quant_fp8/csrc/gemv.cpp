// Products of a few activation rows with 8-bit weights (FP8 e4m3fn, or int8 for the int8 plugin), widening each
// weight in registers as it streams by: the weights are read once at one byte each, half of bf16's traffic, which
// is what bounds a decode step. The CPU has no FP8 arithmetic; a weight's bits move into a float32's exponent and
// mantissa and one multiply by 2^120 rebiases the exponent (subnormals included), so the widening is exact.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <vector>

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

#if defined(__AVX512BF16__) && defined(__AVX512VBMI__)
// FP8 weights times bf16 activations in bf16 pairs (vdpbf16ps, AVX-512 BF16): every e4m3 value is a bf16 value
// (4 exponent bits fit in 8, 3 mantissa bits in 7; the subnormals become normal), and a bf16 product is exact in
// float32, so only the order of the float32 sums differs from widening each weight to float32, at a quarter of
// the instructions. A weight byte's bf16 comes from two 128-entry byte tables (its magnitude's low and high
// bytes, one vpermi2b each for 64 weights) and its sign bit; the bytes interleave into words within each 128-bit
// lane, so the activations are laid out once per call in that same order.
struct Bf16Tables {
  __m512i lo[2], hi[2];  // bytes of the bf16 bits of magnitudes 0-63 and 64-127
  Bf16Tables() {
    alignas(64) uint8_t l[128], h[128];
    for (int v = 0; v < 128; ++v) {
      const float f = widen_fp8(uint8_t(v));
      uint32_t bits;
      std::memcpy(&bits, &f, 4);
      l[v] = uint8_t(bits >> 16), h[v] = uint8_t(bits >> 24);
    }
    for (int i = 0; i < 2; ++i) lo[i] = _mm512_load_si512(l + 64 * i), hi[i] = _mm512_load_si512(h + 64 * i);
  }
  // 64 weight bytes as bf16 words: w0 holds bytes 0-7 of each 128-bit lane, w1 bytes 8-15.
  void words(__m512i b, __m512i& w0, __m512i& w1) const {
    const __m512i l = _mm512_permutex2var_epi8(lo[0], b, lo[1]);
    const __m512i h = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(hi[0], b, hi[1]), b,
                                                _mm512_set1_epi8(char(0x80)), 0xf8);  // the sign bit from b
    w0 = _mm512_unpacklo_epi8(l, h), w1 = _mm512_unpackhi_epi8(l, h);
  }
};

// The words of 64 activations (bf16) in the order the weights' bytes interleave: within each 128-bit lane,
// elements 0-7 of its 16 to the first vector and 8-15 to the second.
void interleave_bf16(const uint16_t* x, int64_t K, uint16_t* out) {
  for (int64_t c = 0; c < K; c += 64)
    for (int lane = 0; lane < 4; ++lane)
      for (int j = 0; j < 16; ++j) {
        const int64_t k = c + 16 * lane + j;
        out[c + (j < 8 ? 0 : 32) + 8 * lane + (j & 7)] = k < K ? x[k] : 0;
      }
}

// 64 weight bytes as bf16 words, two vectors of 32, and the order x must be in to meet them (kInterleaved: that
// of interleave_bf16, else x's own). FP8 through the byte tables; int8 by conversion (exact: 8 bits fit bf16).
struct Fp8Words {
  static constexpr bool kInterleaved = true;
  const Bf16Tables& t;
  void operator()(__m512i b, __m512i& w0, __m512i& w1) const { t.words(b, w0, w1); }
};

struct Int8Words {
  static constexpr bool kInterleaved = false;
  void operator()(__m512i b, __m512i& w0, __m512i& w1) const {
    __m512 f[4];
    for (int i = 0; i < 4; ++i) f[i] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(b, i)));
    w0 = (__m512i)_mm512_cvtne2ps_pbh(f[1], f[0]);
    w1 = (__m512i)_mm512_cvtne2ps_pbh(f[3], f[2]);
  }
};

// Accumulators: the two halves of a 64-weight chunk apart, and for one or two rows even and odd chunks apart too,
// so that no vdpbf16ps waits on the previous one (their latency, not the memory, bounded a single chain).
template <int M, typename Words>
void dot_row_bf16(const uint16_t* x, int64_t ldx, const uint8_t* w, int64_t K, const Words& words, float* out) {
  constexpr int S = M <= 2 ? 2 : 1;
  __m512 acc[S][2][M];
  for (int s = 0; s < S; ++s)
    for (int m = 0; m < M; ++m) acc[s][0][m] = acc[s][1][m] = _mm512_setzero_ps();
  auto chunk = [&](int64_t k, __m512i b, __m512 (*a)[M]) {
    __m512i w0, w1;
    words(b, w0, w1);
    for (int m = 0; m < M; ++m) {
      const uint16_t* xm = x + m * ldx + k;
      a[0][m] = _mm512_dpbf16_ps(a[0][m], (__m512bh)_mm512_loadu_si512(xm), (__m512bh)w0);
      a[1][m] = _mm512_dpbf16_ps(a[1][m], (__m512bh)_mm512_loadu_si512(xm + 32), (__m512bh)w1);
    }
  };
  int64_t k = 0;
  for (; k + 64 * S <= K; k += 64 * S)
    for (int s = 0; s < S; ++s) {
      fw::prefetch_far_and_near(w + k + 64 * s);
      chunk(k + 64 * s, _mm512_loadu_si512(w + k + 64 * s), acc[s]);
    }
  for (; k < K; k += 64) {  // zeros past K: +0.0 weights
    const __mmask64 live = K - k >= 64 ? ~__mmask64(0) : (__mmask64(1) << (K - k)) - 1;
    chunk(k, _mm512_maskz_loadu_epi8(live, w + k), acc[0]);
  }
  for (int m = 0; m < M; ++m) {
    __m512 sum = _mm512_add_ps(acc[0][0][m], acc[0][1][m]);
    if constexpr (S == 2) sum = _mm512_add_ps(sum, _mm512_add_ps(acc[1][0][m], acc[1][1][m]));
    out[m] = _mm512_reduce_add_ps(sum);
  }
}
#endif

#if defined(__AVX512BF16__) && defined(__AVX512VBMI__)
// One row of x against R weight rows at once, w[r] K bytes each, every one summed as dot_row_bf16<1> sums it (even
// and odd chunks apart: the same float32 sums, bit for bit). The rows come from the R strands of fw::strands, so
// each core reads R runs of weight at once (the numbers there).
template <int R, typename Words>
void dot_strands_bf16(const uint16_t* x, const uint8_t* const* w, int64_t K, const Words& words, float* out) {
  __m512 acc[R][2][2];  // [row][chunk parity][half of the chunk]
  for (int r = 0; r < R; ++r)
    for (int s = 0; s < 2; ++s) acc[r][s][0] = acc[r][s][1] = _mm512_setzero_ps();
  auto chunk = [&](int64_t k, int s, __mmask64 live) {
    const __m512bh x0 = (__m512bh)_mm512_loadu_si512(x + k), x1 = (__m512bh)_mm512_loadu_si512(x + k + 32);
    for (int r = 0; r < R; ++r) {
      if (live == ~__mmask64(0)) fw::prefetch_far_and_near(w[r] + k);
      __m512i w0, w1;
      words(_mm512_maskz_loadu_epi8(live, w[r] + k), w0, w1);
      acc[r][s][0] = _mm512_dpbf16_ps(acc[r][s][0], x0, (__m512bh)w0);
      acc[r][s][1] = _mm512_dpbf16_ps(acc[r][s][1], x1, (__m512bh)w1);
    }
  };
  int64_t k = 0;
  for (; k + 128 <= K; k += 128) chunk(k, 0, ~__mmask64(0)), chunk(k + 64, 1, ~__mmask64(0));
  for (; k < K; k += 64) chunk(k, 0, K - k >= 64 ? ~__mmask64(0) : (__mmask64(1) << (K - k)) - 1);  // zeros past K
  for (int r = 0; r < R; ++r)
    out[r] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[r][0][0], acc[r][0][1]),
                                                _mm512_add_ps(acc[r][1][0], acc[r][1][1])));
}
#endif

#if defined(__AVX512BF16__) && defined(__AVX512VBMI__)
// 64 weight bytes as 64 bf16 values in order (the words' order put back for FP8; int8's is already).
struct Fp8Pairs {
  Fp8Words words;
  void operator()(__m512i b, __m512i& first, __m512i& second) const {
    __m512i w0, w1;
    words(b, w0, w1);
    first = _mm512_permutex2var_epi64(w0, _mm512_set_epi64(11, 10, 3, 2, 9, 8, 1, 0), w1);
    second = _mm512_permutex2var_epi64(w0, _mm512_set_epi64(15, 14, 7, 6, 13, 12, 5, 4), w1);
  }
};

// 16 weight rows of K bytes into tile layout, 64 bytes at a time through `pairs`.
template <typename Pairs>
void widen_rows(const uint8_t* rows, int64_t K, const Pairs& pairs, uint32_t* tiles) {
  fw::widen_tiles(K, [&](int c, int64_t k0, __m512i& a, __m512i& b) {
    pairs(_mm512_loadu_si512(rows + c * K + k0), a, b);
  }, tiles);
}

// The checks of the prefill-sized kernels: x bf16 [M, K] (K a multiple of 64); weight: FP8 e4m3 or int8 bits [N, K]
// (N a multiple of 16); scale float32 [N, 1].
void check_tiles(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale, const char* name) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && weight.size(1) == x.size(1), name, ": x [M, K] and weight [N, K]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, name, ": x must be bfloat16");
  TORCH_CHECK(weight.scalar_type() == at::kByte && weight.is_contiguous(), name, ": weight must be contiguous uint8");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == weight.size(0), name, ": scale must be float32 [N, 1]");
  TORCH_CHECK(weight.size(0) % 16 == 0 && x.size(1) % 64 == 0, name, " takes N a multiple of 16 and K of 64");
}
#endif

// FP8 or int8 weights at prefill sizes through fw's dense AVX512-BF16 tiles (fw::pair_linear): each 16 weight rows
// widened, exactly, into the dense kernel's pair-interleaved blocks; each column's float32 sums are scaled once at
// the end. Returns bf16 [M, N], the bias added before rounding.
at::Tensor gemm_bf16(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale,
                     const c10::optional<at::Tensor>& bias, bool int8) {
#if defined(__AVX512BF16__) && defined(__AVX512VBMI__)
  check_tiles(x, weight, scale, "gemm_bf16");
  const int64_t K = x.size(1), N = weight.size(0);
  static const Bf16Tables tables;
  const Fp8Pairs fp8{Fp8Words{tables}};
  const auto sc = scale.contiguous();
  const uint8_t* wp = weight.data_ptr<uint8_t>();
  return fw::pair_linear(x, N, bias, sc.data_ptr<float>(), [&](int64_t n0, uint32_t* tiles) {
    if (int8) widen_rows(wp + n0 * K, K, Int8Words{}, tiles);
    else widen_rows(wp + n0 * K, K, fp8, tiles);
  });
#else
  TORCH_CHECK(false, "gemm_bf16: built without AVX512-BF16 and VBMI (has_bf16_dot() is false)");
#endif
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512VBMI__)
// FP8 or int8 weights at prefill sizes through AMX bf16 tiles. Each column pair's 32 weight rows are widened once per
// call, exactly, into AMX's right-hand tile layout: 16 pairs of input features x 16 columns, the layout of fw's
// dense blocks (fw/csrc/dense.cpp). Every 32-row tile of x then runs against them, so the weight is read and
// widened once for all the rows; gemv_bf16, a row group at a time, took 6x bf16's prefill time.
constexpr int64_t kAmxRows = 32, kCols = 16;
#endif

// x bf16 [M, K] (K a multiple of 64); weight: FP8 e4m3 or int8 bits [N, K] (N a multiple of 16); scale float32
// [N, 1]. Returns bf16 [M, N] with the bias (fw::Outputs), from exact products summed in float32.
at::Tensor gemm_amx(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale,
                    const c10::optional<at::Tensor>& bias, bool int8) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512VBMI__)
  TORCH_CHECK(fw::amx_permitted(), "gemm_amx: the kernel did not grant AMX tiles to this process");
  check_tiles(x, weight, scale, "gemm_amx");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  static const Bf16Tables tables;
  const Fp8Pairs fp8{Fp8Words{tables}};
  const int64_t Mp = (M + kAmxRows - 1) / kAmxRows * kAmxRows, blocks = N / kCols;
  const auto xp = Mp == M ? x.contiguous() : at::constant_pad_nd(x, {0, 0, 0, Mp - M});
  const fw::bf16* xb = reinterpret_cast<const fw::bf16*>(xp.data_ptr());
  const uint8_t* wp = weight.data_ptr<uint8_t>();
  const auto sc = scale.contiguous();
  const float* sp = sc.data_ptr<float>();
  const fw::Outputs out(x, M, N, at::kBFloat16, bias);
  at::parallel_for(0, (blocks + 1) / 2, 1, [&](int64_t begin, int64_t end) {
    fw::configure_tiles();  // C 0-3, A 4-5, B 6-7
    std::vector<uint32_t> tiles(K * kCols);  // the pair's two blocks, K / 2 pairs x 16 columns each
    alignas(64) float buf[16 * kCols];
    auto put = [&](int tile, int64_t row0, int64_t col0) {  // a C tile, scaled per column, into y's rows < M
      fw::store_c_tile(tile, buf);
      const __m512 s = _mm512_loadu_ps(sp + col0);
      for (int64_t r = 0; r < 16 && row0 + r < M; ++r)
        out.put16(row0 + r, col0, _mm512_mul_ps(_mm512_load_ps(buf + r * kCols), s));
    };
    for (int64_t g = begin; g < end; ++g) {
      const int64_t j = 2 * g, col = j * kCols;
      const bool two = j + 1 < blocks;
      for (int64_t b = 0; b < (two ? 2 : 1); ++b) {
        const uint8_t* rows = wp + (j + b) * kCols * K;
        uint32_t* block_tiles = tiles.data() + b * K / 2 * kCols;
        if (int8) widen_rows(rows, K, Int8Words{}, block_tiles);
        else widen_rows(rows, K, fp8, block_tiles);
      }
      const uint32_t* w0 = tiles.data();
      const uint32_t* w1 = w0 + K / 2 * kCols;
      for (int64_t m = 0; m < Mp; m += kAmxRows) {
        const fw::bf16* xm = xb + m * K;
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        fw::amx_bf16_steps(xm, K, w0, two ? w1 : nullptr, 0, K);
        put(0, m, col);
        put(2, m + 16, col);
        if (two) {
          put(1, m, col + kCols);
          put(3, m + 16, col + kCols);
        }
      }
    }
    _tile_release();
  });
  return out.y;
#else
  TORCH_CHECK(false, "gemm_amx: built without AMX-BF16 (amx_supported() is false)");
#endif
}

bool amx_supported() {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512VBMI__)
  return fw::amx_permitted();
#else
  return false;
#endif
}

bool has_bf16_dot() {
#if defined(__AVX512BF16__) && defined(__AVX512VBMI__)
  return true;
#else
  return false;
#endif
}

#if defined(__AVX512BF16__) && defined(__AVX512VBMI__)
// gemv_bf16 with one element's words.
template <typename Words>
void gemv_words(const at::Tensor& x, const uint8_t* wp, const float* sp, int64_t N, const Words& words,
                const fw::Outputs& out) {
  constexpr int64_t kRows = 8;
  const int64_t M = x.size(0), K = x.size(1), ldx = (K + 63) / 64 * 64;
  const auto xc = x.contiguous();
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
  std::vector<uint16_t> xi(M * ldx, 0);
  for (int64_t m = 0; m < M; ++m) {
    if constexpr (Words::kInterleaved) interleave_bf16(xp + m * K, K, xi.data() + m * ldx);
    else std::memcpy(xi.data() + m * ldx, xp + m * K, K * sizeof(uint16_t));
  }
  using RowFn = void (*)(const uint16_t*, int64_t, const uint8_t*, int64_t, const Words&, float*);
  static constexpr RowFn kDots[kRows] = {dot_row_bf16<1, Words>, dot_row_bf16<2, Words>, dot_row_bf16<3, Words>,
                                         dot_row_bf16<4, Words>, dot_row_bf16<5, Words>, dot_row_bf16<6, Words>,
                                         dot_row_bf16<7, Words>, dot_row_bf16<8, Words>};
  if (M == 1) {  // decode: weight rows in strands
    at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
      fw::strands<fw::kStrands>(begin, end, [&](const int64_t* n, auto count) {
        constexpr int R = decltype(count)::value;
        const uint8_t* w[R];
        float dot[R];
        for (int r = 0; r < R; ++r) w[r] = wp + n[r] * K;
        dot_strands_bf16<R>(xi.data(), w, K, words, dot);
        for (int r = 0; r < R; ++r) out.put(0, n[r], dot[r] * sp[n[r]]);
      });
    });
    return;
  }
  for (int64_t m = 0; m < M; m += kRows) {
    const int64_t rows = std::min(kRows, M - m);
    at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
      float dot[kRows];
      for (int64_t n = begin; n < end; ++n) {
        kDots[rows - 1](xi.data() + m * ldx, ldx, wp + n * K, K, words, dot);
        for (int64_t r = 0; r < rows; ++r) out.put(m + r, n, dot[r] * sp[n]);
      }
    });
  }
}
#endif

// x bf16 [M, K]; weight: FP8 e4m3 or int8 bits [N, K] as uint8; scale float32 [N, 1] (a scale per row). Returns
// float32 [M, N] (float_out: the LM head's logits), or bf16 [M, N] plus the bias (fw::Outputs).
at::Tensor gemv_bf16(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale,
                     const c10::optional<at::Tensor>& bias, bool float_out, bool int8) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && weight.size(1) == x.size(1), "x [M, K] and weight [N, K]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "x must be bfloat16");
  TORCH_CHECK(weight.scalar_type() == at::kByte && weight.is_contiguous(), "weight must be contiguous uint8");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == weight.size(0), "scale must be float32 [N, 1]");
#if defined(__AVX512BF16__) && defined(__AVX512VBMI__)
  static const Bf16Tables tables;
  const int64_t M = x.size(0), N = weight.size(0);
  const fw::Outputs out(x, M, N, float_out ? at::kFloat : at::kBFloat16, bias);
  const auto sc = scale.contiguous();
  if (int8) gemv_words(x, weight.data_ptr<uint8_t>(), sc.data_ptr<float>(), N, Int8Words{}, out);
  else gemv_words(x, weight.data_ptr<uint8_t>(), sc.data_ptr<float>(), N, Fp8Words{tables}, out);
  return out.y;
#else
  TORCH_CHECK(false, "gemv_bf16: built without AVX-512 BF16 and VBMI (has_bf16_dot() is false)");
#endif
}

}  // namespace

TORCH_LIBRARY(fw_quant_fp8, m) {
  m.def("fp8_gemv(Tensor x, Tensor weight, Tensor scale, int group) -> Tensor");
  m.impl("fp8_gemv", c10::DispatchKey::CPU, TORCH_FN(gemv<Fp8>));
  m.def("int8_gemv(Tensor x, Tensor weight, Tensor scale, int group) -> Tensor");
  m.impl("int8_gemv", c10::DispatchKey::CPU, TORCH_FN(gemv<Int8>));
  m.def("gemv_bf16(Tensor x, Tensor weight, Tensor scale, Tensor? bias, bool float_out, bool int8) -> Tensor");
  m.impl("gemv_bf16", c10::DispatchKey::CPU, TORCH_FN(gemv_bf16));
  m.def("has_bf16_dot() -> bool", TORCH_FN(has_bf16_dot));
  m.def("gemm_bf16(Tensor x, Tensor weight, Tensor scale, Tensor? bias, bool int8) -> Tensor");
  m.impl("gemm_bf16", c10::DispatchKey::CPU, TORCH_FN(gemm_bf16));
  m.def("gemm_amx(Tensor x, Tensor weight, Tensor scale, Tensor? bias, bool int8) -> Tensor");
  m.impl("gemm_amx", c10::DispatchKey::CPU, TORCH_FN(gemm_amx));
  m.def("amx_supported() -> bool", TORCH_FN(amx_supported));
}

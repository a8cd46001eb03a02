// Helpers shared by fw's native CPU kernels (this directory is on every kernel's include path).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AMX_TILE__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace fw {

#if defined(__AMX_TILE__)
// Linux enables AMX's tile state per process on request (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA, 5.16 and
// later); a kernel that uses tiles asks first and says no where it is refused.
inline bool amx_permitted() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return ok;
}

// The tile configuration _tile_loadconfig reads (palette 1): each tile's rows and bytes per row.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// This thread's tiles 0-7 as 16 rows of 64 bytes each, the shape every fw kernel uses.
inline void configure_tiles() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) config.colsb[t] = 64, config.rows[t] = 16;
  _tile_loadconfig(&config);
}

// Accumulator tile 0-3 into dst, 64 bytes a row (the tile number is an instruction immediate, hence the switch).
inline void store_c_tile(int tile, void* dst) {
  switch (tile) {
    case 0: _tile_stored(0, dst, 64); break;
    case 1: _tile_stored(1, dst, 64); break;
    case 2: _tile_stored(2, dst, 64); break;
    default: _tile_stored(3, dst, 64); break;
  }
}
#endif

using bf16 = uint16_t;  // raw bits

inline float f32(bf16 v) {
  const uint32_t u = uint32_t(v) << 16;  // bf16 is the top half of a float32
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline bf16 round_bf16(float f) {  // round to nearest even, as torch does; NaN stays NaN
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t rounded = (u + 0x7fff + ((u >> 16) & 1)) >> 16;
  return (u & 0x7fffffff) > 0x7f800000 ? bf16(0x7fc0) : bf16(rounded);
}

// Decode-step products stream each weight once from memory, not from cache: a model's weights outgrow the caches
// between two uses. The hardware prefetcher alone left the cores waiting. Requesting the weight stream this far
// ahead, on an AMX Xeon (decode tok/s): the default model 93-111 -> 120-134, with int8 activations 97-118 -> 164,
// GPTQ 4-bit 27 -> 31 (int8 activations 29 -> 35), fp8 21 -> 25, VNNI int8 39 -> 41.
// A kernel that reads several rows at once, each with few instructions a byte, asks further ahead (Ahead).
constexpr int64_t kPrefetchAhead = 2048;
template <int64_t Ahead = kPrefetchAhead>
inline void prefetch_ahead(const void* p) {
  _mm_prefetch(static_cast<const char*>(p) + Ahead, _MM_HINT_T0);
}

// For the 1-row kernels of the quant plugins, each line requested twice: 8 KiB on into L2 and 512 bytes on into L1,
// which then finds it in L2. With one request 2 KiB (GPTQ: 8 KiB) ahead into L1, a kernel's memory waits and its
// arithmetic added up instead of overlapping: L1's few outstanding misses bounded its stream. AMX Xeon, Qwen2-0.5B's
// 96 products at one row, streamed: FP8 22.2 -> 19.2 ms. Decode tok/s, two engines in turns in one process (the
// engine built second ran 3-5% faster with the same kernels; the gains below are corrected by building each first
// once, or, where marked ~, by that share): FP8 W8A16 bf16's 1.45x -> 1.56x (separate processes), VNNI int8 W8A8
// +4%, 4-bit GPTQ with int8 activations ~+5%, the default model (GGUF Q4_1, Q8_0 head) ~107 -> 113, with int8
// activations ~+3%.
inline void prefetch_far_and_near(const void* p) {
  _mm_prefetch(static_cast<const char*>(p) + 512, _MM_HINT_T0);
  _mm_prefetch(static_cast<const char*>(p) + 8192, _MM_HINT_T1);
}

// A 1-row product's weight rows [begin, end) as S strands, contiguous runs of the range read side by side:
// fn(n, count) takes count.value rows (std::integral_constant), n[r] from strand r, S at a time, then the rows
// left over one by one (count 1). A core that streams one run of weight at a time, even requested well ahead in
// software, leaves the memory idle part of the time; several runs at once keep more lines in flight. AMX Xeon,
// Qwen2-0.5B's 96 products at one row, streamed: FP8 W8A16 15.1 -> 11.6 ms with six strands (four 13.3-14.2,
// eight 13.9; four rows side by side in one run, 17.9), VNNI int8 W8A8 14.5 -> 12.2.
constexpr int kStrands = 6;

template <int S, typename Fn>
inline void strands(int64_t begin, int64_t end, const Fn& fn) {
  const int64_t run = (end - begin) / S;
  int64_t n[S];
  for (int64_t i = 0; i < run; ++i) {
    for (int r = 0; r < S; ++r) n[r] = begin + r * run + i;
    fn(n, std::integral_constant<int, S>{});
  }
  for (int64_t row = begin + S * run; row < end; ++row) fn(&row, std::integral_constant<int, 1>{});
}

#if defined(__AVX__)
inline float sum8(__m256 v) {  // the eight lanes' sum
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
// Eight-lane versions of the AVX-512 helpers below, for CPUs without AVX-512.
inline __m256 load_bf16x8(const bf16* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

inline __m256 round_bf16x8(__m256 x) {  // round to bf16 and back, nearest even (finite inputs)
  const __m256i u = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb);
  return _mm256_castsi256_ps(_mm256_and_si256(rounded, _mm256_set1_epi32(int(0xffff0000u))));
}

inline void store_bf16x8(bf16* p, __m256 x) {  // x already rounded: keep the top halves
  const __m256i top = _mm256_srli_epi32(_mm256_castps_si256(x), 16);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm_packus_epi32(_mm256_castsi256_si128(top), _mm256_extracti128_si256(top, 1)));
}

// exp as exp16 below, with 2^k built in the exponent bits: inputs below -87 give 0, above 88 infinity.
inline __m256 exp8(__m256 x) {
  const __m256 log2e = _mm256_set1_ps(1.44269504f), ln2 = _mm256_set1_ps(0.693147181f);
  const float taylor[] = {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f};
  __m256 y = _mm256_max_ps(_mm256_min_ps(_mm256_mul_ps(x, log2e), _mm256_set1_ps(128.f)), _mm256_set1_ps(-127.f));
  const __m256 k = _mm256_round_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_mul_ps(_mm256_sub_ps(y, k), ln2);
  __m256 p = _mm256_set1_ps(taylor[0]);
  for (int j = 1; j < 7; ++j) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(taylor[j]));
  const __m256i biased = _mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127));  // 0: zero, 255: inf
  return _mm256_mul_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32(biased, 23)));
}
#endif

#if defined(__AVX512F__)
inline __m512 load_bf16x16(const bf16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

inline __m512 round_bf16x16(__m512 x) {  // round to bf16 and back, nearest even (finite inputs)
  const __m512i u = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb);
  return _mm512_castsi512_ps(_mm512_and_si512(rounded, _mm512_set1_epi32(int(0xffff0000u))));
}

inline void store_bf16x16(bf16* p, __m512 x) {  // x already rounded: keep the top halves
  const __m512i top = _mm512_srli_epi32(_mm512_castps_si512(x), 16);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(top));
}

// 16 rows of 16 32-bit lanes -> 16 columns: r[j] lane i = input r[i] lane j.
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 16; i += 8) {
    for (int j = 0; j < 4; ++j) {
      t[i + j] = _mm512_shuffle_i32x4(r[i + j], r[i + j + 4], 0x88);
      t[i + j + 4] = _mm512_shuffle_i32x4(r[i + j], r[i + j + 4], 0xdd);
    }
  }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0x88);
    r[j + 8] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0xdd);
  }
}

// 16 weight rows as bf16 pairs in AMX's right-hand tile layout (that of fw's dense blocks, kPairCols below):
// tiles[p * 16 + c] holds row c's input features 2p and 2p + 1; K a multiple of 64. widen(c, k0, first, second)
// gives row c's features k0 .. k0 + 63 as bf16 in order, 32 a vector.
template <typename Widen>
void widen_tiles(int64_t K, const Widen& widen, uint32_t* tiles) {
  alignas(64) uint32_t stage[16][32];  // 16 rows x 64 features as pairs
  for (int64_t k0 = 0; k0 < K; k0 += 64) {
    for (int c = 0; c < 16; ++c) {
      __m512i first, second;
      widen(c, k0, first, second);
      _mm512_store_si512(stage[c], first);
      _mm512_store_si512(stage[c] + 16, second);
    }
    for (int half = 0; half < 2; ++half) {
      __m512i r[16];
      for (int c = 0; c < 16; ++c) r[c] = _mm512_load_si512(stage[c] + 16 * half);
      transpose16(r);
      for (int p = 0; p < 16; ++p) _mm512_storeu_si512(tiles + (k0 / 2 + 16 * half + p) * 16, r[p]);
    }
  }
}

// exp(x) = 2^k 2^f with k = round(x log2 e), |f| <= 1/2: 2^f by its degree-6 Taylor polynomial in
// f ln 2 (relative error below 2e-7), 2^k by scalef. Inputs below -87 give 0 as std::exp does.
inline __m512 exp16(__m512 x) {
  const __m512 log2e = _mm512_set1_ps(1.44269504f), ln2 = _mm512_set1_ps(0.693147181f);
  const float taylor[] = {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f};
  __m512 y = _mm512_max_ps(_mm512_min_ps(_mm512_mul_ps(x, log2e), _mm512_set1_ps(128.f)), _mm512_set1_ps(-150.f));
  const __m512 k = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_mul_ps(_mm512_sub_ps(y, k), ln2);
  __m512 p = _mm512_set1_ps(taylor[0]);
  for (int j = 1; j < 7; ++j) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(taylor[j]));
  return _mm512_scalef_ps(p, k);
}
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// C tiles 0-3 += 32 rows of bf16 x (tiles 4 and 5: rows 0-15 and 16-31, K values a row) times one or two blocks
// of 16 columns in AMX's right-hand layout (tiles 6 and 7: 16 pairs of input features x 16 columns, 1 KiB), over
// input features [k0, k1), 32 at a time: C 0 = rows 0-15 x b0, 1 = rows 0-15 x b1, 2 = rows 16-31 x b0, 3 = rows
// 16-31 x b1. b1 null: one block (tiles 1 and 3 untouched). Every tile configured as 16 rows of 64 bytes.
inline void amx_bf16_steps(const bf16* x, int64_t K, const void* b0, const void* b1, int64_t k0, int64_t k1) {
  const char* w0 = static_cast<const char*>(b0);
  const char* w1 = static_cast<const char*>(b1);
  for (int64_t k = k0; k < k1; k += 32) {  // 32 features: 16 pairs x 16 columns x 4 bytes = 32 k bytes in
    _tile_loadd(4, x + k, K * 2);
    _tile_loadd(5, x + 16 * K + k, K * 2);
    _tile_loadd(6, w0 + k * 32, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(2, 5, 6);
    if (w1) {
      _tile_loadd(7, w1 + k * 32, 64);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
}
#endif

#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
// C tiles 0-3 += the byte products of a left-hand operand's two 16-row tiles (tiles 4 and 5: its rows 0-15 and 16-31,
// `lda` bytes apart, 64 bytes of each a step) and one or two right-hand tiles (6 and 7: 16 rows of 64 bytes, the next
// 1 KiB every 64 input bytes), over input bytes [0, K): C 0 = rows 0-15 x b0, 1 = rows 0-15 x b1, 2 = rows 16-31 x
// b0, 3 = rows 16-31 x b1. b1 null: one right-hand tile; `low` false: rows 16-31 are not read (tiles 2 and 3
// untouched). Unsigned: the left-hand bytes unsigned, as vpdpbusd takes them; else both signed. Every tile configured
// as 16 rows of 64 bytes.
template <bool Unsigned>
inline void amx_int8_steps(const void* a, int64_t lda, const int8_t* b0, const int8_t* b1, int64_t K, bool low) {
  const char* ap = static_cast<const char*>(a);
  for (int64_t k = 0; k < K; k += 64) {
    _tile_loadd(4, ap + k, lda);
    _tile_loadd(6, b0 + k * 16, 64);
    if constexpr (Unsigned) _tile_dpbusd(0, 4, 6); else _tile_dpbssd(0, 4, 6);
    if (b1) {
      _tile_loadd(7, b1 + k * 16, 64);
      if constexpr (Unsigned) _tile_dpbusd(1, 4, 7); else _tile_dpbssd(1, 4, 7);
    }
    if (low) {
      _tile_loadd(5, ap + 16 * lda + k, lda);
      if constexpr (Unsigned) _tile_dpbusd(2, 5, 6); else _tile_dpbssd(2, 5, 6);
      if (b1) {
        if constexpr (Unsigned) _tile_dpbusd(3, 5, 7); else _tile_dpbssd(3, 5, 7);
      }
    }
  }
}
#endif

// Weights in pair-interleaved 16-column blocks, [N / 16, K / 2, 16, 2]: for every 16 output columns and pair of
// input features one 64-byte vector, which the AVX-512 bf16 dot-product instruction multiplies by one broadcast
// pair of activations (fw/sdk/dense.py packs a bf16 weight so; quant kernels widen their weights into it for
// prompts).
constexpr int64_t kPairCols = 16;

#if defined(__AVX512BF16__)
constexpr int64_t kPairBlocks = 3, kPairRows = 8;  // a register tile: column blocks x rows
// From this many rows of x on, three tiles share the requests for the next group's lines (pair_row_tiles).
constexpr int64_t kSpreadRows = kPairBlocks * kPairRows;

inline void store16(bf16* y, __m512 v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(y), (__m256i)_mm512_cvtneps_pbh(v)); }
inline void store16(float* y, __m512 v) { _mm512_storeu_ps(y, v); }

// y[MR, NB * 16] = x[MR, K] . W^T (+ bias) for NB blocks of w, K / 2 pairs each; with `scale` (per column),
// y = scale * (x . W^T) (+ bias), for weights stored unscaled. `ahead` (or null): kPairBlocks blocks, `stride`
// elements apart, whose lines are requested as these are read, pair for pair (stride 0: one block).
template <int MR, int NB, typename Out>
inline void pair_tile(const bf16* x, int64_t ldx, const bf16* w, int64_t K, const float* bias, const float* scale,
                      Out* y, int64_t ldy, const bf16* ahead, int64_t stride) {
  __m512 acc[MR][NB];
  const bool bias_first = bias && !scale;
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NB; ++j) acc[m][j] = bias_first ? _mm512_loadu_ps(bias + j * kPairCols) : _mm512_setzero_ps();
  const int64_t pairs = K / 2, block = pairs * 2 * kPairCols;  // elements per column block
  for (int64_t p = 0; p < pairs; ++p) {
    if (ahead)  // a constant count: a loop of the tile's own length cost small tiles a tenth
      for (int j = 0; j < kPairBlocks; ++j) _mm_prefetch(reinterpret_cast<const char*>(ahead + j * stride + p * 2 * kPairCols), _MM_HINT_T1);
    __m512bh b[NB];
    for (int j = 0; j < NB; ++j) b[j] = (__m512bh)_mm512_loadu_si512(w + j * block + p * 2 * kPairCols);
    for (int m = 0; m < MR; ++m) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(*reinterpret_cast<const int32_t*>(x + m * ldx + 2 * p));
      for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], b[j], a);
    }
  }
  if (scale) {
    for (int j = 0; j < NB; ++j) {
      const __m512 sc = _mm512_loadu_ps(scale + j * kPairCols);
      const __m512 b = bias ? _mm512_loadu_ps(bias + j * kPairCols) : _mm512_setzero_ps();
      for (int m = 0; m < MR; ++m) acc[m][j] = _mm512_fmadd_ps(acc[m][j], sc, b);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NB; ++j) store16(y + m * ldy + j * kPairCols, acc[m][j]);
}

// Every row of x against NB blocks, kPairRows at a time. `ahead` (or null): kPairBlocks blocks (the next group's),
// whose lines the tiles request as they read: with three tiles or more, a block each, else all in the first. Requested
// within the first tile alone, a group's lines arrived no sooner (at 32 rows the layers' weights streamed at 22 GB/s,
// where memory gives 36-40).
template <int NB, typename Out>
void pair_row_tiles(const bf16* x, int64_t M, int64_t K, const bf16* w, const float* bias, const float* scale, Out* y,
                    int64_t N, const bf16* ahead) {
  const bool spread = M >= kSpreadRows;
  const int64_t block = K * kPairCols, stride = spread ? 0 : block;
  auto tile_ahead = [&](int64_t tile) {
    return ahead && tile < (spread ? kPairBlocks : 1) ? ahead + tile * block : nullptr;
  };
  int64_t m = 0;
  for (; m + kPairRows <= M; m += kPairRows)
    pair_tile<kPairRows, NB>(x + m * K, K, w, K, bias, scale, y + m * N, N, tile_ahead(m / kPairRows), stride);
  const bf16* xr = x + m * K;
  const bf16* ar = tile_ahead(m / kPairRows);
  Out* yr = y + m * N;
  switch (M - m) {  // the last rows
    case 7: pair_tile<7, NB>(xr, K, w, K, bias, scale, yr, N, ar, stride); break;
    case 6: pair_tile<6, NB>(xr, K, w, K, bias, scale, yr, N, ar, stride); break;
    case 5: pair_tile<5, NB>(xr, K, w, K, bias, scale, yr, N, ar, stride); break;
    case 4: pair_tile<4, NB>(xr, K, w, K, bias, scale, yr, N, ar, stride); break;
    case 3: pair_tile<3, NB>(xr, K, w, K, bias, scale, yr, N, ar, stride); break;
    case 2: pair_tile<2, NB>(xr, K, w, K, bias, scale, yr, N, ar, stride); break;
    case 1: pair_tile<1, NB>(xr, K, w, K, bias, scale, yr, N, ar, stride); break;
    default: break;
  }
}

// y [M, N] = x [M, K] . W^T (+ bias), the column blocks split evenly between the threads, each taking its own in
// groups of kPairBlocks (four left: two groups of two, as a tile of one block keeps too few sums in flight). Split
// by whole groups, 896 outputs (56 blocks, 19 groups) left a thread idle a tenth of the time. `blocks(first, count)`
// gives the pair-interleaved weights of blocks first .. first + count - 1, contiguous (a thread's own buffer, if
// it builds them). `scale` [N] (or null) scales each column's sums before the bias. `stored` (or null): the whole
// weight where it lies, whose next group a thread requests while it multiplies the present one: a group's
// three streams start cold, and the hardware prefetchers pick them up only after a while.
template <typename Out, typename Blocks>
void pair_product(const bf16* x, int64_t M, int64_t K, const Blocks& blocks, const float* bias, Out* y, int64_t N,
                  const float* scale = nullptr, const bf16* stored = nullptr) {
  const int64_t count = N / kPairCols;
  // Only where two groups fit in L2 beside x, and for several rows: one row streams well without it (Zen 5:
  // 9728 x 896 at 8 rows 332-415 -> 211-346 us, at 32 724-768 -> 609-724, the LM head at 8 rows 6.2-7.2 -> 4.5-6.5
  // ms; 896 x 4864, whose groups take 467 KB, slowed at 1-8 rows). Where the requests are spread over three tiles
  // or more (pair_row_tiles), such groups gain too: 896 x 4864 at 32 rows, 24 layers, 9.4-10.1 -> 8.3-8.6 ms.
  const int64_t group_bytes = kPairBlocks * K * kPairCols * int64_t(sizeof(bf16));
  const bool prefetch = stored && M > 1 && group_bytes <= (M >= kSpreadRows ? 512 << 10 : 128 << 10);
  at::parallel_for(0, count, kPairBlocks, [&](int64_t begin, int64_t end) {
    for (int64_t first = begin, nb; first < end; first += nb) {
      nb = end - first == kPairBlocks + 1 ? 2 : std::min(kPairBlocks, end - first);
      const bf16* w = blocks(first, nb);
      const float* b = bias ? bias + first * kPairCols : nullptr;
      const float* sc = scale ? scale + first * kPairCols : nullptr;
      Out* out = y + first * kPairCols;
      // The next group's, when it is this thread's and whole.
      const bf16* ahead = prefetch && first + nb + kPairBlocks <= end ? stored + (first + nb) * K * kPairCols : nullptr;
      if (nb == 3) pair_row_tiles<3>(x, M, K, w, b, sc, out, N, ahead);
      else if (nb == 2) pair_row_tiles<2>(x, M, K, w, b, sc, out, N, ahead);
      else pair_row_tiles<1>(x, M, K, w, b, sc, out, N, ahead);
    }
  });
}

// y [M, N] = x [M, K] . W^T (+ bias), bf16 x and y, for a weight a kernel widens into pair-interleaved blocks
// itself (a quant format's prompts): widen(n0, block) fills the block of output rows n0 .. n0 + 15, K / 2 x 16
// pairs. Each thread builds kPairBlocks blocks at a time in its own buffer, so the widened weight never exists
// whole, and each block is built once per call for all of x's rows. `scale` [N] as pair_product's.
template <typename Widen>
at::Tensor pair_linear(const at::Tensor& x, int64_t N, const c10::optional<at::Tensor>& bias, const float* scale,
                       const Widen& widen) {
  const auto xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1);
  at::Tensor bias_f;
  if (bias.has_value()) bias_f = bias->to(at::kFloat).contiguous();
  auto y = at::empty({M, N}, x.options());
  auto blocks = [&](int64_t first, int64_t count) {
    thread_local std::vector<uint32_t> tiles;
    tiles.resize(count * K / 2 * kPairCols);
    for (int64_t b = 0; b < count; ++b) widen((first + b) * kPairCols, tiles.data() + b * K / 2 * kPairCols);
    return reinterpret_cast<const bf16*>(tiles.data());
  };
  pair_product(reinterpret_cast<const bf16*>(xc.data_ptr()), M, K, blocks,
               bias.has_value() ? bias_f.data_ptr<float>() : nullptr, reinterpret_cast<bf16*>(y.data_ptr()), N, scale);
  return y;
}
#endif

// A product's output [M, N] in the activations' dtype, and where its float32 values go: float32 as they are, or
// bf16 rounded; the bias (of that dtype) added, then rounded again. The same values as `.to(x.dtype) + bias`
// without those two small ops in every decode-step product.
struct Outputs {
  at::Tensor y, bias;
  float* f = nullptr;  // float32 y and bias, or
  const float* bias_f = nullptr;
  bf16* b = nullptr;  // bf16 y and bias
  const bf16* bias_b = nullptr;
  int64_t ld = 0;

  Outputs(const at::Tensor& like, int64_t M, int64_t N, at::ScalarType dtype, const c10::optional<at::Tensor>& b_)
      : y(at::empty({M, N}, like.options().dtype(dtype))), ld(N) {
    TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "outputs are float32 or bfloat16");
    if (b_.has_value()) {
      bias = b_->to(dtype).contiguous();
      TORCH_CHECK(bias.numel() == N, "the bias must have one value per output");
    }
    if (dtype == at::kFloat) {
      f = y.data_ptr<float>();
      if (bias.defined()) bias_f = bias.data_ptr<float>();
    } else {
      b = reinterpret_cast<bf16*>(y.data_ptr());
      if (bias.defined()) bias_b = reinterpret_cast<const bf16*>(bias.data_ptr());
    }
  }

  void put(int64_t m, int64_t n, float v) const {
    if (f) {
      f[m * ld + n] = bias_f ? v + bias_f[n] : v;
      return;
    }
    const bf16 r = round_bf16(v);
    b[m * ld + n] = bias_b ? round_bf16(f32(r) + f32(bias_b[n])) : r;
  }

#if defined(__AVX512F__)
  void put16(int64_t m, int64_t n, __m512 v) const {  // outputs n .. n + 15 of row m (finite values)
    if (f) {
      _mm512_storeu_ps(f + m * ld + n, bias_f ? _mm512_add_ps(v, _mm512_loadu_ps(bias_f + n)) : v);
      return;
    }
    __m512 r = round_bf16x16(v);
    if (bias_b) r = round_bf16x16(_mm512_add_ps(r, load_bf16x16(bias_b + n)));
    store_bf16x16(b + m * ld + n, r);
  }
#endif
};

}  // namespace fw

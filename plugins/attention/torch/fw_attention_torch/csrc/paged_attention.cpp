// Attention straight from the paged KV cache: keys and values read block by block where they lie, never gathered
// into a contiguous copy.
// - Decode: one query token per request. One task per (request, KV head): its query heads share every key and value
//   load (GQA).
// - Prefill: a chunk of one request's consecutive query tokens. One task per (block of up to kRows tokens, KV head):
//   all their query heads share every key and value load, each token attending up to its own position (causal).
// The cache holds the model dtype, fp8 or int8 rows with their scale (fw/sdk/kv_quant.py): rows are dequantized to
// float32 as they are read.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "fw_cpu.h"

namespace {

// s[i] = exp(s[i] - shift); returns their sum.
inline float exp_shifted(float* s, int64_t n, float shift) {
  int64_t i = 0;
  float sum = 0.f;
#if defined(__AVX512F__)
  __m512 total = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    const __m512 e = fw::exp16(_mm512_sub_ps(_mm512_loadu_ps(s + i), _mm512_set1_ps(shift)));
    _mm512_storeu_ps(s + i, e);
    total = _mm512_add_ps(total, e);
  }
  sum = _mm512_reduce_add_ps(total);
#endif
#if defined(__AVX2__) && defined(__FMA__)
  __m256 total8 = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 e = fw::exp8(_mm256_sub_ps(_mm256_loadu_ps(s + i), _mm256_set1_ps(shift)));
    _mm256_storeu_ps(s + i, e);
    total8 = _mm256_add_ps(total8, e);
  }
  sum += fw::sum8(total8);
#endif
  for (; i < n; ++i) sum += (s[i] = std::exp(s[i] - shift));
  return sum;
}

// The largest of s[0, n), n > 0 (a scalar loop waits on each comparison in turn: a fifth of a prefill's time).
inline float max_of(const float* s, int64_t n) {
  int64_t i = 0;
  float top = s[0];
#if defined(__AVX512F__)
  if (n >= 16) {
    __m512 m = _mm512_loadu_ps(s);
    for (i = 16; i + 16 <= n; i += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(s + i));
    top = _mm512_reduce_max_ps(m);
  }
#endif
  for (; i < n; ++i) top = std::max(top, s[i]);
  return top;
}

// a . b over n floats.
inline float dot(const float* a, const float* b, int64_t n) {
  int64_t i = 0;
  float s = 0.f;
#if defined(__AVX2__) && defined(__FMA__)
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
  }
  s = fw::sum8(_mm256_add_ps(acc0, acc1));
#endif
  // A fused multiply-add spelled out, here and in axpys: left to contraction, GCC (-march=native on an AMX Xeon)
  // fused this tail in one of the copies inlined into decode and prefill and rounded it twice in the other, so
  // their outputs parted at head sizes that are no multiple of 8.
  for (; i < n; ++i) s = std::fma(a[i], b[i], s);
  return s;
}

// Keys and values go kChunk positions at a time: one query's scores for all of them with one horizontal sum, and
// the weighted values summed in registers (an accumulator in memory, read back per position, stalled on its store).
constexpr int kChunk = 8;

// s[j] = q . rows[j] over n floats, for j < count <= kChunk. A short chunk is padded with its last row, so that
// every position's sum is taken the same way wherever the chunks of its request begin (a prefill's tokens then
// score as their decodes do).
inline void dots(const float* q, const float* const* rows, int64_t count, int64_t n, float* s) {
#if defined(__AVX2__) && defined(__FMA__)
  if (n % 8 == 0) {
    const float* r[kChunk];
    for (int j = 0; j < kChunk; ++j) r[j] = rows[std::min<int64_t>(j, count - 1)];
    __m256 acc[kChunk];
    for (int j = 0; j < kChunk; ++j) acc[j] = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i += 8) {
      const __m256 qv = _mm256_loadu_ps(q + i);
      for (int j = 0; j < kChunk; ++j) acc[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(r[j] + i), acc[j]);
    }
    // Pairwise sums across the eight accumulators: lane j of the result is acc[j]'s total.
    const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
    const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(acc[4], acc[5]), _mm256_hadd_ps(acc[6], acc[7]));
    const __m256 total = _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
    _mm256_maskstore_ps(s, _mm256_cmpgt_epi32(_mm256_set1_epi32(int(count)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)),
                        total);
    return;
  }
#endif
  for (int64_t j = 0; j < count; ++j) s[j] = dot(q, rows[j], n);
}

// acc[0, n) += sum over j < count of p[j] rows[j].
inline void axpys(float* acc, const float* p, const float* const* rows, int64_t count, int64_t n) {
  int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
  for (; i + 32 <= n; i += 32) {
    __m256 a[4];
    for (int k = 0; k < 4; ++k) a[k] = _mm256_loadu_ps(acc + i + 8 * k);
    for (int64_t j = 0; j < count; ++j) {
      const __m256 pv = _mm256_set1_ps(p[j]);
      for (int k = 0; k < 4; ++k) a[k] = _mm256_fmadd_ps(pv, _mm256_loadu_ps(rows[j] + i + 8 * k), a[k]);
    }
    for (int k = 0; k < 4; ++k) _mm256_storeu_ps(acc + i + 8 * k, a[k]);
  }
  for (; i + 8 <= n; i += 8) {
    __m256 a = _mm256_loadu_ps(acc + i);
    for (int64_t j = 0; j < count; ++j) a = _mm256_fmadd_ps(_mm256_set1_ps(p[j]), _mm256_loadu_ps(rows[j] + i), a);
    _mm256_storeu_ps(acc + i, a);
  }
#endif
  for (; i < n; ++i) {
    float a = acc[i];
    for (int64_t j = 0; j < count; ++j) a = std::fma(p[j], rows[j][i], a);
    acc[i] = a;
  }
}

template <typename T>
inline void to_float(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// The generic path: no bf16 dot-product instructions, or another dtype.
template <typename T>
inline bool bf16_scores(const T*, const T*, const int32_t*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                        int64_t, float, std::vector<float>&) {
  return false;
}

#if defined(__AVX2__) && defined(__FMA__)
template <>
inline void to_float(const at::BFloat16* src, float* dst, int64_t n) {
  const fw::bf16* raw = reinterpret_cast<const fw::bf16*>(src);
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(dst + i, fw::load_bf16x16(raw + i));
#endif
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, fw::load_bf16x8(raw + i));
  for (; i < n; ++i) dst[i] = fw::f32(raw[i]);
}
#endif

#if defined(__AVX512BF16__)

// q.k for every query vector (the group's heads, of one or several tokens) and every key position, with the bf16
// pairwise dot-product instruction (exact products, float32 sums). Keys go 16 positions at a time (the last ones
// padded with repeats of the last row): transposed once into a tile in which one vector holds one pair of head
// dimensions of all 16; each query vector then takes one instruction per pair and yields 16 scores without a
// horizontal sum.
constexpr int64_t kMaxChunks = 8;  // head_size / 32 at most (256)

// B query vectors (pairs `half` apart) against one tile: their accumulators in registers, which needs B known
// when compiling. Scores for the first `count` positions go to out, rows n apart.
template <int B>
inline void score_tile(const __m512i* tile, int64_t chunks, const int32_t* qpairs, int64_t half, float scale,
                       int64_t count, float* out, int64_t n) {
  __m512 acc[B];
  for (int h = 0; h < B; ++h) acc[h] = _mm512_setzero_ps();
  for (int64_t c = 0; c < chunks; ++c) {
    for (int p = 0; p < 16; ++p) {
      const __m512bh cols = (__m512bh)tile[16 * c + p];
      for (int h = 0; h < B; ++h)
        acc[h] = _mm512_dpbf16_ps(acc[h], cols, (__m512bh)_mm512_set1_epi32(qpairs[h * half + 16 * c + p]));
    }
  }
  const __mmask16 keep = count >= 16 ? __mmask16(0xffff) : __mmask16((1u << count) - 1);
  for (int h = 0; h < B; ++h) _mm512_mask_storeu_ps(out + h * n, keep, _mm512_mul_ps(acc[h], _mm512_set1_ps(scale)));
}

using ScoreTile = void (*)(const __m512i*, int64_t, const int32_t*, int64_t, float, int64_t, float*, int64_t);
template <int... B>
constexpr std::array<ScoreTile, sizeof...(B)> score_tiles(std::integer_sequence<int, B...>) {
  return {score_tile<B + 1>...};
}
constexpr auto kScoreTiles = score_tiles(std::make_integer_sequence<int, 15>{});  // 1 to 15 vectors

// A walk over a request's positions in order: its slot in the cache with no division per position (a tile's 32
// divisions, for its rows and the next tile's requests: 32 requests x 192 positions on one thread, AMX Xeon, 0.50
// -> 0.43 ms a layer).
struct Positions {
  const int32_t* table;
  int64_t block_size, block, offset;
  Positions(const int32_t* table, int64_t block_size, int64_t t)
      : table(table), block_size(block_size), block(t / block_size), offset(t % block_size) {}
  int64_t slot() const { return int64_t(table[block]) * block_size + offset; }
  void next() {
    if (++offset == block_size) ++block, offset = 0;
  }
};

inline bool bf16_scores(const at::BFloat16* q, const at::BFloat16* kp, const int32_t* table, int64_t block_size,
                        int64_t first, int64_t len, int64_t vectors, int64_t head_size, int64_t kv_heads, int64_t g,
                        float scale, std::vector<float>& scores) {
  if (head_size % 32 || head_size / 32 > kMaxChunks) return false;
  const int64_t n = len - first, chunks = head_size / 32, half = head_size / 2;
  const int32_t* qpairs = reinterpret_cast<const int32_t*>(q);
  __m512i tile[kMaxChunks * 16];
  auto row = [&](const Positions& p) { return kp + (p.slot() * kv_heads + g) * head_size; };
  Positions pos(table, block_size, first);
  for (int64_t t = first; t < len; t += 16) {
    const int64_t count = std::min<int64_t>(16, len - t);
    const at::BFloat16* rows[16];
    for (int i = 0; i < 16; ++i) {  // past the last position: the last row again
      rows[i] = i < count ? row(pos) : rows[count - 1];
      if (i < count) pos.next();
    }
    Positions ahead = pos;  // the next tile's rows (see weigh_values)
    for (int64_t i = t + 16; i < std::min(len, t + 32); ++i, ahead.next()) {
      const char* bytes = reinterpret_cast<const char*>(row(ahead));
      for (int64_t b = 0; b < head_size * 2; b += 64) _mm_prefetch(bytes + b, _MM_HINT_T0);
    }
    for (int64_t c = 0; c < chunks; ++c) {
      __m512i* cols = tile + 16 * c;
      for (int i = 0; i < 16; ++i) cols[i] = _mm512_loadu_si512(rows[i] + 32 * c);
      fw::transpose16(cols);
    }
    // The vectors 16 at a time, then the rest in one pass: each accumulator is a chain of dependent instructions,
    // and a pass of few chains waits on their latency (a group of 7 in passes of 4, 2 and 1 took 2.5x its
    // instructions' time).
    float* out = scores.data() + t - first;
    int64_t h = 0;
    for (; h + 16 <= vectors; h += 16) score_tile<16>(tile, chunks, qpairs + h * half, half, scale, count, out + h * n, n);
    if (h < vectors) kScoreTiles[vectors - h - 1](tile, chunks, qpairs + h * half, half, scale, count, out + h * n, n);
  }
  return true;
}
#endif

// Where a request's positions lie: its block table row, and the first value of its KV head in the cache (slot 0);
// position t's row is `stride` values per slot further.
struct PagedRows {
  const int32_t* table;
  int64_t block_size, stride;
  const fw::bf16* base;
};

#if defined(__AVX512F__)
// The weighted sum of bf16 value rows for HP heads of a group (P vectors a row), acc[h] = sum_t p[h][t] v[t], in the
// order the generic path adds them (one multiply-add a position, in position order: the same sums bit for bit).
// Every accumulator stays in a register across the positions, so each row is read and widened once for all the
// heads that share it (GQA); the generic path reads it again for every head, its accumulators in memory.
// Positions go a block at a time (no division per position).
template <int P, int HP>
void weigh_values(const float* s, int64_t n, const PagedRows& rows, int64_t first, int64_t len, float* out) {
  __m512 acc[HP][P];
  for (int h = 0; h < HP; ++h)
    for (int k = 0; k < P; ++k) acc[h][k] = _mm512_setzero_ps();
  // Rows kAhead positions on are requested as each is read: a request's blocks lie anywhere in the cache, and the
  // hardware prefetchers start cold at each.
  constexpr int64_t kAhead = 16;
  for (int64_t t = first; t < len;) {
    const int64_t block = t / rows.block_size, stop = std::min(len, (block + 1) * rows.block_size);
    const fw::bf16* v = rows.base + (int64_t(rows.table[block]) * rows.block_size + t % rows.block_size) * rows.stride;
    const bool last = stop == len;
    const fw::bf16* next = rows.base + int64_t(rows.table[last ? block : block + 1]) * rows.block_size * rows.stride;
    for (; t < stop; ++t, v += rows.stride) {
      const int64_t beyond = t + kAhead - stop;  // the row kAhead on lies this far into the next block
      const fw::bf16* ahead = beyond < 0 ? v + kAhead * rows.stride : next + beyond * rows.stride;
      for (int k = 0; k < P; k += 2) _mm_prefetch(reinterpret_cast<const char*>(ahead + 16 * k), _MM_HINT_T0);
      __m512 x[P];
      for (int k = 0; k < P; ++k) x[k] = fw::load_bf16x16(v + 16 * k);
      for (int h = 0; h < HP; ++h) {
        const __m512 w = _mm512_set1_ps(s[h * n + t - first]);
        for (int k = 0; k < P; ++k) acc[h][k] = _mm512_fmadd_ps(w, x[k], acc[h][k]);
      }
    }
  }
  for (int h = 0; h < HP; ++h)
    for (int k = 0; k < P; ++k) _mm512_storeu_ps(out + (h * P + k) * 16, acc[h][k]);
}

// The heads in passes of as many as 28 registers hold beside a row (head size 64: 7 heads, Qwen2-0.5B's group).
template <int P>
void weigh_group(const float* s, int64_t n, const PagedRows& rows, int64_t first, int64_t len, int64_t vectors,
                 float* out) {
  constexpr int kHeads = std::min(7, 28 / P);
  for (int64_t h0 = 0; h0 < vectors; h0 += kHeads) {
    const float* sh = s + h0 * n;
    float* oh = out + h0 * P * 16;
    switch (std::min<int64_t>(kHeads, vectors - h0)) {
      case 1: weigh_values<P, 1>(sh, n, rows, first, len, oh); break;
      case 2: if constexpr (kHeads >= 2) weigh_values<P, 2>(sh, n, rows, first, len, oh); break;
      case 3: if constexpr (kHeads >= 3) weigh_values<P, 3>(sh, n, rows, first, len, oh); break;
      case 4: if constexpr (kHeads >= 4) weigh_values<P, 4>(sh, n, rows, first, len, oh); break;
      case 5: if constexpr (kHeads >= 5) weigh_values<P, 5>(sh, n, rows, first, len, oh); break;
      case 6: if constexpr (kHeads >= 6) weigh_values<P, 6>(sh, n, rows, first, len, oh); break;
      default: if constexpr (kHeads >= 7) weigh_values<P, 7>(sh, n, rows, first, len, oh); break;
    }
  }
}
#endif

// out [vectors, head_size] = the normalized scores s [vectors, len - first] times the bf16 value rows; false
// where this build or head size has no such kernel.
inline bool bf16_values(const float* s, int64_t vectors, const PagedRows& rows, int64_t first, int64_t len,
                        int64_t head_size, float* out) {
#if defined(__AVX512F__)
  const int64_t n = len - first;
  switch (head_size) {
    case 32: weigh_group<2>(s, n, rows, first, len, vectors, out); return true;
    case 64: weigh_group<4>(s, n, rows, first, len, vectors, out); return true;
    case 128: weigh_group<8>(s, n, rows, first, len, vectors, out); return true;
    default: return false;
  }
#else
  return false;
#endif
}

// How one head's row of the cache becomes float32 (the formats of fw/sdk/kv_quant.py): load returns the row's n values
// as float32, converted into dst, or where they lie when the cache holds float32.
template <typename T>
struct Plain {  // the model dtype
  using Elem = T;
  const float* load(const T* row, float* dst, int64_t n) const {
    if constexpr (std::is_same_v<T, float>) return row;
    to_float(row, dst, n);
    return dst;
  }
};

struct Fp8 {  // float8_e4m3fn times the layer's scale
  using Elem = c10::Float8_e4m3fn;
  float scale;
  const float* load(const Elem* row, float* dst, int64_t n) const {
    // All 256 values, so a load is a table lookup rather than a bit-level conversion per element.
    static const std::array<float, 256> table = [] {
      std::array<float, 256> t;
      for (int b = 0; b < 256; ++b) t[b] = static_cast<float>(Elem(static_cast<uint8_t>(b), Elem::from_bits()));
      return t;
    }();
    const uint8_t* bits = reinterpret_cast<const uint8_t*>(row);
    for (int64_t i = 0; i < n; ++i) dst[i] = table[bits[i]] * scale;
    return dst;
  }
};

struct Int8 {  // int8 times the row's own float32 scale, stored right after its n values
  using Elem = int8_t;
  const float* load(const int8_t* row, float* dst, int64_t n) const {
    float step;
    std::memcpy(&step, row + n, sizeof step);
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) dst[i] = row[i] * step;
    return dst;
  }
};

// What every task of one call reads: the cache, its layout and the layer's attention parameters.
template <typename T, typename Format>
struct Paged {
  using Elem = typename Format::Elem;
  const Elem* kp;
  const Elem* vp;
  Format keys, values;
  int64_t block_size, kv_heads, head_size, row_len, group;
  int64_t window;  // attend to the last `window` keys, 0 for all
  float scale, soft_cap;

  // A thread's buffers, reused across its tasks.
  struct Scratch {
    std::vector<float> query, acc, rows, scores;
    std::vector<T> gathered;  // a prefill task's query vectors, contiguous
  };

  // Attention for `tokens` consecutive positions of one request, the last at position len - 1, each with the
  // `group` query heads of KV head g: q holds their tokens * group vectors contiguous, token by token. Token i
  // attends to the positions up to its own (and within the window); the rest of the positions the last token
  // sees get probability 0, so every vector's sums add the same terms in the same order as a decode of its own
  // length. Each token's `group` outputs go to out + i * out_stride.
  void attend(const T* q, int64_t tokens, const int32_t* table, int64_t len, int64_t g, Scratch& b, T* out,
              int64_t out_stride) const {
    const int64_t vectors = tokens * group;
    const int64_t first = window > 0 ? std::max<int64_t>(0, len - tokens + 1 - window) : 0, n = len - first;
    b.scores.resize(vectors * n);
    b.acc.resize(vectors * head_size);
    // fn(first position, float32 rows, count) for head g's rows of `cache` at positions [first, len), kChunk at
    // a time, a block at a time (no division per position).
    auto for_each_chunk = [&](const Format& format, const Elem* cache, const auto& fn) {
      const float* chunk[kChunk];
      int64_t count = 0, start = first;
      for (int64_t t = first; t < len;) {
        const int64_t block = t / block_size, stop = std::min(len, (block + 1) * block_size);
        const int64_t base = int64_t(table[block]) * block_size - block * block_size;
        for (; t < stop; ++t) {
          chunk[count] = format.load(cache + ((base + t) * kv_heads + g) * row_len, b.rows.data() + count * head_size,
                                     head_size);
          if (++count == kChunk) fn(start, chunk, count), start += count, count = 0;
        }
      }
      if (count > 0) fn(start, chunk, count);
    };

    bool scored = false;
    if constexpr (std::is_same_v<Format, Plain<T>>) {  // the bf16 fast path reads the model dtype only
      scored = bf16_scores(q, kp, table, block_size, first, len, vectors, head_size, kv_heads, g, scale, b.scores);
    }
    if (!scored) {
      b.query.resize(vectors * head_size);
      b.rows.resize(kChunk * head_size);
      for (int64_t i = 0; i < vectors * head_size; ++i) b.query[i] = static_cast<float>(q[i]) * scale;
      for_each_chunk(keys, kp, [&](int64_t t, const float* const* k, int64_t count) {
        for (int64_t h = 0; h < vectors; ++h)
          dots(b.query.data() + h * head_size, k, count, head_size, b.scores.data() + h * n + t - first);
      });
    }
    for (int64_t h = 0; h < vectors; ++h) {
      const int64_t own_len = len - (tokens - 1 - h / group);
      const int64_t lo = (window > 0 ? std::max<int64_t>(0, own_len - window) : 0) - first, hi = own_len - first;
      float* s = b.scores.data() + h * n;
      if (soft_cap > 0) {  // Gemma 2's cap: scores become cap * tanh(scores / cap)
        for (int64_t t = lo; t < hi; ++t) s[t] = soft_cap * std::tanh(s[t] / soft_cap);
      }
      const float top = max_of(s + lo, hi - lo);
      const float inverse = 1.f / exp_shifted(s + lo, hi - lo, top);
      for (int64_t t = lo; t < hi; ++t) s[t] *= inverse;
      std::fill(s, s + lo, 0.f);
      std::fill(s + hi, s + n, 0.f);
    }
    bool weighed = false;
    if constexpr (std::is_same_v<Format, Plain<T>> && std::is_same_v<T, at::BFloat16>) {
      const PagedRows rows{table, block_size, kv_heads * head_size, reinterpret_cast<const fw::bf16*>(vp) + g * head_size};
      weighed = bf16_values(b.scores.data(), vectors, rows, first, len, head_size, b.acc.data());
    }
    if (!weighed) {
      b.rows.resize(kChunk * head_size);
      std::fill(b.acc.begin(), b.acc.end(), 0.f);
      for_each_chunk(values, vp, [&](int64_t t, const float* const* v, int64_t count) {
        for (int64_t h = 0; h < vectors; ++h)
          axpys(b.acc.data() + h * head_size, b.scores.data() + h * n + t - first, v, count, head_size);
      });
    }
    for (int64_t i = 0; i < tokens; ++i)
      for (int64_t j = 0; j < group * head_size; ++j)
        out[i * out_stride + j] = static_cast<T>(b.acc[i * group * head_size + j]);
  }
};

// fn(task, scratch) for every task in [0, count), which threads claim one at a time in order: a thread the system
// holds back takes fewer, and with the longest tasks first, the last ones claimed are short.
template <typename Scratch, typename Fn>
void run_tasks(int64_t count, const Fn& fn) {
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(count, at::get_num_threads()), 1, [&](int64_t, int64_t) {
    Scratch scratch;
    for (int64_t task = next++; task < count; task = next++) fn(task, scratch);
  });
}

// One query token per request r: its seq_lens[r] - 1 is the query's position.
template <typename T, typename Format>
void decode(const Paged<T, Format>& paged, const at::Tensor& q, const at::Tensor& block_tables,
            const at::Tensor& seq_lens, at::Tensor& out) {
  const int64_t num_reqs = q.size(0), num_heads = q.size(1), kv_heads = paged.kv_heads;
  const int64_t max_blocks = block_tables.size(1), width = paged.group * paged.head_size;
  const T* qp = q.data_ptr<T>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  T* op = out.data_ptr<T>();
  run_tasks<typename Paged<T, Format>::Scratch>(num_reqs * kv_heads, [&](int64_t task, auto& scratch) {
    const int64_t r = task / kv_heads, g = task % kv_heads, at = r * num_heads * paged.head_size + g * width;
    paged.attend(qp + at, 1, tables + r * max_blocks, lens[r], g, scratch, op + at, width);
  });
}

// Query token i of the chunk at position first_pos + i of the request whose blocks `block_table` lists.
template <typename T, typename Format>
void prefill(const Paged<T, Format>& paged, const at::Tensor& q, const at::Tensor& block_table, int64_t first_pos,
             at::Tensor& out) {
  // Tokens per task: enough that each key and value load serves many query vectors, few enough that a task's
  // scores (tokens * group * positions floats) stay in L2 and that the positions past a token's own, which the
  // block's last token sees, add little.
  constexpr int64_t kRows = 8, kScoreBytes = 256 << 10;
  const int64_t tokens = q.size(0), num_heads = q.size(1), kv_heads = paged.kv_heads, head_size = paged.head_size;
  const int64_t width = paged.group * head_size, last_len = first_pos + tokens;
  const int64_t fit = kScoreBytes / int64_t(sizeof(float)) / (paged.group * last_len);
  const int64_t rows = std::clamp<int64_t>(fit, 1, kRows), blocks = (tokens + rows - 1) / rows;
  const T* qp = q.data_ptr<T>();
  const int32_t* table = block_table.data_ptr<int32_t>();
  T* op = out.data_ptr<T>();
  run_tasks<typename Paged<T, Format>::Scratch>(blocks * kv_heads, [&](int64_t task, auto& scratch) {
    const int64_t block = blocks - 1 - task / kv_heads, g = task % kv_heads;  // the longest first
    const int64_t i0 = block * rows, count = std::min(rows, tokens - i0);
    scratch.gathered.resize(count * width);
    for (int64_t i = 0; i < count; ++i)
      std::copy_n(qp + ((i0 + i) * num_heads) * head_size + g * width, width, scratch.gathered.data() + i * width);
    paged.attend(scratch.gathered.data(), count, table, first_pos + i0 + count, g, scratch,
                 op + (i0 * num_heads) * head_size + g * width, num_heads * head_size);
  });
}

// fn(paged) with the Paged view of kv_cache for q's dtype and the cache's format.
template <typename Fn>
void with_paged(const at::Tensor& q, const at::Tensor& kv_cache, double scale, int64_t window, double soft_cap,
                double k_scale, double v_scale, const Fn& fn) {
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2, "kv_cache must be [2, blocks, block_size, kv_heads, row]");
  const auto key_cache = kv_cache.select(0, 0), value_cache = kv_cache.select(0, 1);
  const auto cache_type = key_cache.scalar_type();
  const int64_t row_len = q.size(2) + (cache_type == at::kChar ? int64_t(sizeof(float)) : 0);
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "q must be [tokens, heads, head_size], contiguous");
  TORCH_CHECK(q.size(1) % key_cache.size(2) == 0 && key_cache.size(3) == row_len, "heads do not match the cache");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "the cache must be contiguous");
  TORCH_CHECK(cache_type == q.scalar_type() || cache_type == at::kFloat8_e4m3fn || cache_type == at::kChar,
              "the cache holds q's dtype, float8_e4m3fn or int8");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention", [&] {
    auto paged = [&](auto format) {
      using Format = decltype(format);
      return Paged<scalar_t, Format>{static_cast<const typename Format::Elem*>(key_cache.data_ptr()),
                                     static_cast<const typename Format::Elem*>(value_cache.data_ptr()),
                                     format, format, key_cache.size(1), key_cache.size(2), q.size(2), row_len,
                                     q.size(1) / key_cache.size(2), window, float(scale), float(soft_cap)};
    };
    if (cache_type == at::kFloat8_e4m3fn) {
      auto view = paged(Fp8{float(k_scale)});
      view.values = Fp8{float(v_scale)};
      fn(view);
    } else if (cache_type == at::kChar) {
      fn(paged(Int8{}));
    } else {
      fn(paged(Plain<scalar_t>{}));
    }
  });
}

// q [reqs, heads, head_size]; kv_cache [2, blocks, block_size, kv_heads, row], keys then values (split here: two
// views made in Python cost more than the kernel at short contexts): row is head_size values
// of q's dtype or float8_e4m3fn, or head_size int8 values and their float32 scale; block_tables [reqs, max_blocks]
// int32; seq_lens [reqs] int32 (the query is the last position); window: attend to the last `window` keys, 0 for
// all; soft_cap: the logit soft cap, 0 for none; k_scale/v_scale: an fp8 cache's per-layer scales.
at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_tables,
                        const at::Tensor& seq_lens, double scale, int64_t window, double soft_cap, double k_scale,
                        double v_scale) {
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt, "int32 tables expected");
  auto query = q.contiguous();
  auto tables = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  auto out = at::empty_like(query);
  with_paged(query, kv_cache, scale, window, soft_cap, k_scale, v_scale,
             [&](const auto& paged) { decode(paged, query, tables, lens, out); });
  return out;
}

// q [tokens, heads, head_size]: one request's chunk, token i at position first_pos + i, its keys and values in
// the cache already; block_table [max_blocks] int32, the request's blocks. The rest as paged_decode's.
at::Tensor paged_prefill(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_table,
                         int64_t first_pos, double scale, int64_t window, double soft_cap, double k_scale,
                         double v_scale) {
  TORCH_CHECK(block_table.dim() == 1 && block_table.scalar_type() == at::kInt, "block_table must be [blocks] int32");
  TORCH_CHECK(first_pos >= 0, "first_pos must not be negative");
  auto query = q.contiguous();
  auto table = block_table.contiguous();
  TORCH_CHECK((first_pos + query.size(0) + kv_cache.size(2) - 1) / kv_cache.size(2) <= table.size(0),
              "the block table does not reach the chunk's last position");
  auto out = at::empty_like(query);
  if (query.size(0) > 0) {
    with_paged(query, kv_cache, scale, window, soft_cap, k_scale, v_scale,
               [&](const auto& paged) { prefill(paged, query, table, first_pos, out); });
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(fw_attention_torch, m) {
  m.def("paged_decode(Tensor q, Tensor kv_cache, Tensor block_tables, Tensor seq_lens, "
        "float scale, int window, float soft_cap, float k_scale, float v_scale) -> Tensor");
  m.impl("paged_decode", c10::DispatchKey::CPU, TORCH_FN(paged_decode));
  m.def("paged_prefill(Tensor q, Tensor kv_cache, Tensor block_table, int first_pos, "
        "float scale, int window, float soft_cap, float k_scale, float v_scale) -> Tensor");
  m.impl("paged_prefill", c10::DispatchKey::CPU, TORCH_FN(paged_prefill));
}

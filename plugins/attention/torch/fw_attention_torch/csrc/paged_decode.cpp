// Decode attention straight from the paged KV cache: one query token per request, keys and values
// read block by block where they lie, never gathered into a contiguous copy.
// One task per (request, KV head): its query heads share every key and value load (GQA).
// The cache holds the model dtype, fp8 or int8 rows with their scale (fw/sdk/kv_quant.py): rows are dequantized to
// float32 as they are read.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <type_traits>
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

// a . b and a += p b over n floats.
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
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// Keys and values go kChunk positions at a time: one query's scores for all of them with one horizontal sum, and
// the weighted values summed in registers (an accumulator in memory, read back per position, stalled on its store).
constexpr int kChunk = 8;

// s[j] = q . rows[j] over n floats, for j < count <= kChunk.
inline void dots(const float* q, const float* const* rows, int64_t count, int64_t n, float* s) {
#if defined(__AVX2__) && defined(__FMA__)
  if (count == kChunk && n % 8 == 0) {
    __m256 acc[kChunk];
    for (int j = 0; j < kChunk; ++j) acc[j] = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i += 8) {
      const __m256 qv = _mm256_loadu_ps(q + i);
      for (int j = 0; j < kChunk; ++j) acc[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(rows[j] + i), acc[j]);
    }
    // Pairwise sums across the eight accumulators: lane j of the result is acc[j]'s total.
    const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
    const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(acc[4], acc[5]), _mm256_hadd_ps(acc[6], acc[7]));
    _mm256_storeu_ps(s, _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31)));
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
    for (int64_t j = 0; j < count; ++j) a += p[j] * rows[j][i];
    acc[i] = a;
  }
}

template <typename T>
inline void to_float(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// The generic path: no bf16 dot-product instructions, or another dtype.
template <typename T, typename Slot>
inline bool bf16_scores(const T*, const T*, Slot, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, float,
                        std::vector<float>&) {
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

// q.k for every query head of the group and every key position, with the bf16 pairwise dot-product
// instruction (exact products, float32 sums). Keys go 16 positions at a time: transposed so that one
// vector holds one pair of head dimensions of all 16, each query head then takes one instruction per
// pair and yields 16 scores without a horizontal sum.
constexpr int64_t kMaxGroup = 16;

template <typename Slot>
inline bool bf16_scores(const at::BFloat16* q, const at::BFloat16* kp, Slot slot, int64_t first, int64_t len,
                        int64_t group, int64_t head_size, int64_t kv_heads, int64_t g, float scale,
                        std::vector<float>& scores) {
  if (head_size % 32 || group > kMaxGroup) return false;
  const int64_t n = len - first, chunks = head_size / 32;
  const int32_t* qpairs = reinterpret_cast<const int32_t*>(q);
  int64_t t = first;
  for (; t + 16 <= len; t += 16) {
    const at::BFloat16* rows[16];
    for (int i = 0; i < 16; ++i) rows[i] = kp + (slot(t + i) * kv_heads + g) * head_size;
    __m512 acc[kMaxGroup];
    for (int64_t h = 0; h < group; ++h) acc[h] = _mm512_setzero_ps();
    for (int64_t c = 0; c < chunks; ++c) {
      __m512i cols[16];
      for (int i = 0; i < 16; ++i) cols[i] = _mm512_loadu_si512(rows[i] + 32 * c);
      fw::transpose16(cols);
      for (int p = 0; p < 16; ++p) {
        for (int64_t h = 0; h < group; ++h) {
          const __m512i qp = _mm512_set1_epi32(qpairs[(h * head_size) / 2 + 16 * c + p]);
          acc[h] = _mm512_dpbf16_ps(acc[h], (__m512bh)cols[p], (__m512bh)qp);
        }
      }
    }
    for (int64_t h = 0; h < group; ++h) {
      _mm512_storeu_ps(scores.data() + h * n + t - first, _mm512_mul_ps(acc[h], _mm512_set1_ps(scale)));
    }
  }
  for (; t < len; ++t) {  // the last positions, one at a time
    const at::BFloat16* k = kp + (slot(t) * kv_heads + g) * head_size;
    for (int64_t h = 0; h < group; ++h) {
      const at::BFloat16* qh = q + h * head_size;
      __m512 acc = _mm512_setzero_ps();
      for (int64_t c = 0; c < chunks; ++c) {
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(qh + 32 * c), (__m512bh)_mm512_loadu_si512(k + 32 * c));
      }
      scores[h * n + t - first] = _mm512_reduce_add_ps(acc) * scale;
    }
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
  for (int64_t t = first; t < len;) {
    const int64_t block = t / rows.block_size, stop = std::min(len, (block + 1) * rows.block_size);
    const fw::bf16* v = rows.base + (int64_t(rows.table[block]) * rows.block_size + t % rows.block_size) * rows.stride;
    for (; t < stop; ++t, v += rows.stride) {
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
void weigh_group(const float* s, int64_t n, const PagedRows& rows, int64_t first, int64_t len, int64_t group,
                 float* out) {
  constexpr int kHeads = std::min(7, 28 / P);
  for (int64_t h0 = 0; h0 < group; h0 += kHeads) {
    const float* sh = s + h0 * n;
    float* oh = out + h0 * P * 16;
    switch (std::min<int64_t>(kHeads, group - h0)) {
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

// out [group, head_size] = the group's normalized scores s [group, len - first] times its bf16 value rows; false
// where this build or head size has no such kernel.
inline bool bf16_values(const float* s, int64_t group, const PagedRows& rows, int64_t first, int64_t len,
                        int64_t head_size, float* out) {
#if defined(__AVX512F__)
  const int64_t n = len - first;
  switch (head_size) {
    case 32: weigh_group<2>(s, n, rows, first, len, group, out); return true;
    case 64: weigh_group<4>(s, n, rows, first, len, group, out); return true;
    case 128: weigh_group<8>(s, n, rows, first, len, group, out); return true;
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

template <typename T, typename Format>
void decode(const at::Tensor& q, const at::Tensor& key_cache, const at::Tensor& value_cache,
            const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale, int64_t window,
            double soft_cap, Format keys, Format values, at::Tensor& out) {
  using Elem = typename Format::Elem;
  const int64_t num_reqs = q.size(0), num_heads = q.size(1), head_size = q.size(2);
  const int64_t block_size = key_cache.size(1), kv_heads = key_cache.size(2), max_blocks = block_tables.size(1);
  const int64_t group = num_heads / kv_heads, row_len = key_cache.size(3);
  const T* qp = q.data_ptr<T>();
  const Elem* kp = static_cast<const Elem*>(key_cache.data_ptr());
  const Elem* vp = static_cast<const Elem*>(value_cache.data_ptr());
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  T* op = out.data_ptr<T>();

  // fn(position, cache slot) for positions [first, len) of request r, a block at a time: no division per position.
  auto for_each_slot = [&](int64_t r, int64_t first, int64_t len, const auto& fn) {
    for (int64_t t = first; t < len;) {
      const int64_t block = t / block_size, stop = std::min(len, (block + 1) * block_size);
      const int64_t base = int64_t(tables[r * max_blocks + block]) * block_size - block * block_size;
      for (; t < stop; ++t) fn(t, base + t);
    }
  };

  at::parallel_for(0, num_reqs * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> query(group * head_size), acc(group * head_size), rows(kChunk * head_size), scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / kv_heads, g = task % kv_heads;
      const int64_t len = lens[r], first = window > 0 ? std::max<int64_t>(0, len - window) : 0, n = len - first;
      const T* qr = qp + (r * num_heads + g * group) * head_size;
      scores.resize(group * n);
      // fn(first position, float32 rows, count) for head g's rows of `cache` at positions [first, len), kChunk
      // at a time.
      auto for_each_chunk = [&](const auto& format, const Elem* cache, const auto& fn) {
        const float* chunk[kChunk];
        int64_t count = 0, start = first;
        for_each_slot(r, first, len, [&](int64_t, int64_t at) {
          chunk[count] = format.load(cache + (at * kv_heads + g) * row_len, rows.data() + count * head_size, head_size);
          if (++count == kChunk) fn(start, chunk, count), start += count, count = 0;
        });
        if (count > 0) fn(start, chunk, count);
      };
      auto slot = [&](int64_t t) { return (int64_t)tables[r * max_blocks + t / block_size] * block_size + t % block_size; };

      bool scored = false;
      if constexpr (std::is_same_v<Format, Plain<T>>) {  // the bf16 fast path reads the model dtype only
        scored = bf16_scores(qr, kp, slot, first, len, group, head_size, kv_heads, g, static_cast<float>(scale), scores);
      }
      if (!scored) {
        for (int64_t i = 0; i < group * head_size; ++i) query[i] = static_cast<float>(qr[i]) * static_cast<float>(scale);
        for_each_chunk(keys, kp, [&](int64_t t, const float* const* k, int64_t count) {
          for (int64_t h = 0; h < group; ++h)
            dots(query.data() + h * head_size, k, count, head_size, scores.data() + h * n + t - first);
        });
      }
      for (int64_t h = 0; h < group; ++h) {
        float* s = scores.data() + h * n;
        if (soft_cap > 0) {  // Gemma 2's cap: scores become cap * tanh(scores / cap)
          const float cap = static_cast<float>(soft_cap);
          for (int64_t t = 0; t < n; ++t) s[t] = cap * std::tanh(s[t] / cap);
        }
        const float top = *std::max_element(s, s + n);
        const float sum = exp_shifted(s, n, top);
        const float inverse = 1.f / sum;
        for (int64_t t = 0; t < n; ++t) s[t] *= inverse;
      }
      bool weighed = false;
      if constexpr (std::is_same_v<Format, Plain<T>> && std::is_same_v<T, at::BFloat16>) {
        const PagedRows rows{tables + r * max_blocks, block_size, kv_heads * head_size,
                             reinterpret_cast<const fw::bf16*>(vp) + g * head_size};
        weighed = bf16_values(scores.data(), group, rows, first, len, head_size, acc.data());
      }
      if (!weighed) {
        std::fill(acc.begin(), acc.end(), 0.f);
        for_each_chunk(values, vp, [&](int64_t t, const float* const* v, int64_t count) {
          for (int64_t h = 0; h < group; ++h)
            axpys(acc.data() + h * head_size, scores.data() + h * n + t - first, v, count, head_size);
        });
      }
      T* o = op + (r * num_heads + g * group) * head_size;
      for (int64_t i = 0; i < group * head_size; ++i) o[i] = static_cast<T>(acc[i]);
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
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2, "kv_cache must be [2, blocks, block_size, kv_heads, row]");
  const auto key_cache = kv_cache.select(0, 0), value_cache = kv_cache.select(0, 1);
  const auto cache_type = key_cache.scalar_type();
  const int64_t row_len = q.size(2) + (cache_type == at::kChar ? int64_t(sizeof(float)) : 0);
  TORCH_CHECK(q.dim() == 3 && key_cache.dim() == 4 && value_cache.sizes() == key_cache.sizes(), "bad shapes");
  TORCH_CHECK(q.size(1) % key_cache.size(2) == 0 && key_cache.size(3) == row_len, "heads do not match the cache");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "the cache must be contiguous");
  TORCH_CHECK(value_cache.scalar_type() == cache_type, "the key and value caches must share a dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt, "int32 tables expected");
  TORCH_CHECK(cache_type == q.scalar_type() || cache_type == at::kFloat8_e4m3fn || cache_type == at::kChar,
              "the cache holds q's dtype, float8_e4m3fn or int8");
  auto query = q.contiguous();
  auto tables = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  auto out = at::empty_like(query);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    if (cache_type == at::kFloat8_e4m3fn) {
      decode<scalar_t>(query, key_cache, value_cache, tables, lens, scale, window, soft_cap, Fp8{float(k_scale)},
                       Fp8{float(v_scale)}, out);
    } else if (cache_type == at::kChar) {
      decode<scalar_t>(query, key_cache, value_cache, tables, lens, scale, window, soft_cap, Int8{}, Int8{}, out);
    } else {
      decode<scalar_t>(query, key_cache, value_cache, tables, lens, scale, window, soft_cap, Plain<scalar_t>{},
                       Plain<scalar_t>{}, out);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(fw_attention_torch, m) {
  m.def("paged_decode(Tensor q, Tensor kv_cache, Tensor block_tables, Tensor seq_lens, "
        "float scale, int window, float soft_cap, float k_scale, float v_scale) -> Tensor");
  m.impl("paged_decode", c10::DispatchKey::CPU, TORCH_FN(paged_decode));
}

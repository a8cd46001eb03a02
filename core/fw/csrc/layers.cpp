// bf16 and float32 CPU kernels for the decoder's elementwise layers, one pass over memory each where
// the torch path takes several. Every bf16 intermediate is rounded where the torch path rounds it, so
// the results match it (up to the order of the float sums in the norm, and float32's fused multiply-adds).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <vector>

#include "fw_cpu.h"

namespace {

using fw::bf16;
using fw::f32;
using fw::round_bf16;

inline float r(float f) { return f32(round_bf16(f)); }

// Element access for either dtype; `rnd<T>` rounds an intermediate to T, as the torch path stores it.
inline float ld(bf16 v) { return f32(v); }
inline float ld(float v) { return v; }
inline void st(bf16* p, float v) { *p = round_bf16(v); }
inline void st(float* p, float v) { *p = v; }
template <typename T>
inline float rnd(float f) {
  if constexpr (std::is_same_v<T, bf16>) return r(f);
  return f;
}
template <typename T>
constexpr bool kBf16 = std::is_same_v<T, bf16>;

#if defined(__AVX2__) && defined(__FMA__)
// Eight lanes of either dtype as float32; round8 rounds an intermediate as rnd<T> does.
template <typename T>
inline __m256 load8(const T* p) {
  if constexpr (kBf16<T>) return fw::load_bf16x8(p); else return _mm256_loadu_ps(p);
}
template <typename T>
inline __m256 round8(__m256 v) {
  if constexpr (kBf16<T>) return fw::round_bf16x8(v); else return v;
}
template <typename T>
inline void store8(T* p, __m256 v) {  // v already rounded
  if constexpr (kBf16<T>) fw::store_bf16x8(p, v); else _mm256_storeu_ps(p, v);
}
#endif

// Every tensor of one call has the dtype of the first (x): bf16 or float32, on the CPU.
void check(const at::Tensor& t, const at::Tensor& x, const char* what) {
  TORCH_CHECK((x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat) && t.device().is_cpu() &&
                  t.scalar_type() == x.scalar_type(),
              what, " must be a CPU tensor of x's dtype, bf16 or float32");
}

template <typename T>
T* ptr(const at::Tensor& t) {
  return reinterpret_cast<T*>(t.data_ptr());
}

int64_t grain(int64_t row_elems) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(row_elems, 1)); }

// out = weight * bf16(x * rsqrt(mean(x^2) + eps)) per row of x [rows, hidden]; with residual, x is
// first replaced by bf16(x + residual), which is also returned (the next layer's residual).
template <typename T>
void norm_rows(const T* x, const T* res, const T* w, T* out, T* new_res, int64_t rows, int64_t hidden, double eps) {
  at::parallel_for(0, rows, grain(hidden), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const T* xr = x + row * hidden;
      T* o = out + row * hidden;
      float sum = 0.f;
      int64_t i = 0;
      if (res != nullptr) {
        const T* rr = res + row * hidden;
        T* nr = new_res + row * hidden;
#if defined(__AVX512F__)
        if constexpr (kBf16<T>) {
        __m512 acc = _mm512_setzero_ps();
        for (; i + 16 <= hidden; i += 16) {
          const __m512 v = fw::round_bf16x16(_mm512_add_ps(fw::load_bf16x16(xr + i), fw::load_bf16x16(rr + i)));
          fw::store_bf16x16(nr + i, v);
          acc = _mm512_fmadd_ps(v, v, acc);
        }
        sum = _mm512_reduce_add_ps(acc);
        }
#endif
#if defined(__AVX2__) && defined(__FMA__)
        // The sum of squares stays in order: summed in lanes, it moved the bf16 norms, and tokens with them, off the
        // torch path's.
        const int64_t from = i;
        for (; i + 8 <= hidden; i += 8) store8(nr + i, round8<T>(_mm256_add_ps(load8(xr + i), load8(rr + i))));
        for (int64_t j = from; j < i; ++j) sum += ld(nr[j]) * ld(nr[j]);
#endif
        for (; i < hidden; ++i) {
          const float v = rnd<T>(ld(xr[i]) + ld(rr[i]));
          st(nr + i, v);
          sum += v * v;
        }
        xr = nr;
      } else {
#if defined(__AVX512F__)
        if constexpr (kBf16<T>) {
        __m512 acc = _mm512_setzero_ps();
        for (; i + 16 <= hidden; i += 16) {
          const __m512 v = fw::load_bf16x16(xr + i);
          acc = _mm512_fmadd_ps(v, v, acc);
        }
        sum = _mm512_reduce_add_ps(acc);
        }
#endif
        for (; i < hidden; ++i) sum += ld(xr[i]) * ld(xr[i]);
      }
      const float inv = 1.f / std::sqrt(sum / hidden + static_cast<float>(eps));
      i = 0;
#if defined(__AVX512F__)
      if constexpr (kBf16<T>) {
      for (; i + 16 <= hidden; i += 16) {
        const __m512 y = fw::round_bf16x16(_mm512_mul_ps(fw::load_bf16x16(xr + i), _mm512_set1_ps(inv)));
        fw::store_bf16x16(o + i, fw::round_bf16x16(_mm512_mul_ps(fw::load_bf16x16(w + i), y)));
      }
      }
#endif
#if defined(__AVX2__) && defined(__FMA__)
      for (; i + 8 <= hidden; i += 8) {
        const __m256 y = round8<T>(_mm256_mul_ps(load8(xr + i), _mm256_set1_ps(inv)));
        store8(o + i, round8<T>(_mm256_mul_ps(load8(w + i), y)));
      }
#endif
      for (; i < hidden; ++i) st(o + i, ld(w[i]) * rnd<T>(ld(xr[i]) * inv));
    }
  });
}

// x's rows normed into out (and, with residual, x + residual into new_res), in x's dtype.
void norm(const at::Tensor& x, const at::Tensor* residual, const at::Tensor& weight, double eps, at::Tensor& out,
          at::Tensor* new_res) {
  check(x, x, "x");
  check(weight, x, "weight");
  const int64_t hidden = x.size(-1), rows = x.numel() / hidden;
  if (residual != nullptr) check(*residual, x, "residual");
  auto run = [&](auto tag) {
    using T = decltype(tag);
    norm_rows(ptr<const T>(x), residual ? ptr<const T>(*residual) : nullptr, ptr<const T>(weight), ptr<T>(out),
              new_res ? ptr<T>(*new_res) : nullptr, rows, hidden, eps);
  };
  x.scalar_type() == at::kFloat ? run(float{}) : run(bf16{});
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  auto xc = x.contiguous();
  auto out = at::empty_like(xc);
  norm(xc, nullptr, weight.contiguous(), eps, out, nullptr);
  return out;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps) {
  auto xc = x.contiguous(), rc = residual.contiguous();
  auto out = at::empty_like(xc), new_res = at::empty_like(xc);
  norm(xc, &rc, weight.contiguous(), eps, out, &new_res);
  return {out, new_res};
}

// Neox rotary embedding in place: x [tokens, heads, head_size] (rows may be strided, heads packed);
// cos/sin [tokens, head_size / 2] of x's dtype. x1' = x1 c - x2 s, x2' = x2 c + x1 s, each product rounded.
template <typename T>
void rotate(at::Tensor& x, const T* cos, const T* sin) {
  const int64_t tokens = x.size(0), heads = x.size(1), head_size = x.size(2), half = head_size / 2;
  TORCH_CHECK(x.stride(2) == 1 && x.stride(1) == head_size, "rotary input must have packed heads");
  T* base = ptr<T>(x);
  const int64_t stride = x.stride(0);
  at::parallel_for(0, tokens, grain(heads * head_size), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* c = cos + t * half;
      const T* s = sin + t * half;
      for (int64_t h = 0; h < heads; ++h) {
        T* v = base + t * stride + h * head_size;
        int64_t i = 0;
#if defined(__AVX512F__)
        if constexpr (kBf16<T>)
        for (; i + 16 <= half; i += 16) {
          const __m512 x1 = fw::load_bf16x16(v + i), x2 = fw::load_bf16x16(v + i + half);
          const __m512 ci = fw::load_bf16x16(c + i), si = fw::load_bf16x16(s + i);
          const __m512 nx2 = _mm512_sub_ps(_mm512_setzero_ps(), x2);
          fw::store_bf16x16(v + i, fw::round_bf16x16(_mm512_add_ps(fw::round_bf16x16(_mm512_mul_ps(x1, ci)),
                                                                   fw::round_bf16x16(_mm512_mul_ps(nx2, si)))));
          fw::store_bf16x16(v + i + half, fw::round_bf16x16(_mm512_add_ps(fw::round_bf16x16(_mm512_mul_ps(x2, ci)),
                                                                          fw::round_bf16x16(_mm512_mul_ps(x1, si)))));
        }
#endif
#if defined(__AVX2__) && defined(__FMA__)
        for (; i + 8 <= half; i += 8) {
          const __m256 x1 = load8(v + i), x2 = load8(v + i + half), ci = load8(c + i), si = load8(s + i);
          const __m256 nx2 = _mm256_sub_ps(_mm256_setzero_ps(), x2);
          store8(v + i, round8<T>(_mm256_add_ps(round8<T>(_mm256_mul_ps(x1, ci)), round8<T>(_mm256_mul_ps(nx2, si)))));
          store8(v + i + half,
                 round8<T>(_mm256_add_ps(round8<T>(_mm256_mul_ps(x2, ci)), round8<T>(_mm256_mul_ps(x1, si)))));
        }
#endif
        for (; i < half; ++i) {
          const float x1 = ld(v[i]), x2 = ld(v[i + half]), ci = ld(c[i]), si = ld(s[i]);
          st(v + i, rnd<T>(x1 * ci) + rnd<T>(-x2 * si));
          st(v + i + half, rnd<T>(x2 * ci) + rnd<T>(x1 * si));
        }
      }
    }
  });
}

void rotary_neox(at::Tensor q, at::Tensor k, const at::Tensor& cos, const at::Tensor& sin) {
  check(q, q, "q");
  check(k, q, "k");
  check(cos, q, "cos");
  check(sin, q, "sin");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.size(-1) * 2 == q.size(2), "bad cos/sin");
  auto run = [&](auto tag) {
    using T = decltype(tag);
    rotate(q, ptr<const T>(cos), ptr<const T>(sin));
    rotate(k, ptr<const T>(cos), ptr<const T>(sin));
  };
  q.scalar_type() == at::kFloat ? run(float{}) : run(bf16{});
}

// x [rows, 2 * d] = [gate | up] -> rnd(silu(gate)) * up, [rows, d].
template <typename T>
void silu_rows(const T* in, T* o, int64_t rows, int64_t d) {
  at::parallel_for(0, rows, grain(2 * d), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const T* g = in + row * 2 * d;
      const T* u = g + d;
      T* orow = o + row * d;
      int64_t i = 0;
#if defined(__AVX512F__)
      if constexpr (kBf16<T>) {
      const __m512 one = _mm512_set1_ps(1.f);
      for (; i + 16 <= d; i += 16) {
        const __m512 gi = fw::load_bf16x16(g + i);
        const __m512 silu = fw::round_bf16x16(
            _mm512_div_ps(gi, _mm512_add_ps(one, fw::exp16(_mm512_sub_ps(_mm512_setzero_ps(), gi)))));
        fw::store_bf16x16(orow + i, fw::round_bf16x16(_mm512_mul_ps(silu, fw::load_bf16x16(u + i))));
      }
      }
#endif
#if defined(__AVX2__) && defined(__FMA__)
      for (; i + 8 <= d; i += 8) {
        const __m256 gi = load8(g + i);
        const __m256 silu = round8<T>(_mm256_div_ps(
            gi, _mm256_add_ps(_mm256_set1_ps(1.f), fw::exp8(_mm256_sub_ps(_mm256_setzero_ps(), gi)))));
        store8(orow + i, round8<T>(_mm256_mul_ps(silu, load8(u + i))));
      }
#endif
      for (; i < d; ++i) {
        const float gi = ld(g[i]);
        st(orow + i, rnd<T>(gi / (1.f + std::exp(-gi))) * ld(u[i]));
      }
    }
  });
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  check(x, x, "x");
  auto xc = x.contiguous();
  const int64_t d = xc.size(-1) / 2, rows = xc.numel() / (2 * d);
  auto sizes = xc.sizes().vec();
  sizes.back() = d;
  auto out = at::empty(sizes, xc.options());
  if (xc.scalar_type() == at::kFloat)
    silu_rows(ptr<const float>(xc), ptr<float>(out), rows, d);
  else
    silu_rows(ptr<const bf16>(xc), ptr<bf16>(out), rows, d);
  return out;
}

// cache [2, blocks, block_size, heads, head_size]: k and v [T, heads, head_size] (rows may be strided, as views
// into a fused q/k/v output) stored at slots [T] (int64) of cache[0] and cache[1]. A decode step's write is a few
// hundred bytes a layer: two index_put calls cost many times the copy.
void store_kv(at::Tensor& cache, const at::Tensor& slots, const at::Tensor& k, const at::Tensor& v) {
  TORCH_CHECK(cache.dim() == 5 && cache.size(0) == 2 && cache.is_contiguous() && cache.device().is_cpu(),
              "cache must be a contiguous CPU [2, blocks, block_size, heads, head_size] tensor");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.is_contiguous(), "slots must be int64 [T]");
  const int64_t tokens = slots.size(0), heads = cache.size(3), head_size = cache.size(4);
  const int64_t capacity = cache.size(1) * cache.size(2), elem = cache.element_size();
  for (const at::Tensor* x : {&k, &v}) {
    TORCH_CHECK(x->scalar_type() == cache.scalar_type() && x->device().is_cpu(), "k and v must have the cache's dtype");
    TORCH_CHECK(x->dim() == 3 && x->size(0) == tokens && x->size(1) == heads && x->size(2) == head_size &&
                    x->stride(2) == 1,
                "k and v must be [T, heads, head_size] with contiguous heads");
  }
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) TORCH_CHECK(slot[t] >= 0 && slot[t] < capacity, "slot out of range: ", slot[t]);
  auto* base = static_cast<char*>(cache.data_ptr());
  for (int part = 0; part < 2; ++part) {
    const at::Tensor& x = part == 0 ? k : v;
    const auto* src = static_cast<const char*>(x.data_ptr());
    char* dst = base + part * capacity * heads * head_size * elem;
    for (int64_t t = 0; t < tokens; ++t)
      for (int64_t h = 0; h < heads; ++h)
        std::memcpy(dst + (slot[t] * heads + h) * head_size * elem,
                    src + (t * x.stride(0) + h * x.stride(1)) * elem, head_size * elem);
  }
}

// Greedy sampling's argmax over float32 logits [rows, vocab]: the first index of each row's largest value, as
// torch.argmax chooses among ties, or -1 for a row holding a NaN (the caller leaves those to torch, whose NaN rule
// this does not repeat). One pass per row, rows in parallel: torch's took 0.4 ms a row over a 152k vocabulary.
void argmax_row(const float* x, int64_t V, int64_t* out) {
  int64_t v = 0, best_i = 0;
  float best = -INFINITY;
  bool nan = false;
#if defined(__AVX512F__)
  if (V >= 16) {  // per lane: its largest value and where it first appeared
    __m512 top = _mm512_set1_ps(-INFINITY);
    __m512i at = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), idx = at;
    const __m512i step = _mm512_set1_epi32(16);
    __mmask16 unordered = 0;
    for (; v + 16 <= V; v += 16) {
      const __m512 x16 = _mm512_loadu_ps(x + v);
      const __mmask16 more = _mm512_cmp_ps_mask(x16, top, _CMP_GT_OQ);
      unordered |= _mm512_cmp_ps_mask(x16, x16, _CMP_UNORD_Q);
      top = _mm512_mask_mov_ps(top, more, x16);
      at = _mm512_mask_mov_epi32(at, more, idx);
      idx = _mm512_add_epi32(idx, step);
    }
    nan = unordered != 0;
    alignas(64) float tops[16];
    alignas(64) int32_t ats[16];
    _mm512_store_ps(tops, top);
    _mm512_store_si512(ats, at);
    best = tops[0], best_i = ats[0];
    for (int l = 1; l < 16; ++l)  // the largest, and of equal ones the first index
      if (tops[l] > best || (tops[l] == best && ats[l] < best_i)) best = tops[l], best_i = ats[l];
  }
#endif
  for (; v < V; ++v) {
    nan |= x[v] != x[v];
    if (x[v] > best) best = x[v], best_i = v;
  }
  *out = nan ? -1 : best_i;
}

at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be float32 [rows, vocab]");
  TORCH_CHECK(x.size(1) > 0 && x.size(1) < (int64_t(1) << 31), "vocab size out of range");
  const auto xc = x.contiguous();
  const int64_t R = x.size(0), V = x.size(1);
  auto out = at::empty({R}, x.options().dtype(at::kLong));
  const float* xp = xc.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, R, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) argmax_row(xp + r * V, V, op + r);
  });
  return out;
}


// Temperature sampling without a pass per op: a token from softmax(logits / t) per row, drawn by inverting the
// cumulative sum at u * total for a uniform u in [0, 1) the caller draws (one a row, from the request's own
// generator where it is seeded, so that its tokens do not depend on the batch). At 32 rows of a 152k vocabulary
// the torch ops (division, softmax, a uniform per token, two logs, argmax) took 46 ms a step, more than the LM head;
// this takes one pass for the largest logit and one for the exponentials, whose sums it keeps per block of
// kSampleBlock, and then recomputes only the block that holds u * total. A row holding a NaN, or no finite logit,
// gives -1 (the caller leaves it to torch).
constexpr int64_t kSampleBlock = 1024;

// exp((x[i] - shift) * scale) for i in [0, n): into e where e is not null; returns their sum. A logit of -inf (a
// masked token) gives exactly 0.
float exp_block(const float* x, int64_t n, float shift, float scale, float* e) {
  int64_t i = 0;
  float total = 0.f;
#if defined(__AVX512F__)
  {
    const __m512 sh = _mm512_set1_ps(shift), sc = _mm512_set1_ps(scale), masked = _mm512_set1_ps(-INFINITY);
    __m512 acc = _mm512_setzero_ps();
    for (; i + 16 <= n; i += 16) {
      const __m512 v = _mm512_loadu_ps(x + i);
      const __m512 p = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(v, masked, _CMP_GT_OQ),
                                           fw::exp16(_mm512_mul_ps(_mm512_sub_ps(v, sh), sc)));
      if (e) _mm512_storeu_ps(e + i, p);
      acc = _mm512_add_ps(acc, p);
    }
    total = _mm512_reduce_add_ps(acc);
  }
#elif defined(__AVX2__) && defined(__FMA__)
  {
    const __m256 sh = _mm256_set1_ps(shift), sc = _mm256_set1_ps(scale), masked = _mm256_set1_ps(-INFINITY);
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
      const __m256 v = _mm256_loadu_ps(x + i);
      const __m256 p = _mm256_and_ps(_mm256_cmp_ps(v, masked, _CMP_GT_OQ),
                                     fw::exp8(_mm256_mul_ps(_mm256_sub_ps(v, sh), sc)));
      if (e) _mm256_storeu_ps(e + i, p);
      acc = _mm256_add_ps(acc, p);
    }
    total = fw::sum8(acc);
  }
#endif
  for (; i < n; ++i) {
    const float p = x[i] > -INFINITY ? std::exp((x[i] - shift) * scale) : 0.f;
    if (e) e[i] = p;
    total += p;
  }
  return total;
}

// The largest of a row's V logits; NaN where the row holds one.
float row_max(const float* x, int64_t V) {
  float top = -INFINITY;
  bool nan = false;
  int64_t i = 0;
#if defined(__AVX512F__)
  {
    __m512 top16 = _mm512_set1_ps(-INFINITY);
    __mmask16 unordered = 0;
    for (; i + 16 <= V; i += 16) {
      const __m512 v = _mm512_loadu_ps(x + i);
      unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      top16 = _mm512_max_ps(top16, v);
    }
    nan = unordered != 0;
    top = _mm512_reduce_max_ps(top16);
  }
#endif
  for (; i < V; ++i) {
    nan |= x[i] != x[i];
    top = std::max(top, x[i]);
  }
  return nan ? NAN : top;
}

int64_t sample_row(const float* x, int64_t V, float temperature, double u) {
  const float top = row_max(x, V);
  if (!(top > -INFINITY)) return -1;  // NaN, or every token masked
  const float scale = 1.f / temperature;
  const int64_t blocks = (V + kSampleBlock - 1) / kSampleBlock;
  thread_local std::vector<float> sums, e;
  sums.resize(blocks);
  e.resize(kSampleBlock);
  double total = 0;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t first = b * kSampleBlock;
    sums[b] = exp_block(x + first, std::min(kSampleBlock, V - first), top, scale, nullptr);
    total += sums[b];
  }
  const double target = u * total;
  // The block where the cumulative sum passes the target; rounding may leave it unpassed, then the last block with
  // any mass (and in a block, its last token with any).
  double before = 0;
  int64_t b = 0, last = 0;
  for (; b < blocks; ++b) {
    if (sums[b] > 0) last = b;
    if (before + sums[b] > target) break;
    before += sums[b];
  }
  if (b == blocks) {  // walk the last block with mass to its end
    b = last;
    before -= sums[b];
  }
  const int64_t first = b * kSampleBlock, n = std::min(kSampleBlock, V - first);
  exp_block(x + first, n, top, scale, e.data());
  int64_t chosen = -1;
  for (int64_t i = 0; i < n; ++i) {
    if (e[i] <= 0) continue;
    chosen = first + i;
    before += e[i];
    if (before > target) break;
  }
  return chosen;
}

// log(sum exp(x / t)) of each row: top-p's normalizer over the whole vocabulary, where torch's logsumexp took 21 ms at
// 32 rows of 152k (several passes and temporaries). NaN for a row holding one, -inf for one with every token masked.
at::Tensor log_normalizers(const at::Tensor& logits, const at::Tensor& temperature) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat, "logits must be float32 [rows, vocab]");
  const int64_t R = logits.size(0), V = logits.size(1);
  TORCH_CHECK(temperature.scalar_type() == at::kFloat && temperature.numel() == R, "temperature must be float32 [rows]");
  const auto xc = logits.contiguous(), tc = temperature.contiguous();
  auto out = at::empty({R}, logits.options());
  const float* xp = xc.data_ptr<float>();
  const float* tp = tc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, R, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float top = row_max(xp + r * V, V), scale = 1.f / tp[r];
      op[r] = top > -INFINITY ? top * scale + std::log(exp_block(xp + r * V, V, top, scale, nullptr)) : top;
    }
  });
  return out;
}

at::Tensor sample_rows(const at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& uniforms) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat, "logits must be float32 [rows, vocab]");
  const int64_t R = logits.size(0), V = logits.size(1);
  TORCH_CHECK(V > 0 && V < (int64_t(1) << 31), "vocab size out of range");
  TORCH_CHECK(temperature.scalar_type() == at::kFloat && temperature.numel() == R, "temperature must be float32 [rows]");
  TORCH_CHECK(uniforms.scalar_type() == at::kDouble && uniforms.numel() == R, "uniforms must be float64 [rows]");
  const auto xc = logits.contiguous(), tc = temperature.contiguous(), uc = uniforms.contiguous();
  auto out = at::empty({R}, logits.options().dtype(at::kLong));
  const float* xp = xc.data_ptr<float>();
  const float* tp = tc.data_ptr<float>();
  const double* up = uc.data_ptr<double>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, R, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) op[r] = sample_row(xp + r * V, V, tp[r], up[r]);
  });
  return out;
}

// Writes back and drops every cache line of the tensors' storage, on every level: kernel choice times a candidate
// on weights in memory, as a decode step meets them (a model's weights outgrow the caches between two uses), not
// on the copy its previous call left in L2. Warm, an AMX Xeon chose kernels 1.3-1.6x slower on the weights streamed.
// oneDNN's prepacked weights (opaque tensors, no storage) are found through oneDNN's own ops.
void evict(const std::vector<at::Tensor>& tensors) {
#if defined(__x86_64__) || defined(_M_X64)
  for (const auto& t : tensors) {
    if (!t.defined() || !t.device().is_cpu() || t.is_sparse()) continue;
    char* p = nullptr;
    int64_t bytes = 0;
    if (t.is_mkldnn()) {
      static const auto data_ptr = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::data_ptr", "")
                                       .typed<int64_t(const at::Tensor&)>();
      static const auto nbytes = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_nbytes", "")
                                     .typed<int64_t(const at::Tensor&)>();
      p = reinterpret_cast<char*>(data_ptr.call(t));
      bytes = nbytes.call(t);
    } else if (t.has_storage()) {
      p = static_cast<char*>(const_cast<void*>(t.storage().data()));
      bytes = static_cast<int64_t>(t.storage().nbytes());
    }
    if (p == nullptr) continue;
    at::parallel_for(0, (bytes + 63) / 64, 4096, [&](int64_t begin, int64_t end) {
      for (int64_t line = begin; line < end; ++line) {
#if defined(__CLFLUSHOPT__)
        _mm_clflushopt(p + line * 64);
#else
        _mm_clflush(p + line * 64);
#endif
      }
      _mm_sfence();
    });
  }
#endif
}

}  // namespace

TORCH_LIBRARY(fw_layers, m) {
  m.def("evict(Tensor[] tensors) -> ()", TORCH_FN(evict));
  m.def("store_kv(Tensor(a!) cache, Tensor slots, Tensor k, Tensor v) -> ()");
  m.impl("store_kv", c10::DispatchKey::CPU, TORCH_FN(store_kv));
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("rotary_neox(Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin) -> ()");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("argmax_rows(Tensor x) -> Tensor");
  m.def("sample_rows(Tensor logits, Tensor temperature, Tensor uniforms) -> Tensor");
  m.impl("sample_rows", c10::DispatchKey::CPU, TORCH_FN(sample_rows));
  m.def("log_normalizers(Tensor logits, Tensor temperature) -> Tensor");
  m.impl("log_normalizers", c10::DispatchKey::CPU, TORCH_FN(log_normalizers));
  m.impl("argmax_rows", c10::DispatchKey::CPU, TORCH_FN(argmax_rows));
  m.impl("rms_norm", c10::DispatchKey::CPU, TORCH_FN(rms_norm));
  m.impl("add_rms_norm", c10::DispatchKey::CPU, TORCH_FN(add_rms_norm));
  m.impl("rotary_neox", c10::DispatchKey::CPU, TORCH_FN(rotary_neox));
  m.impl("silu_and_mul", c10::DispatchKey::CPU, TORCH_FN(silu_and_mul));
}

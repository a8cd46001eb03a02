// bf16 CPU kernels for the decoder's elementwise layers, one pass over memory each where the torch
// path takes several. Every intermediate is rounded to bf16 where the torch path rounds it, so the
// results match it (up to the order of the float sums in the norm).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <tuple>

#include "fw_cpu.h"

namespace {

using fw::bf16;
using fw::f32;
using fw::round_bf16;

inline float r(float f) { return f32(round_bf16(f)); }

void check(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kBFloat16 && t.device().is_cpu(), what, " must be a bf16 CPU tensor");
}

int64_t grain(int64_t row_elems) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(row_elems, 1)); }

// out = weight * bf16(x * rsqrt(mean(x^2) + eps)) per row of x [rows, hidden]; with residual, x is
// first replaced by bf16(x + residual), which is also returned (the next layer's residual).
void norm_rows(const bf16* x, const bf16* res, const bf16* w, bf16* out, bf16* new_res, int64_t rows, int64_t hidden,
               double eps) {
  at::parallel_for(0, rows, grain(hidden), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const bf16* xr = x + row * hidden;
      bf16* o = out + row * hidden;
      float sum = 0.f;
      int64_t i = 0;
      if (res != nullptr) {
        const bf16* rr = res + row * hidden;
        bf16* nr = new_res + row * hidden;
#if defined(__AVX512F__)
        __m512 acc = _mm512_setzero_ps();
        for (; i + 16 <= hidden; i += 16) {
          const __m512 v = fw::round_bf16x16(_mm512_add_ps(fw::load_bf16x16(xr + i), fw::load_bf16x16(rr + i)));
          fw::store_bf16x16(nr + i, v);
          acc = _mm512_fmadd_ps(v, v, acc);
        }
        sum = _mm512_reduce_add_ps(acc);
#endif
        for (; i < hidden; ++i) {
          const float v = r(f32(xr[i]) + f32(rr[i]));
          nr[i] = round_bf16(v);
          sum += v * v;
        }
        xr = nr;
      } else {
#if defined(__AVX512F__)
        __m512 acc = _mm512_setzero_ps();
        for (; i + 16 <= hidden; i += 16) {
          const __m512 v = fw::load_bf16x16(xr + i);
          acc = _mm512_fmadd_ps(v, v, acc);
        }
        sum = _mm512_reduce_add_ps(acc);
#endif
        for (; i < hidden; ++i) sum += f32(xr[i]) * f32(xr[i]);
      }
      const float inv = 1.f / std::sqrt(sum / hidden + static_cast<float>(eps));
      i = 0;
#if defined(__AVX512F__)
      for (; i + 16 <= hidden; i += 16) {
        const __m512 y = fw::round_bf16x16(_mm512_mul_ps(fw::load_bf16x16(xr + i), _mm512_set1_ps(inv)));
        fw::store_bf16x16(o + i, fw::round_bf16x16(_mm512_mul_ps(fw::load_bf16x16(w + i), y)));
      }
#endif
      for (; i < hidden; ++i) o[i] = round_bf16(f32(w[i]) * r(f32(xr[i]) * inv));
    }
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check(x, "x");
  check(weight, "weight");
  auto xc = x.contiguous();
  auto out = at::empty_like(xc);
  const int64_t hidden = x.size(-1);
  norm_rows(reinterpret_cast<const bf16*>(xc.data_ptr()), nullptr, reinterpret_cast<const bf16*>(weight.data_ptr()),
            reinterpret_cast<bf16*>(out.data_ptr()), nullptr, xc.numel() / hidden, hidden, eps);
  return out;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps) {
  check(x, "x");
  check(residual, "residual");
  check(weight, "weight");
  auto xc = x.contiguous(), rc = residual.contiguous();
  auto out = at::empty_like(xc), new_res = at::empty_like(xc);
  const int64_t hidden = x.size(-1);
  norm_rows(reinterpret_cast<const bf16*>(xc.data_ptr()), reinterpret_cast<const bf16*>(rc.data_ptr()),
            reinterpret_cast<const bf16*>(weight.data_ptr()), reinterpret_cast<bf16*>(out.data_ptr()),
            reinterpret_cast<bf16*>(new_res.data_ptr()), xc.numel() / hidden, hidden, eps);
  return {out, new_res};
}

// Neox rotary embedding in place: x [tokens, heads, head_size] (rows may be strided, heads packed);
// cos/sin [tokens, head_size / 2] bf16. x1' = x1 c - x2 s, x2' = x2 c + x1 s, each product rounded.
void rotate(at::Tensor& x, const bf16* cos, const bf16* sin) {
  const int64_t tokens = x.size(0), heads = x.size(1), head_size = x.size(2), half = head_size / 2;
  TORCH_CHECK(x.stride(2) == 1 && x.stride(1) == head_size, "rotary input must have packed heads");
  bf16* base = reinterpret_cast<bf16*>(x.data_ptr());
  const int64_t stride = x.stride(0);
  at::parallel_for(0, tokens, grain(heads * head_size), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const bf16* c = cos + t * half;
      const bf16* s = sin + t * half;
      for (int64_t h = 0; h < heads; ++h) {
        bf16* v = base + t * stride + h * head_size;
        int64_t i = 0;
#if defined(__AVX512F__)
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
        for (; i < half; ++i) {
          const float x1 = f32(v[i]), x2 = f32(v[i + half]), ci = f32(c[i]), si = f32(s[i]);
          v[i] = round_bf16(r(x1 * ci) + r(-x2 * si));
          v[i + half] = round_bf16(r(x2 * ci) + r(x1 * si));
        }
      }
    }
  });
}

void rotary_neox(at::Tensor q, at::Tensor k, const at::Tensor& cos, const at::Tensor& sin) {
  check(q, "q");
  check(k, "k");
  check(cos, "cos");
  check(sin, "sin");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.size(-1) * 2 == q.size(2), "bad cos/sin");
  rotate(q, reinterpret_cast<const bf16*>(cos.data_ptr()), reinterpret_cast<const bf16*>(sin.data_ptr()));
  rotate(k, reinterpret_cast<const bf16*>(cos.data_ptr()), reinterpret_cast<const bf16*>(sin.data_ptr()));
}

// x [rows, 2 * d] = [gate | up] -> bf16(silu(gate)) * up, [rows, d].
at::Tensor silu_and_mul(const at::Tensor& x) {
  check(x, "x");
  auto xc = x.contiguous();
  const int64_t d = xc.size(-1) / 2, rows = xc.numel() / (2 * d);
  auto sizes = xc.sizes().vec();
  sizes.back() = d;
  auto out = at::empty(sizes, xc.options());
  const bf16* in = reinterpret_cast<const bf16*>(xc.data_ptr());
  bf16* o = reinterpret_cast<bf16*>(out.data_ptr());
  at::parallel_for(0, rows, grain(2 * d), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const bf16* g = in + row * 2 * d;
      const bf16* u = g + d;
      bf16* orow = o + row * d;
      int64_t i = 0;
#if defined(__AVX512F__)
      const __m512 one = _mm512_set1_ps(1.f);
      for (; i + 16 <= d; i += 16) {
        const __m512 gi = fw::load_bf16x16(g + i);
        const __m512 silu = fw::round_bf16x16(
            _mm512_div_ps(gi, _mm512_add_ps(one, fw::exp16(_mm512_sub_ps(_mm512_setzero_ps(), gi)))));
        fw::store_bf16x16(orow + i, fw::round_bf16x16(_mm512_mul_ps(silu, fw::load_bf16x16(u + i))));
      }
#endif
      for (; i < d; ++i) {
        const float gi = f32(g[i]);
        orow[i] = round_bf16(r(gi / (1.f + std::exp(-gi))) * f32(u[i]));
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(fw_layers, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("rotary_neox(Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin) -> ()");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.impl("rms_norm", c10::DispatchKey::CPU, TORCH_FN(rms_norm));
  m.impl("add_rms_norm", c10::DispatchKey::CPU, TORCH_FN(add_rms_norm));
  m.impl("rotary_neox", c10::DispatchKey::CPU, TORCH_FN(rotary_neox));
  m.impl("silu_and_mul", c10::DispatchKey::CPU, TORCH_FN(silu_and_mul));
}

// The small per-layer ops of a decoder step, fused: one call where torch dispatches five to ten.
// At batch 1 a 12-layer step spent ~5 ms of ~23 ms in ~450 small torch ops (5-50 us each);
// these cut that to a few calls per layer. Each matches its torch composition in
// engine/model/layers.py / engine/model/rope.py within float rounding (tests/kernels/test_cpu_kernels.py).
//   add_rms_norm_   residual += x; x = rms_norm(residual) * weight      (both in place)
//   rms_norm        rms_norm(x) * weight, the same formula without the residual (a stage's first
//                   norm, the final norm)
//   rotary_         q/k heads of a fused qkv row rotated by their position (in place)
//   silu_mul        silu(gate) * up of a fused [gate | up] row

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <type_traits>

#include "vec.h"

namespace {

using pdserve::dispatch_dtype;
using pdserve::exp8;
using pdserve::hsum;
using pdserve::load8;
using pdserve::round8;
using pdserve::store8;
using pdserve::v8f;

// Whether the 16-lane AVX-512 loops serve scalar_t (fp32 and bf16 where the CPU has AVX512-BF16;
// fp16 and other CPUs take the 8-lane loops only).
template <typename scalar_t>
constexpr bool kVec16 = PDSERVE_VEC_BF16 && !std::is_same_v<scalar_t, c10::Half>;

// Rows per parallel task: enough work to be worth a thread hand-off.
int64_t grain(int64_t row_elems) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(row_elems, 1)); }

}  // namespace

namespace {

// One row of RMSNorm in the engine's formula (engine/model/layers.py RMSNorm): the sum of
// squares in fp32, accumulated per lane (its order differs from torch's by float rounding
// only); fp32 models weight * (x * inv) as F.rms_norm, reduced precision normalised in fp32,
// rounded, then scaled. kAdd: residual `rr` += x first (rounded as torch's add) and the sum is
// what is normalised, into `xr`; else `xr` is normalised into `out`.
template <bool kAdd, typename scalar_t, typename Tag>
inline void norm_row(Tag tag, scalar_t* xr, scalar_t* rr, const scalar_t* wp, scalar_t* out, int64_t h, double eps) {
  const scalar_t* src = kAdd ? rr : xr;
  scalar_t* dst = kAdd ? xr : out;
  const int64_t h8 = h - h % 8;
  v8f sq8{};
  int64_t i16 = 0;
#if PDSERVE_VEC_BF16
  if constexpr (kVec16<scalar_t>) {
    __m512 sq16 = _mm512_setzero_ps();
    for (; i16 + 16 <= h; i16 += 16) {
      __m512 v;
      if constexpr (kAdd) {
        v = pdserve::round16(tag, _mm512_add_ps(pdserve::load16(xr + i16), pdserve::load16(rr + i16)));
        pdserve::store16(rr + i16, v);
      } else {
        v = pdserve::load16(xr + i16);
      }
      sq16 = _mm512_fmadd_ps(v, v, sq16);
    }
    sq8[0] = _mm512_reduce_add_ps(sq16);
  }
#endif
  for (int64_t i = i16; i < h8; i += 8) {
    v8f v;
    if constexpr (kAdd) {
      v = round8(tag, load8(xr + i) + load8(rr + i));
      store8(rr + i, v);
    } else {
      v = load8(xr + i);
    }
    sq8 += v * v;
  }
  float sq = hsum(sq8);
  for (int64_t i = h8; i < h; ++i) {
    if constexpr (kAdd) rr[i] = static_cast<scalar_t>(static_cast<float>(xr[i]) + static_cast<float>(rr[i]));
    sq += static_cast<float>(src[i]) * static_cast<float>(src[i]);
  }
  const float inv = 1.f / std::sqrt(sq / static_cast<float>(h) + static_cast<float>(eps));
  int64_t j16 = 0;
#if PDSERVE_VEC_BF16
  if constexpr (kVec16<scalar_t>) {
    const __m512 inv16 = _mm512_set1_ps(inv);
    for (; j16 + 16 <= h; j16 += 16)
      pdserve::store16(dst + j16, _mm512_mul_ps(pdserve::load16(wp + j16),
                                                pdserve::round16(tag, _mm512_mul_ps(pdserve::load16(src + j16), inv16))));
  }
#endif
  for (int64_t i = j16; i < h8; i += 8) store8(dst + i, load8(wp + i) * round8(tag, load8(src + i) * inv));
  for (int64_t i = h8; i < h; ++i) {
    const scalar_t normed = static_cast<scalar_t>(static_cast<float>(src[i]) * inv);
    dst[i] = static_cast<scalar_t>(static_cast<float>(wp[i]) * static_cast<float>(normed));
  }
}

void check_norm_args(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && weight.dim() == 1 && weight.size(0) == x.size(1),
              "rms norms take a contiguous x [T, H] and weight [H]");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "x and weight must share a dtype");
}

// norm_row over every row of x [T, H]: with the residual (kAdd) in place, else into `out`.
template <bool kAdd>
void norm_rows(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight, double eps,
               const at::Tensor& out, const char* name) {
  const int64_t rows = x.size(0), h = x.size(1);
  dispatch_dtype(x.scalar_type(), name, [&](auto tag) {
    using scalar_t = decltype(tag);
    scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* rp = kAdd ? residual.data_ptr<scalar_t>() : nullptr;
    scalar_t* op = kAdd ? nullptr : out.data_ptr<scalar_t>();
    const at::Tensor wc = weight.contiguous();
    const scalar_t* wp = wc.data_ptr<scalar_t>();
    at::parallel_for(0, rows, grain(h), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t)
        norm_row<kAdd, scalar_t>(tag, xp + t * h, kAdd ? rp + t * h : nullptr, wp, kAdd ? nullptr : op + t * h, h, eps);
    });
  });
}

}  // namespace

void add_rms_norm_(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps) {
  check_norm_args(x, weight);
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.is_contiguous() && residual.scalar_type() == x.scalar_type(),
              "add_rms_norm_: residual must be a contiguous [T, H] of x's dtype");
  norm_rows<true>(x, residual, weight, eps, at::Tensor(), "add_rms_norm_");
}

at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps) {
  check_norm_args(x, weight);
  at::Tensor out = at::empty_like(x);
  norm_rows<false>(x, at::Tensor(), weight, eps, out, "rms_norm");
  return out;
}

void rotary_(at::Tensor qkv, at::Tensor positions, at::Tensor cos, at::Tensor sin, int64_t num_rotated_heads) {
  TORCH_CHECK(qkv.dim() == 3 && qkv.is_contiguous(), "qkv must be a contiguous [T, heads, head_dim]");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.size(0) == qkv.size(0), "positions must be int64 [T]");
  TORCH_CHECK(cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(1) == qkv.size(2) &&
                  cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat,
              "cos and sin must be float32 [max_positions, head_dim]");
  TORCH_CHECK(num_rotated_heads <= qkv.size(1) && qkv.size(2) % 2 == 0, "bad rotated head count or odd head_dim");
  const int64_t tokens = qkv.size(0), heads = qkv.size(1), d = qkv.size(2), half = d / 2;
  const at::Tensor pos = positions.contiguous(), cc = cos.contiguous(), sc = sin.contiguous();
  const int64_t* pp = pos.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(pp[t] >= 0 && pp[t] < cc.size(0), "position ", pp[t], " is outside the rotary table");
  dispatch_dtype(qkv.scalar_type(), "rotary_", [&](auto tag) {
    using scalar_t = decltype(tag);
    scalar_t* base = qkv.data_ptr<scalar_t>();
    const float* cp = cc.data_ptr<float>();
    const float* sp = sc.data_ptr<float>();
    at::parallel_for(0, tokens, grain(num_rotated_heads * d), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        // The tables are cat(freqs, freqs): the first half's cos/sin serve both halves. They
        // are rounded to the model dtype first, as RotaryEmbedding.lookup does.
        const float* c = cp + pp[t] * d;
        const float* s = sp + pp[t] * d;
        for (int64_t hh = 0; hh < num_rotated_heads; ++hh) {
          scalar_t* x = base + (t * heads + hh) * d;
          for (int64_t i = 0; i < half; ++i) {
            const float ci = static_cast<float>(static_cast<scalar_t>(c[i]));
            const float si = static_cast<float>(static_cast<scalar_t>(s[i]));
            const float x1 = static_cast<float>(x[i]), x2 = static_cast<float>(x[i + half]);
            x[i] = static_cast<scalar_t>(x1 * ci - x2 * si);
            x[i + half] = static_cast<scalar_t>(x2 * ci + x1 * si);
          }
        }
      }
    });
  });
}

at::Tensor silu_mul(at::Tensor gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "silu_mul takes [T, 2 * I]");
  const at::Tensor in = gate_up.contiguous();
  const int64_t tokens = in.size(0), width = in.size(1) / 2;
  at::Tensor out = at::empty({tokens, width}, in.options());
  dispatch_dtype(in.scalar_type(), "silu_mul", [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* ip = in.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, tokens, grain(2 * width), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const scalar_t* g = ip + t * 2 * width;
        const scalar_t* u = g + width;
        scalar_t* o = op + t * width;
        int64_t i = 0;
#if PDSERVE_VEC_BF16
        if constexpr (kVec16<scalar_t>) {
          const __m512 one = _mm512_set1_ps(1.f);
          for (; i + 16 <= width; i += 16) {
            const __m512 x = pdserve::load16(g + i);
            const __m512 e = pdserve::exp16(_mm512_sub_ps(_mm512_setzero_ps(), x));
            const __m512 act = pdserve::round16(tag, _mm512_div_ps(x, _mm512_add_ps(one, e)));
            pdserve::store16(o + i, _mm512_mul_ps(act, pdserve::load16(u + i)));
          }
        }
#endif
        for (; i + 8 <= width; i += 8) {
          const v8f x = load8(g + i);
          const v8f act = round8(tag, x / (1.f + exp8(-x)));  // F.silu, rounded to the dtype
          store8(o + i, act * load8(u + i));
        }
        for (; i < width; ++i) {
          const float x = static_cast<float>(g[i]);
          const scalar_t act = static_cast<scalar_t>(x / (1.f + std::exp(-x)));
          o[i] = static_cast<scalar_t>(static_cast<float>(act) * static_cast<float>(u[i]));
        }
      }
    });
  });
  return out;
}

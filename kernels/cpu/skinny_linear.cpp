// y = x W^T (+ b) for the few-row activations of decode steps (M up to ~16): a weight-streaming
// GEMV/GEMM for the case BLAS handles worst on CPUs. Measured on an AVX2 Zen 3 core pair, MKL
// moved 9-14 GB/s of weights at M = 1 (of ~25 GB/s the memory gives) and 6 GB/s at M = 16.
//
// Each thread takes a contiguous run of output features (weight rows), so it streams its part of
// W once, front to back. A tile is 4 weight rows x up to 2 activation rows: 8 fp32 vector
// accumulators that stay in registers; the 4 weight rows stay in L1/L2 while every pair of
// activation rows passes over them. Kept exact to F.linear within float rounding.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>

#include "vec.h"

namespace {

using pdserve::hsum;
using pdserve::load8;
using pdserve::v8f;

// Output rows [n0, n0 + NR) for activation rows [m0, m0 + MR); K is a multiple of 8. With
// `next` set, the next tile's weight rows are prefetched as this pass walks K, so the first
// pass over a tile finds them in cache instead of waiting on DRAM with the FMA units idle.
template <typename scalar_t, int NR, int MR>
inline void tile(const float* x, int64_t ldx, const scalar_t* w, int64_t k, float* y, int64_t ldy, int64_t n0,
                 int64_t m0, const scalar_t* next) {
  v8f acc[MR][NR] = {};
  const scalar_t* wr[NR];
  for (int r = 0; r < NR; ++r) wr[r] = w + (n0 + r) * k;
  constexpr int64_t kLine = 64 / sizeof(scalar_t);  // elements per cache line
  for (int64_t c = 0; c < k; c += 8) {
    if (next != nullptr && c % kLine == 0)
      for (int r = 0; r < NR; ++r) __builtin_prefetch(next + r * k + c);
    v8f wv[NR];
    for (int r = 0; r < NR; ++r) wv[r] = load8(wr[r] + c);
    for (int i = 0; i < MR; ++i) {
      const v8f xv = load8(x + (m0 + i) * ldx + c);
      for (int r = 0; r < NR; ++r) acc[i][r] += xv * wv[r];
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int r = 0; r < NR; ++r) y[(m0 + i) * ldy + n0 + r] = hsum(acc[i][r]);
}

template <typename scalar_t, int NR>
inline void rows(const float* x, int64_t m, const scalar_t* w, int64_t k, float* y, int64_t n, int64_t n0,
                 bool prefetch_next) {
  // The first pass prefetches the next tile (n0 + NR), if this thread will take it.
  const scalar_t* next = prefetch_next ? w + (n0 + NR) * k : nullptr;
  int64_t m0 = 0;
  for (; m0 + 2 <= m; m0 += 2, next = nullptr) tile<scalar_t, NR, 2>(x, k, w, k, y, n, n0, m0, next);
  if (m0 < m) tile<scalar_t, NR, 1>(x, k, w, k, y, n, n0, m0, next);
}

}  // namespace

at::Tensor skinny_linear(at::Tensor x, at::Tensor weight, c10::optional<at::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "skinny_linear takes x [M, K] and weight [N, K]");
  TORCH_CHECK(weight.size(1) % 8 == 0, "K must be a multiple of 8");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "x and weight must share a dtype");
  weight = weight.contiguous();
  const int64_t m = x.size(0), k = x.size(1), n = weight.size(0);
  // Activations are few: widen them to fp32 once, then every tile reads fp32 rows.
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor yf = at::empty({m, n}, x.options().dtype(at::kFloat));
  const float* xp = xf.data_ptr<float>();
  float* yp = yf.data_ptr<float>();
  pdserve::dispatch_dtype(weight.scalar_type(), "skinny_linear", [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* w = weight.data_ptr<scalar_t>();
    const int64_t tiles = n / 4;
    // A grain of 16 tiles (64 rows) keeps a thread's run of W long enough to stream.
    at::parallel_for(0, tiles, 16, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) rows<scalar_t, 4>(xp, m, w, k, yp, n, 4 * t, t + 1 < end);
    });
    for (int64_t r = 4 * tiles; r < n; ++r) rows<scalar_t, 1>(xp, m, w, k, yp, n, r, false);
  });
  if (bias.has_value() && bias->defined()) yf.add_(bias->to(at::kFloat));
  return x.scalar_type() == at::kFloat ? yf : yf.to(x.scalar_type());
}

// y = x W^T (+ b) for a few bf16 activation rows, reading the weight in the blocked layout oneDNN
// packed it into at load (kernels/packed_linear.py), so decode steps of 1-4 sequences stream
// the weights at memory speed without a second, plain copy of them.
//
// Why: oneDNN's own kernel for such skinny products moved 21-24 GB/s of packed weights on a
// 2-core Sapphire Rapids where a streaming read gets ~28 GB/s and this loop gets 28-33; at batch
// 1 a decode step is ~80% weight streaming.
//
// The layouts, for weight [N, K]: blocks of NB output rows (outer), each split into tiles of KB
// inputs, each tile [KB/2 input pairs][NB outputs][2 inputs of the pair]. oneDNN picks NB = 32,
// KB = 32 on AMX CPUs (`AB16b32a2b`) and NB = 64, KB = K (one tile per block) with AVX512-BF16
// alone (Zen 4/5). A 64-byte line holds 16 outputs x one input pair, which VDPBF16PS multiplies
// by a broadcast pair of x and adds into 16 fp32 lanes, so no horizontal sum is ever needed.
// kernels/packed_linear.py checks, per weight, which layout oneDNN chose (a probe product
// against F.linear) before this kernel is used; other layouts keep oneDNN.
// Needs AVX512-BF16; elsewhere `packed_gemv_supported()` is false.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <type_traits>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

constexpr int kMaxRows = 8;

#if defined(__AVX512BF16__)
// Output block `ob` (NB outputs) for M rows of x (each K bf16, `ldx` apart): fp32 into y.
template <int M, int NB>
inline void block(const uint16_t* w, const uint16_t* x, int64_t ldx, int64_t k, int64_t kb_size, int64_t ob,
                  float* y, int64_t ldy) {
  constexpr int NV = NB / 16;  // 16 outputs per vector
  __m512 acc[M][NV];
  for (int m = 0; m < M; ++m)
    for (int v = 0; v < NV; ++v) acc[m][v] = _mm512_setzero_ps();
  const uint16_t* tile = w + ob * k * NB;  // the output block's K / KB tiles, one after another
  for (int64_t kb = 0; kb < k; kb += kb_size, tile += kb_size * NB) {
    for (int64_t j = 0; j < kb_size / 2; ++j) {  // input pair kb + 2j, kb + 2j + 1
      __m512bh wv[NV];
      for (int v = 0; v < NV; ++v) wv[v] = (__m512bh)_mm512_loadu_si512(tile + j * 2 * NB + 32 * v);
      for (int m = 0; m < M; ++m) {
        uint32_t pair;
        __builtin_memcpy(&pair, x + m * ldx + kb + 2 * j, sizeof(pair));
        const __m512bh xp = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
        for (int v = 0; v < NV; ++v) acc[m][v] = _mm512_dpbf16_ps(acc[m][v], wv[v], xp);
      }
    }
  }
  for (int m = 0; m < M; ++m)
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(y + m * ldy + ob * NB + 16 * v, acc[m][v]);
}

template <int M, int NB>
void run(const uint16_t* w, const uint16_t* x, int64_t ldx, int64_t k, int64_t kb_size, int64_t n, float* y) {
  // A grain of 128 outputs: each thread streams its run of W front to back.
  at::parallel_for(0, n / NB, std::max(1, 128 / NB), [&](int64_t begin, int64_t end) {
    for (int64_t ob = begin; ob < end; ++ob) block<M, NB>(w, x, ldx, k, kb_size, ob, y, n);
  });
}
#endif

}  // namespace

bool packed_gemv_supported() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

at::Tensor packed_gemv(at::Tensor x, at::Tensor blocked, int64_t n, c10::optional<at::Tensor> bias, int64_t block_n,
                       int64_t block_k) {
  TORCH_CHECK(packed_gemv_supported(), "packed_gemv needs a CPU with AVX512-BF16");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && blocked.scalar_type() == at::kBFloat16,
              "packed_gemv takes bf16 x [M, K] and a bf16 blocked weight");
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(m >= 1 && m <= kMaxRows, "packed_gemv serves 1 to ", kMaxRows, " rows, got ", m);
  TORCH_CHECK(block_n == 32 || block_n == 64, "packed_gemv reads blocks of 32 or 64 outputs, got ", block_n);
  TORCH_CHECK(block_k > 0 && block_k % 2 == 0 && k % block_k == 0, "block_k must be even and divide K");
  TORCH_CHECK(n % block_n == 0 && blocked.numel() == n * k && blocked.is_contiguous(),
              "the blocked weight must hold N x K elements, N a multiple of the block");
  if (x.stride(1) != 1) x = x.contiguous();
  at::Tensor y = at::empty({m, n}, x.options().dtype(at::kFloat));
#if defined(__AVX512BF16__)
  const auto* w = reinterpret_cast<const uint16_t*>(blocked.data_ptr<at::BFloat16>());
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  float* yp = y.data_ptr<float>();
  auto rows = [&](auto nb) {
    constexpr int NB = decltype(nb)::value;
    switch (m) {
#define PDSERVE_ROWS(M) \
  case M: run<M, NB>(w, xp, x.stride(0), k, block_k, n, yp); break;
      PDSERVE_ROWS(1) PDSERVE_ROWS(2) PDSERVE_ROWS(3) PDSERVE_ROWS(4)
      PDSERVE_ROWS(5) PDSERVE_ROWS(6) PDSERVE_ROWS(7) PDSERVE_ROWS(8)
#undef PDSERVE_ROWS
    }
  };
  if (block_n == 32)
    rows(std::integral_constant<int, 32>{});
  else
    rows(std::integral_constant<int, 64>{});
#endif
  if (bias.has_value() && bias->defined()) y.add_(bias->to(at::kFloat));
  return y.to(at::kBFloat16);
}

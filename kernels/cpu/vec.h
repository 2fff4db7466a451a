// Shared by the CPU kernels of kernels/cpu/: an 8-lane fp32 vector, loads that widen the cache
// dtypes to it, a horizontal sum, and the dtype dispatch.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <cstring>

#if defined(__AVX512BF16__) && defined(__AVX512VL__)
#include <immintrin.h>
// bf16 <-> fp32 as single instructions (VCVTNEPS2BF16 rounds to nearest even, as torch's cast
// does): the portable loops below compiled to per-lane code that made bf16 SiLU-mul and
// add+RMSNorm 2-3x slower than their fp32 runs on Zen 5.
#define PDSERVE_VEC_BF16 1
#else
#define PDSERVE_VEC_BF16 0
#endif

namespace pdserve {

// Eight fp32 lanes (one AVX2 register; two SSE ones elsewhere): the compiler's vector type,
// so the code is portable and still keeps accumulators in registers.
typedef float v8f __attribute__((vector_size(32)));

inline v8f load8(const float* p) {
  v8f v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline v8f load8(const c10::BFloat16* p) {  // bf16 is the high half of an fp32
#if PDSERVE_VEC_BF16
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return (v8f)_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
#else
  uint16_t bits[8];
  std::memcpy(bits, p, sizeof(bits));
  uint32_t wide[8];
  for (int i = 0; i < 8; ++i) wide[i] = static_cast<uint32_t>(bits[i]) << 16;
  v8f v;
  std::memcpy(&v, wide, sizeof(v));
  return v;
#endif
}
inline v8f load8(const c10::Half* p) {
  v8f v;
  for (int i = 0; i < 8; ++i) v[i] = static_cast<float>(p[i]);
  return v;
}
inline float hsum(v8f v) {
  return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}
inline float hmax(v8f v) {
  float m = v[0];
  for (int i = 1; i < 8; ++i) m = v[i] > m ? v[i] : m;
  return m;
}

typedef int32_t v8i __attribute__((vector_size(32)));

// e^r on |r| <= ln2/2: 1 + r (c1 + r (c2 + r (c3 + r (c4 + r c5)))), fitted (least squares
// reweighted to minimax) to e^r's relative error: 1.7e-7 at worst in fp32 Horner, against
// 2.4e-7 for the degree-6 Taylor polynomial it replaced, one multiply-add fewer per lane (the
// exponentials are ~30% of a prefill attention tile).
constexpr float kExpC1 = 0.99999970197677612f, kExpC2 = 0.49999150633811951f, kExpC3 = 0.16667635738849640f,
                kExpC4 = 0.041897930204868317f, kExpC5 = 0.0082903141155838966f;

// e^x, eight lanes at a time: x = n ln2 + r with |r| <= ln2/2, e^r by the polynomial above,
// 2^n built in the exponent bits. x is clamped to [-87, 88]: below, ~0 and never a denormal;
// above, e^88 is still a finite float. glibc's scalar expf cost ~25 cycles a call; this is a
// few per lane.
inline v8f exp8(v8f x) {
  const v8f lo = v8f{} - 87.0f, hi = v8f{} + 88.0f;
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  const v8f t = x * 1.44269504088896341f;
  const v8f n = (t + 12582912.0f) - 12582912.0f;  // round to nearest (|t| < 2^22)
  const v8f r = x - n * 0.693145751953125f - n * 1.428606765330187e-06f;  // ln2 in two parts
  v8f p = r * kExpC5 + kExpC4;
  p = p * r + kExpC3;
  p = p * r + kExpC2;
  p = p * r + kExpC1;
  p = p * r + 1.0f;
  const v8i bits = (__builtin_convertvector(n, v8i) + 127) << 23;
  v8f scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

typedef uint32_t v8u __attribute__((vector_size(32)));

// Stores eight fp32 lanes in the cache dtype, rounded to nearest-even as torch's casts are
// (NaN stays a quiet NaN), vectorised: c10's scalar bf16 cast is a branchy call per element.
inline void store8(float* p, v8f v) { std::memcpy(p, &v, sizeof(v)); }
inline v8u bf16_bits8(v8f v) {  // the rounded bf16 in the high half of each lane
  v8u bits;
  std::memcpy(&bits, &v, sizeof(bits));
  const v8u rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u;
  return v == v ? rounded : v8u{} + 0x7FC00000u;
}
inline void store8(c10::BFloat16* p, v8f v) {
#if PDSERVE_VEC_BF16
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), (__m128i)_mm256_cvtneps_pbh((__m256)v));
#else
  const v8u bits = bf16_bits8(v) >> 16;
  uint16_t out[8];
  for (int i = 0; i < 8; ++i) out[i] = static_cast<uint16_t>(bits[i]);
  std::memcpy(p, out, sizeof(out));
#endif
}
inline void store8(c10::Half* p, v8f v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<c10::Half>(v[i]);
}

// v rounded to scalar_t and widened back: the value torch holds after an op in that dtype.
inline v8f round8(float, v8f v) { return v; }
inline v8f round8(c10::BFloat16, v8f v) {
#if PDSERVE_VEC_BF16
  const __m128i bits = (__m128i)_mm256_cvtneps_pbh((__m256)v);
  return (v8f)_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
#else
  const v8u bits = bf16_bits8(v);
  v8f out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
#endif
}
inline v8f round8(c10::Half, v8f v) {
  c10::Half h[8];
  store8(h, v);
  return load8(h);
}

// The dtypes served: fp32, bf16 and fp16 (kernels compute in fp32 whatever they read).
template <typename F>
void dispatch_dtype(at::ScalarType type, const char* what, F&& f) {
  switch (type) {
    case at::kFloat: f(float{}); break;
    case at::kBFloat16: f(c10::BFloat16{}); break;
    case at::kHalf: f(c10::Half{}); break;
    default: TORCH_CHECK(false, what, ": dtype ", type, " is not served (float32, bfloat16, float16)");
  }
}


#if PDSERVE_VEC_BF16
// Sixteen lanes (one AVX-512 register) for the element-wise kernels on CPUs with AVX512-BF16.
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline void store16(c10::BFloat16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(v));
}
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline __m512 round16(c10::BFloat16, __m512 v) {
  const __m256i bits = (__m256i)_mm512_cvtneps_pbh(v);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
inline __m512 round16(float, __m512 v) { return v; }

// e^x for 16 lanes: x = n ln2 + r, e^r by exp8's polynomial, times 2^n by VSCALEFPS; x below -87
// gives ~0, never a denormal.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 p = _mm512_fmadd_ps(r, _mm512_set1_ps(kExpC5), _mm512_set1_ps(kExpC4));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpC3));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpC2));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpC1));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}
#endif

// Asks for a coming page's slice (n tokens x `bytes` per token) while this page is computed:
// pages sit at random places in the cache, where the hardware prefetcher cannot follow.
inline void prefetch_page(const void* base, int64_t n, int64_t token_stride_bytes, int64_t bytes) {
  const char* p = static_cast<const char*>(base);
  for (int64_t j = 0; j < n; ++j)
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + j * token_stride_bytes + b, 0, 1);  // to L2
}

}  // namespace pdserve

// Shared by the CPU kernels of kernels/cpu/: an 8-lane fp32 vector, loads that widen the cache
// dtypes to it, a horizontal sum, and the dtype dispatch.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <cstring>

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
  uint16_t bits[8];
  std::memcpy(bits, p, sizeof(bits));
  uint32_t wide[8];
  for (int i = 0; i < 8; ++i) wide[i] = static_cast<uint32_t>(bits[i]) << 16;
  v8f v;
  std::memcpy(&v, wide, sizeof(v));
  return v;
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

// e^x, eight lanes at a time: x = n ln2 + r with |r| <= ln2/2, e^r by its degree-6 Taylor
// polynomial (truncation < 2e-7 relative, about one ulp), 2^n built in the exponent bits. x is
// clamped to [-87, 88]: below, ~0 and never a denormal; above, e^88 is still a finite float.
// glibc's scalar expf cost ~25 cycles a call; this is a few per lane.
inline v8f exp8(v8f x) {
  const v8f lo = v8f{} - 87.0f, hi = v8f{} + 88.0f;
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  const v8f t = x * 1.44269504088896341f;
  const v8f n = (t + 12582912.0f) - 12582912.0f;  // round to nearest (|t| < 2^22)
  const v8f r = x - n * 0.693145751953125f - n * 1.428606765330187e-06f;  // ln2 in two parts
  v8f p = r * (1.0f / 720) + (1.0f / 120);
  p = p * r + (1.0f / 24);
  p = p * r + (1.0f / 6);
  p = p * r + 0.5f;
  p = p * r + 1.0f;
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
  const v8u bits = bf16_bits8(v) >> 16;
  uint16_t out[8];
  for (int i = 0; i < 8; ++i) out[i] = static_cast<uint16_t>(bits[i]);
  std::memcpy(p, out, sizeof(out));
}
inline void store8(c10::Half* p, v8f v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<c10::Half>(v[i]);
}

// v rounded to scalar_t and widened back: the value torch holds after an op in that dtype.
inline v8f round8(float, v8f v) { return v; }
inline v8f round8(c10::BFloat16, v8f v) {
  const v8u bits = bf16_bits8(v);
  v8f out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
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


}  // namespace pdserve

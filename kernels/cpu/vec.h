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

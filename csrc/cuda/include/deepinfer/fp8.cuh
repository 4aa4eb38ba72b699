// FP8 e4m3 / UE8M0 device helpers shared by every quantising kernel (activation quant, SwiGLU+quant, FP8 caches).
#pragma once

#include "deepinfer/common.cuh"

namespace deepinfer::fp8 {

constexpr float kE4m3Max = 448.0f;
// amax floor so an all-zero group gets a finite, non-zero scale (as in vLLM's quantisers).
constexpr float kAmaxEps = 1e-10f;

#if defined(__CUDACC__)
// max that propagates NaN (like torch.amax), so a NaN input gives a NaN scale instead of vanishing.
__device__ __forceinline__ float nan_max(float a, float b) { return (a > b || isnan(a)) ? a : b; }

// Smallest power of two >= s for positive normal s, exactly (exponent bits): a UE8M0-representable scale.
__device__ __forceinline__ float round_up_pow2(float s) {
  uint32_t bits = __float_as_uint(s);
  uint32_t exp = (bits >> 23) & 0xffu;
  if ((bits & 0x7fffffu) != 0u) exp += 1u;
  return __uint_as_float(exp << 23);
}
#endif  // __CUDACC__

}  // namespace deepinfer::fp8

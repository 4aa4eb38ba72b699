// CPU encode/decode of one FlashMLA "MODEL1" FP8 KV entry (layout in common/attention_checks.h). Bit-exact with the
// CUDA kernels and deepinfer_ops.testing.refs (the per_token_group_quant_fp8 recipe with group 64 and UE8M0 scales).
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "common/attention_checks.h"

namespace deepinfer::fp8_entry {

// amax floor and e4m3 range, as in the project's FP8 quantiser.
constexpr float kAmaxEps = 1e-10f;
constexpr float kE4m3Max = 448.0f;

// Biased exponent byte of the smallest power of two >= s (s positive normal); 0xFF (E8M0 NaN) for NaN.
inline uint8_t ue8m0_exponent_up(float s) {
  uint32_t bits;
  std::memcpy(&bits, &s, 4);
  uint32_t exp = (bits >> 23) & 0xffu;
  if (std::isnan(s)) return 0xffu;
  if ((bits & 0x7fffffu) != 0u) exp += 1u;
  return static_cast<uint8_t>(std::min<uint32_t>(exp, 0xffu));
}

inline float ue8m0_to_float(uint8_t e) {
  if (e == 0xffu) return std::numeric_limits<float>::quiet_NaN();
  const uint32_t bits = static_cast<uint32_t>(e) << 23;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline void encode(uint8_t* entry, const c10::BFloat16* x) {
  for (int64_t g = 0; g < kFp8NopeDims / kFp8TileDims; ++g) {
    const c10::BFloat16* xs = x + g * kFp8TileDims;
    float amax = 0.f;
    for (int64_t k = 0; k < kFp8TileDims; ++k) {
      const float a = std::fabs(static_cast<float>(xs[k]));
      amax = (a > amax || std::isnan(a)) ? a : amax;
    }
    const uint8_t e = ue8m0_exponent_up(std::isnan(amax) ? amax : std::max(amax, kAmaxEps) / kE4m3Max);
    const float sc = ue8m0_to_float(e);
    entry[kFp8ScaleOffset + g] = e;
    for (int64_t k = 0; k < kFp8TileDims; ++k) {
      float v = static_cast<float>(xs[k]) / sc;
      v = std::min(std::max(v, -kE4m3Max), kE4m3Max);
      const c10::Float8_e4m3fn q(v);
      std::memcpy(entry + g * kFp8TileDims + k, &q, 1);
    }
  }
  std::memcpy(entry + kFp8NopeDims, x + kFp8NopeDims, kFp8RopeDims * 2);
  entry[kFp8EntryBytes - 1] = 0;
}

inline void decode(c10::BFloat16* out, const uint8_t* entry) {
  for (int64_t g = 0; g < kFp8NopeDims / kFp8TileDims; ++g) {
    const float sc = ue8m0_to_float(entry[kFp8ScaleOffset + g]);
    for (int64_t k = 0; k < kFp8TileDims; ++k) {
      c10::Float8_e4m3fn q;
      std::memcpy(&q, entry + g * kFp8TileDims + k, 1);
      out[g * kFp8TileDims + k] = static_cast<c10::BFloat16>(static_cast<float>(q) * sc);  // exact
    }
  }
  std::memcpy(out + kFp8NopeDims, entry + kFp8NopeDims, kFp8RopeDims * 2);
}

}  // namespace deepinfer::fp8_entry

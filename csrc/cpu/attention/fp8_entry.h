// CPU encode/decode of one FlashMLA "MODEL1" FP8 KV entry (layout in common/attention_checks.h). Bit-exact with the
// CUDA kernels, deepinfer_ops.testing.refs and FlashMLA's quantiser (group 64, UE8M0 scales floored at 1e-4).
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "common/attention_checks.h"

namespace deepinfer::fp8_entry {

// amax floor of the indexer keys (the project's FP8 quantiser) and the e4m3 range.
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

// e4m3 code of v / scale, clamped to +-448, round-to-nearest-even; NaN -> 0x7F whatever its sign bit (as the CUDA
// conversion: a NaN's sign on the CPU depends on which operand it came from).
inline uint8_t e4m3_code(float v, float scale) {
  v = v / scale;
  if (std::isnan(v)) return 0x7f;
  v = std::min(std::max(v, -kE4m3Max), kE4m3Max);
  const c10::Float8_e4m3fn q(v);
  uint8_t code;
  std::memcpy(&code, &q, 1);
  return code;
}

// MODEL1 token t of a block of block_size tokens (layout in common/attention_checks.h): its row and its scales.
template <class Byte>  // uint8_t or const uint8_t
Byte* entry_row(Byte* block, int64_t t) {
  return block + t * kFp8RowBytes;
}
template <class Byte>
Byte* entry_scales(Byte* block, int64_t block_size, int64_t t) {
  return block + block_size * kFp8RowBytes + t * kFp8ScaleBytes;
}

// FlashMLA's scale recipe: 2^ceil(log2(max(amax / 448, 1e-4))) per tile of 64 dims, the codes e4m3(x / scale).
constexpr float kModel1ScaleFloor = 1e-4f;

inline void encode(uint8_t* block, int64_t block_size, int64_t t, const c10::BFloat16* x) {
  uint8_t* row = entry_row(block, t);
  uint8_t* scales = entry_scales(block, block_size, t);
  for (int64_t g = 0; g < kFp8NopeDims / kFp8TileDims; ++g) {
    const c10::BFloat16* xs = x + g * kFp8TileDims;
    float amax = 0.f;
    for (int64_t k = 0; k < kFp8TileDims; ++k) {
      const float a = std::fabs(static_cast<float>(xs[k]));
      amax = (a > amax || std::isnan(a)) ? a : amax;
    }
    // inf for an inf amax (codes x / inf: +-0, NaN for +-inf; exponent byte 0xFF), NaN for a NaN one
    const float sf = std::isnan(amax) ? amax : std::max(amax / kE4m3Max, kModel1ScaleFloor);
    const uint8_t e = ue8m0_exponent_up(sf);
    const float sc = std::isinf(sf) ? sf : ue8m0_to_float(e);
    scales[g] = e;
    for (int64_t k = 0; k < kFp8TileDims; ++k) row[g * kFp8TileDims + k] = e4m3_code(static_cast<float>(xs[k]), sc);
  }
  std::memcpy(row + kFp8NopeDims, x + kFp8NopeDims, kFp8RopeDims * 2);
  scales[kFp8ScaleBytes - 1] = 0;
}

inline void decode(c10::BFloat16* out, const uint8_t* block, int64_t block_size, int64_t t) {
  const uint8_t* row = entry_row(block, t);
  const uint8_t* scales = entry_scales(block, block_size, t);
  for (int64_t g = 0; g < kFp8NopeDims / kFp8TileDims; ++g) {
    const float sc = ue8m0_to_float(scales[g]);
    for (int64_t k = 0; k < kFp8TileDims; ++k) {
      c10::Float8_e4m3fn q;
      std::memcpy(&q, row + g * kFp8TileDims + k, 1);
      out[g * kFp8TileDims + k] = static_cast<c10::BFloat16>(static_cast<float>(q) * sc);  // exact
    }
  }
  std::memcpy(out + kFp8NopeDims, row + kFp8NopeDims, kFp8RopeDims * 2);
}

// FP8 indexer keys (layout in common/attention_checks.h): key j of a block of block_size keys of d dims has its d
// e4m3 codes at byte j * d of the block and its fp32 scale at byte block_size * d + 4 j.
inline const uint8_t* indexer_key_codes(const uint8_t* block, int64_t d, int64_t j) { return block + j * d; }

inline float indexer_key_scale(const uint8_t* block, int64_t block_size, int64_t d, int64_t j) {
  float sc;
  std::memcpy(&sc, block + block_size * d + j * kIndexerFp8ScaleBytes, 4);
  return sc;
}

// Encode key x (d bf16 dims) as key j of the block: the recipe above with one group of d dims.
inline void indexer_key_encode(uint8_t* block, int64_t block_size, int64_t d, int64_t j, const c10::BFloat16* x) {
  float amax = 0.f;
  for (int64_t k = 0; k < d; ++k) {
    const float a = std::fabs(static_cast<float>(x[k]));
    amax = (a > amax || std::isnan(a)) ? a : amax;
  }
  const float sc = ue8m0_to_float(ue8m0_exponent_up(std::isnan(amax) ? amax : std::max(amax, kAmaxEps) / kE4m3Max));
  for (int64_t k = 0; k < d; ++k) block[j * d + k] = e4m3_code(static_cast<float>(x[k]), sc);
  std::memcpy(block + block_size * d + j * kIndexerFp8ScaleBytes, &sc, 4);
}

// Decoded key value k as float: float(e4m3) * scale, rounded to bf16 (exact for a power-of-two scale).
inline float indexer_key_decode(const uint8_t* codes, float scale, int64_t k) {
  c10::Float8_e4m3fn q;
  std::memcpy(&q, codes + k, 1);
  return static_cast<float>(static_cast<c10::BFloat16>(static_cast<float>(q) * scale));
}

}  // namespace deepinfer::fp8_entry

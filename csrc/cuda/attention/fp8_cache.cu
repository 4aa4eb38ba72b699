// MODEL1 FP8 KV entries: kv_cache_write_fp8 quantises bf16 rows (7 tiles of 64 no-RoPE dims -> e4m3 with a UE8M0
// scale each, RoPE dims kept bf16) into a paged cache; kv_cache_dequant_fp8 decodes entries back. FP8 indexer keys:
// indexer_k_cache_write_fp8 / indexer_k_cache_dequant_fp8 (one power-of-two fp32 scale per key; layout in
// common/attention_checks.h). One warp per token. Same recipe, bit for bit, as the CPU implementation and
// deepinfer_ops.testing.refs.
#include <cuda_fp8.h>
#include <math_constants.h>

#include "deepinfer/attention/sparse_mqa.cuh"
#include "deepinfer/fp8.cuh"

namespace deepinfer::attention {
namespace {

constexpr int kWarps = 4;
using fp8::kAmaxEps;
using fp8::kE4m3Max;
constexpr float kModel1ScaleFloor = 1e-4f;  // MODEL1 entries: FlashMLA's floor of amax / 448
using fp8::nan_max;

// Biased exponent of the smallest power of two >= s (s positive normal); 0xFF (E8M0 NaN) for NaN.
__device__ __forceinline__ uint32_t ue8m0_exponent_up(float s) {
  if (isnan(s)) return 0xffu;
  const uint32_t bits = __float_as_uint(s);
  uint32_t exp = (bits >> 23) & 0xffu;
  if ((bits & 0x7fffffu) != 0u) exp += 1u;
  return min(exp, 0xffu);
}

__device__ __forceinline__ float ue8m0_to_float(uint32_t e) {
  return e == 0xffu ? CUDART_NAN_F : __uint_as_float(e << 23);
}

__device__ __forceinline__ uint8_t to_e4m3(float v, float scale) {
  v = v / scale;  // IEEE division, as on the CPU
  v = v < -kE4m3Max ? -kE4m3Max : v;
  v = v > kE4m3Max ? kE4m3Max : v;
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3));
}

__global__ void __launch_bounds__(kWarps * 32) kv_cache_write_fp8_kernel(const __grid_constant__ Fp8CacheParams p) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (i >= p.t) return;
  const int64_t s = p.slot_mapping[i];
  if (s < 0 || s >= p.num_slots) return;
  uint8_t* blk = p.cache + (s / p.block_size) * p.block_stride;
  uint8_t* e = blk + (s % p.block_size) * kFp8RowBytes;
  uint8_t* sb = blk + p.block_size * kFp8RowBytes + (s % p.block_size) * kFp8ScaleBytes;
  const __nv_bfloat16* x = p.rows + i * p.row_stride;
#pragma unroll 1
  for (int g = 0; g < kFp8NopeDims / 64; ++g) {
    const float x0 = __bfloat162float(x[g * 64 + 2 * lane]), x1 = __bfloat162float(x[g * 64 + 2 * lane + 1]);
    float amax = nan_max(fabsf(x0), fabsf(x1));
#pragma unroll
    for (int m = 16; m > 0; m >>= 1) amax = nan_max(__shfl_xor_sync(0xffffffffu, amax, m), amax);
    // 2^ceil(log2(max(amax / 448, 1e-4))), inf for an inf amax (codes x / inf: +-0, NaN for +-inf), NaN for NaN
    const float sf = isnan(amax) ? amax : fmaxf(amax / kE4m3Max, kModel1ScaleFloor);
    const uint32_t ex = ue8m0_exponent_up(sf);
    const float sc = isinf(sf) ? sf : ue8m0_to_float(ex);
    e[g * 64 + 2 * lane] = to_e4m3(x0, sc);
    e[g * 64 + 2 * lane + 1] = to_e4m3(x1, sc);
    if (lane == 0) sb[g] = static_cast<uint8_t>(ex);
  }
  // RoPE dims [448, 512) as raw bf16: 128 bytes, 4 per lane (byte copies: rows are only 8-byte aligned).
  const uint8_t* rope = reinterpret_cast<const uint8_t*>(x + kFp8NopeDims);
#pragma unroll
  for (int j = 0; j < 4; ++j) e[kFp8NopeDims + 4 * lane + j] = rope[4 * lane + j];
  if (lane == 0) sb[kFp8ScaleBytes - 1] = 0;
}

__global__ void __launch_bounds__(kWarps * 32) kv_cache_dequant_fp8_kernel(const __grid_constant__ Fp8CacheParams p) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (i >= p.t) return;
  const int64_t s = p.slot_mapping[i];
  __nv_bfloat16* out = p.rows + i * p.row_stride;
  if (s < 0 || s >= p.num_slots) {
    for (int c = lane; c < kFp8NopeDims + 64; c += 32) out[c] = __float2bfloat16_rn(0.f);
    return;
  }
  const uint8_t* blk = p.cache + (s / p.block_size) * p.block_stride;
  const uint8_t* e = blk + (s % p.block_size) * kFp8RowBytes;
  const uint8_t* sb = blk + p.block_size * kFp8RowBytes + (s % p.block_size) * kFp8ScaleBytes;
  for (int c = lane; c < kFp8NopeDims; c += 32) {
    __nv_fp8_e4m3 q;
    q.__x = e[c];
    out[c] = __float2bfloat16_rn(static_cast<float>(q) * ue8m0_to_float(sb[c / 64]));
  }
  const uint16_t* rope = reinterpret_cast<const uint16_t*>(e + kFp8NopeDims);  // 2-byte aligned
  for (int c = lane; c < 64; c += 32) {
    out[kFp8NopeDims + c] = __ushort_as_bfloat16(rope[c]);
  }
}

// Indexer keys: lane l holds dims l, l + 32, ... (head_dim <= 128: at most 4).
constexpr int kIdxMaxPerLane = 4;

__global__ void __launch_bounds__(kWarps * 32)
    indexer_k_cache_write_fp8_kernel(const __grid_constant__ Fp8CacheParams p) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32, d = p.head_dim;
  if (i >= p.t) return;
  const int64_t s = p.slot_mapping[i];
  if (s < 0 || s >= p.num_slots) return;
  uint8_t* block = p.cache + (s / p.block_size) * p.block_stride;
  const int64_t j = s % p.block_size;
  const __nv_bfloat16* x = p.rows + i * p.row_stride;
  float v[kIdxMaxPerLane];
  float amax = 0.f;
#pragma unroll
  for (int r = 0; r < kIdxMaxPerLane; ++r) {
    const int c = lane + 32 * r;
    v[r] = c < d ? __bfloat162float(x[c]) : 0.f;
    amax = nan_max(fabsf(v[r]), amax);
  }
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) amax = nan_max(__shfl_xor_sync(0xffffffffu, amax, m), amax);
  const float sc = ue8m0_to_float(ue8m0_exponent_up(isnan(amax) ? amax : fmaxf(amax, kAmaxEps) / kE4m3Max));
#pragma unroll
  for (int r = 0; r < kIdxMaxPerLane; ++r) {
    const int c = lane + 32 * r;
    if (c < d) block[j * d + c] = to_e4m3(v[r], sc);
  }
  if (lane == 0) {  // NaN stored as the canonical 0x7FC00000 (the CPU's and torch's NaN; CUDART_NAN_F is 0x7FFFFFFF)
    const uint32_t bits = isnan(sc) ? 0x7fc00000u : __float_as_uint(sc);
    memcpy(block + int64_t(p.block_size) * d + 4 * j, &bits, 4);  // the cache may be only byte-aligned
  }
}

__global__ void __launch_bounds__(kWarps * 32)
    indexer_k_cache_dequant_fp8_kernel(const __grid_constant__ Fp8CacheParams p) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32, d = p.head_dim;
  if (i >= p.t) return;
  const int64_t s = p.slot_mapping[i];
  __nv_bfloat16* out = p.rows + i * p.row_stride;
  if (s < 0 || s >= p.num_slots) {
    for (int c = lane; c < d; c += 32) out[c] = __float2bfloat16_rn(0.f);
    return;
  }
  const uint8_t* block = p.cache + (s / p.block_size) * p.block_stride;
  const int64_t j = s % p.block_size;
  float sc;
  memcpy(&sc, block + int64_t(p.block_size) * d + 4 * j, 4);
  for (int c = lane; c < d; c += 32) {
    __nv_fp8_e4m3 q;
    q.__x = block[j * d + c];
    out[c] = __float2bfloat16_rn(static_cast<float>(q) * sc);
  }
}

// One warp per token.
template <class Kernel>
void launch_per_token(Kernel kernel, const Fp8CacheParams& p, cudaStream_t stream, const char* name) {
  kernel<<<static_cast<unsigned>((p.t + kWarps - 1) / kWarps), kWarps * 32, 0, stream>>>(p);
  DEEPINFER_CHECK_LAUNCH(name);
}

}  // namespace

void launch_indexer_k_cache_write_fp8(const Fp8CacheParams& p, cudaStream_t stream) {
  if (p.t == 0 || p.num_slots == 0) return;
  launch_per_token(indexer_k_cache_write_fp8_kernel, p, stream, "indexer_k_cache_write_fp8_kernel");
}

void launch_indexer_k_cache_dequant_fp8(const Fp8CacheParams& p, cudaStream_t stream) {
  if (p.t == 0) return;
  launch_per_token(indexer_k_cache_dequant_fp8_kernel, p, stream, "indexer_k_cache_dequant_fp8_kernel");
}

void launch_kv_cache_write_fp8(const Fp8CacheParams& p, cudaStream_t stream) {
  if (p.t == 0 || p.num_slots == 0) return;
  launch_per_token(kv_cache_write_fp8_kernel, p, stream, "kv_cache_write_fp8_kernel");
}

void launch_kv_cache_dequant_fp8(const Fp8CacheParams& p, cudaStream_t stream) {
  if (p.t == 0) return;
  launch_per_token(kv_cache_dequant_fp8_kernel, p, stream, "kv_cache_dequant_fp8_kernel");
}

}  // namespace deepinfer::attention

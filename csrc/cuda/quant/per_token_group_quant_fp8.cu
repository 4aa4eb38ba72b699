#include <cuda_fp8.h>

#include "deepinfer/fp8.cuh"
#include "deepinfer/quant/per_token_group_quant_fp8.cuh"

namespace deepinfer::quant {
namespace {

constexpr int kWarpsPerBlock = 8;
using fp8::kAmaxEps;
using fp8::nan_max;
using fp8::round_up_pow2;
constexpr float kFp8Max = fp8::kE4m3Max;

// inv_scale = 1 / scale (IEEE): identical to the CPU implementation and the reference. The saturating
// conversion clamps to +-448 and keeps NaN, which is the reference's clamp.
__device__ __forceinline__ uint8_t to_e4m3(float v, float inv_scale) {
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(v * inv_scale, __NV_SATFINITE, __NV_E4M3));
}

__device__ __forceinline__ uint16_t to_e4m3x2(float a, float b, float inv_scale) {
  return static_cast<uint16_t>(
      __nv_cvt_float2_to_fp8x2(make_float2(a * inv_scale, b * inv_scale), __NV_SATFINITE, __NV_E4M3));
}

template <typename T, int kVec>
__global__ void __launch_bounds__(kWarpsPerBlock * 32) per_token_group_quant_fp8_kernel(PerTokenGroupQuantParams p) {
  const int lane = threadIdx.x % 32;
  const int64_t item = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  if (item >= p.rows * p.num_groups) return;
  const int64_t r = item / p.num_groups, g = item % p.num_groups;
  const int64_t k0 = g * p.group_size;
  const int64_t len = min(p.group_size, p.K - k0);
  const T* x = static_cast<const T*>(p.input) + r * p.input_row_stride + k0;
  uint8_t* q = p.out_q + r * p.q_row_stride + k0;
  using V = Vec<T, kVec>;

  float amax = 0.f;
  for (int64_t k = lane * kVec; k < len; k += 32 * kVec) {
    if (kVec > 1 && k + kVec <= len) {
      const V v = *reinterpret_cast<const V*>(x + k);
#pragma unroll
      for (int j = 0; j < kVec; ++j) amax = nan_max(fabsf(to_float(v.v[j])), amax);
    } else {
      for (int j = 0; j < kVec && k + j < len; ++j) amax = nan_max(fabsf(to_float(x[k + j])), amax);
    }
  }
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) amax = nan_max(__shfl_xor_sync(0xffffffffu, amax, m), amax);
  float scale = isnan(amax) ? amax : fmaxf(amax, kAmaxEps) / kFp8Max;
  if (p.scale_ue8m0 && isfinite(scale)) scale = round_up_pow2(scale);
  if (lane == 0) p.out_scale[r * p.scale_row_stride + g * p.scale_col_stride] = scale;
  const float inv_scale = 1.0f / scale;

  for (int64_t k = lane * kVec; k < len; k += 32 * kVec) {
    if (kVec > 1 && k + kVec <= len) {
      const V v = *reinterpret_cast<const V*>(x + k);
      Vec<uint8_t, kVec> o;
#pragma unroll
      for (int j = 0; j < kVec; ++j) o.v[j] = to_e4m3(to_float(v.v[j]), inv_scale);
      *reinterpret_cast<Vec<uint8_t, kVec>*>(q + k) = o;
    } else {
      for (int j = 0; j < kVec && k + j < len; ++j) q[k + j] = to_e4m3(to_float(x[k + j]), inv_scale);
    }
  }
}

// Fast path: each thread holds kVecsPerThread 16-byte vectors of one group in registers (one HBM read);
// kThreadsPerGroup = group_size / (kVec * kVecsPerThread) lanes share a group (a power of two <= 32). Vector j of
// lane `sub` is the group's vector j * kThreadsPerGroup + sub, so each load (and each e4m3 store) of the group's
// lanes covers one contiguous span (full sectors per instruction). Grid-stride over groups with kUnroll groups per
// thread in flight.
template <typename T, int kThreadsPerGroup, int kVecsPerThread, typename IdxT, int kUnroll>
__global__ void __launch_bounds__(256) per_token_group_quant_fp8_vec_kernel(PerTokenGroupQuantParams p) {
  constexpr int kVec = 16 / sizeof(T);
  constexpr int kGroupsPerBlock = 256 / kThreadsPerGroup;
  using V = Vec<T, kVec>;
  const int sub = threadIdx.x % kThreadsPerGroup;
  const IdxT num_groups = static_cast<IdxT>(p.num_groups);
  const IdxT items = static_cast<IdxT>(p.rows) * num_groups;
  for (IdxT base = static_cast<IdxT>(blockIdx.x) * kGroupsPerBlock * kUnroll; base < items;
       base += static_cast<IdxT>(gridDim.x) * kGroupsPerBlock * kUnroll) {
    V v[kUnroll][kVecsPerThread];
    bool active[kUnroll][kVecsPerThread];
    IdxT r[kUnroll], g[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const IdxT item = base + u * kGroupsPerBlock + threadIdx.x / kThreadsPerGroup;
      r[u] = item / num_groups;
      g[u] = item - r[u] * num_groups;
      const T* row = static_cast<const T*>(p.input) + static_cast<int64_t>(r[u]) * p.input_row_stride;
#pragma unroll
      for (int j = 0; j < kVecsPerThread; ++j) {
        const int64_t k = static_cast<int64_t>(g[u]) * p.group_size + (j * kThreadsPerGroup + sub) * kVec;
        active[u][j] = item < items && k < p.K;  // K % kVec == 0 on this path
        if (active[u][j]) v[u][j] = *reinterpret_cast<const V*>(row + k);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      float amax = 0.f;
#pragma unroll
      for (int j = 0; j < kVecsPerThread; ++j) {
        if (active[u][j]) {
#pragma unroll
          for (int e = 0; e < kVec; ++e) amax = nan_max(fabsf(to_float(v[u][j].v[e])), amax);
        }
      }
#pragma unroll
      for (int m = kThreadsPerGroup / 2; m > 0; m >>= 1) amax = nan_max(__shfl_xor_sync(0xffffffffu, amax, m), amax);
      float scale = isnan(amax) ? amax : fmaxf(amax, kAmaxEps) / kFp8Max;
      if (p.scale_ue8m0 && isfinite(scale)) scale = round_up_pow2(scale);
      const IdxT item = base + u * kGroupsPerBlock + threadIdx.x / kThreadsPerGroup;
      if (item < items && sub == 0) {
        p.out_scale[static_cast<int64_t>(r[u]) * p.scale_row_stride + static_cast<int64_t>(g[u]) * p.scale_col_stride] = scale;
      }
      const float inv_scale = __frcp_rn(scale);  // correctly rounded 1 / scale, as the reference
      uint8_t* qrow = p.out_q + static_cast<int64_t>(r[u]) * p.q_row_stride + static_cast<int64_t>(g[u]) * p.group_size;
#pragma unroll
      for (int j = 0; j < kVecsPerThread; ++j) {
        if (active[u][j]) {
          Vec<uint16_t, kVec / 2> o;
#pragma unroll
          for (int e = 0; e < kVec / 2; ++e) {
            o.v[e] = to_e4m3x2(to_float(v[u][j].v[2 * e]), to_float(v[u][j].v[2 * e + 1]), inv_scale);
          }
          *reinterpret_cast<Vec<uint16_t, kVec / 2>*>(qrow + (j * kThreadsPerGroup + sub) * kVec) = o;
        }
      }
    }
  }
}



template <typename T, int kThreadsPerGroup, int kVecsPerThread, int kUnroll>
void launch_flat(const PerTokenGroupQuantParams& p, cudaStream_t stream) {
  constexpr int kGroupsPerIter = 256 / kThreadsPerGroup * kUnroll;
  const int64_t items = p.rows * p.num_groups;
  const int64_t needed = (items + kGroupsPerIter - 1) / kGroupsPerIter;
  // Up to 64 CTAs per SM: typical sizes get one pass per CTA and the hardware balances the tail; only huge
  // inputs loop (grid-stride).
  const int64_t cap = static_cast<int64_t>(num_sms()) * 64;
  const int64_t grid = needed < cap ? needed : cap;
  // 32-bit index arithmetic (row/group division) whenever the item count allows it: it is most of the work.
  if (items + cap * kGroupsPerIter < (int64_t{1} << 32)) {
    per_token_group_quant_fp8_vec_kernel<T, kThreadsPerGroup, kVecsPerThread, uint32_t, kUnroll><<<static_cast<unsigned>(grid), 256, 0, stream>>>(p);
  } else {
    per_token_group_quant_fp8_vec_kernel<T, kThreadsPerGroup, kVecsPerThread, int64_t, kUnroll><<<static_cast<unsigned>(grid), 256, 0, stream>>>(p);
  }
}

template <typename T, int kThreadsPerGroup, int kVecsPerThread>
void launch_vec(const PerTokenGroupQuantParams& p, cudaStream_t stream) {
  launch_flat<T, kThreadsPerGroup, kVecsPerThread, 2>(p, stream);
}

template <typename T>
void launch_typed(const PerTokenGroupQuantParams& p, cudaStream_t stream) {
  constexpr int kVec16 = 16 / sizeof(T);
  // two 16-byte vectors per thread when the group allows (bf16 group 128: 8 lanes x 16 elements)
  const int vecs = p.group_size % (2 * kVec16) == 0 && p.group_size / (2 * kVec16) >= 4 ? 2 : 1;
  const int64_t tpg = p.group_size / (kVec16 * vecs);
  const bool fast_ok = p.group_size % kVec16 == 0 && p.K % kVec16 == 0 && p.input_row_stride % kVec16 == 0 &&
                       p.q_row_stride % kVec16 == 0 && is_aligned(p.input, 16) && is_aligned(p.out_q, kVec16) &&
                       (tpg == 4 || tpg == 8 || tpg == 16 || tpg == 32);
  if (fast_ok) {
    switch (tpg * 10 + vecs) {
      case 41: launch_vec<T, 4, 1>(p, stream); break;
      case 81: launch_vec<T, 8, 1>(p, stream); break;
      case 161: launch_vec<T, 16, 1>(p, stream); break;
      case 321: launch_vec<T, 32, 1>(p, stream); break;
      case 42: launch_vec<T, 4, 2>(p, stream); break;
      case 82: launch_vec<T, 8, 2>(p, stream); break;
      case 162: launch_vec<T, 16, 2>(p, stream); break;
      default: launch_vec<T, 32, 2>(p, stream); break;
    }
    DEEPINFER_CHECK_LAUNCH("per_token_group_quant_fp8_vec_kernel");
    return;
  }
  constexpr int kVec = 4;
  const bool vec_ok = p.group_size % kVec == 0 && p.input_row_stride % kVec == 0 && p.q_row_stride % kVec == 0 &&
                      is_aligned(p.input, sizeof(T) * kVec) && is_aligned(p.out_q, kVec);
  const int64_t items = p.rows * p.num_groups;
  const dim3 grid(static_cast<unsigned>((items + kWarpsPerBlock - 1) / kWarpsPerBlock));
  if (vec_ok) {
    per_token_group_quant_fp8_kernel<T, kVec><<<grid, kWarpsPerBlock * 32, 0, stream>>>(p);
  } else {
    per_token_group_quant_fp8_kernel<T, 1><<<grid, kWarpsPerBlock * 32, 0, stream>>>(p);
  }
  DEEPINFER_CHECK_LAUNCH("per_token_group_quant_fp8_kernel");
}

}  // namespace

void launch_per_token_group_quant_fp8(const PerTokenGroupQuantParams& p, cudaStream_t stream) {
  if (p.rows == 0 || p.K == 0) return;
  DEEPINFER_DISPATCH_FLOAT(p.dtype, [&] { launch_typed<scalar_t>(p, stream); });
}

}  // namespace deepinfer::quant

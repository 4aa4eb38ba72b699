// Clamped SwiGLU fused with FP8 re-quantisation (the MoE expert activation of DeepSeek-V4):
// h = silu(min(gate, limit)) * clamp(up, -limit, limit) in fp32, amax per 128 columns -> scale -> e4m3 (RNE,
// saturating at +-448). One warp per (row, 128-column group); each lane holds 4 values in registers.
#include <cuda_fp8.h>

#include "deepinfer/fp8.cuh"
#include "deepinfer/gemm/swiglu_clamp_quant_fp8.cuh"

namespace deepinfer::gemm {
namespace {

constexpr int kWarpsPerBlock = 8;
constexpr int kGroup = 128;
constexpr int kPerLane = kGroup / 32;
using fp8::kAmaxEps;
using fp8::nan_max;
using fp8::round_up_pow2;
constexpr float kFp8Max = fp8::kE4m3Max;

template <typename T>
__global__ void __launch_bounds__(kWarpsPerBlock * 32) swiglu_clamp_quant_fp8_kernel(SwigluClampQuantParams p) {
  const int lane = threadIdx.x % 32;
  const int64_t item = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  if (item >= p.rows * p.num_groups) return;
  const int64_t r = item / p.num_groups, g = item % p.num_groups;
  const int64_t i0 = g * kGroup;
  const int64_t len = min(static_cast<int64_t>(kGroup), p.I - i0);
  const T* gate = static_cast<const T*>(p.gate_up) + r * p.in_row_stride + i0;
  const T* up = gate + p.I;
  float h[kPerLane];
  float amax = 0.f;
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    const int64_t i = lane + 32 * j;
    h[j] = 0.f;
    if (i < len) {
      float gv = to_float(gate[i]);
      gv = gv > p.limit ? p.limit : gv;  // NaN stays NaN
      float uv = to_float(up[i]);
      uv = uv > p.limit ? p.limit : uv;
      uv = uv < -p.limit ? -p.limit : uv;
      h[j] = gv / (1.f + expf(-gv)) * uv;
      amax = nan_max(fabsf(h[j]), amax);
    }
  }
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) amax = nan_max(__shfl_xor_sync(0xffffffffu, amax, m), amax);
  float scale = isnan(amax) ? amax : fmaxf(amax, kAmaxEps) / kFp8Max;
  if (p.scale_ue8m0 && isfinite(scale)) scale = round_up_pow2(scale);
  if (lane == 0) p.out_scale[r * p.scale_row_stride + g * p.scale_col_stride] = scale;
  uint8_t* q = p.out_q + r * p.q_row_stride + i0;
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    const int64_t i = lane + 32 * j;
    if (i < len) {
      float v = h[j] / scale;
      v = v < -kFp8Max ? -kFp8Max : v;
      v = v > kFp8Max ? kFp8Max : v;
      q[i] = static_cast<uint8_t>(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3));
    }
  }
}

}  // namespace

void launch_swiglu_clamp_quant_fp8(const SwigluClampQuantParams& p, cudaStream_t stream) {
  const int64_t items = p.rows * p.num_groups;
  const dim3 grid(static_cast<unsigned>((items + kWarpsPerBlock - 1) / kWarpsPerBlock));
  DEEPINFER_DISPATCH_FLOAT(p.dtype, [&] {
    swiglu_clamp_quant_fp8_kernel<scalar_t><<<grid, kWarpsPerBlock * 32, 0, stream>>>(p);
  });
  DEEPINFER_CHECK_LAUNCH("swiglu_clamp_quant_fp8");
}

}  // namespace deepinfer::gemm

#include "deepinfer/norm/rms_norm.cuh"

namespace deepinfer::norm {
namespace {

constexpr int kNumThreads = 256;

template <typename T, typename W, int kVec>
__global__ void __launch_bounds__(kNumThreads) rms_norm_kernel(RmsNormParams p) {
  __shared__ float smem[kNumThreads / 32];
  const int64_t row = blockIdx.x;
  const T* x = static_cast<const T*>(p.input) + row * p.input_row_stride;
  T* y = static_cast<T*>(p.out) + row * p.out_row_stride;
  const W* w = static_cast<const W*>(p.weight);
  const int64_t num_vec = p.hidden / kVec;
  using V = Vec<T, kVec>;
  const V* xv = reinterpret_cast<const V*>(x);
  float acc = 0.f;
  for (int64_t i = threadIdx.x; i < num_vec; i += kNumThreads) {
    const V v = xv[i];
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      const float f = to_float(v.v[j]);
      acc += f * f;
    }
  }
  const float sum = block_sum_fixed_order<kNumThreads>(acc, smem);
  const float inv = rsqrtf(sum / static_cast<float>(p.hidden) + p.eps);
  V* yv = reinterpret_cast<V*>(y);
  for (int64_t i = threadIdx.x; i < num_vec; i += kNumThreads) {
    const V v = xv[i];
    V o;
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      float f = to_float(v.v[j]) * inv;
      if (w != nullptr) f *= to_float(w[i * kVec + j]);
      o.v[j] = from_float<T>(f);
    }
    yv[i] = o;
  }
}

template <typename T, typename W>
void launch_typed(const RmsNormParams& p, cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  const bool vec_ok = p.hidden % kVec == 0 && p.input_row_stride % kVec == 0 && p.out_row_stride % kVec == 0 &&
                      is_aligned(p.input, 16) && is_aligned(p.out, 16);
  const dim3 grid(static_cast<unsigned>(p.rows));
  if (vec_ok) {
    rms_norm_kernel<T, W, kVec><<<grid, kNumThreads, 0, stream>>>(p);
  } else {
    rms_norm_kernel<T, W, 1><<<grid, kNumThreads, 0, stream>>>(p);
  }
  DEEPINFER_CHECK_LAUNCH("rms_norm_kernel");
}

}  // namespace

void launch_rms_norm(const RmsNormParams& p, cudaStream_t stream) {
  if (p.rows == 0 || p.hidden == 0) return;
  DEEPINFER_DISPATCH_FLOAT(p.dtype, [&] {
    if (p.weight != nullptr && p.weight_fp32) {
      launch_typed<scalar_t, float>(p, stream);
    } else {
      launch_typed<scalar_t, scalar_t>(p, stream);
    }
  });
}

}  // namespace deepinfer::norm

#include "deepinfer/norm/rms_norm.cuh"

namespace deepinfer::norm {
namespace {

// One CTA per row. The thread count and the per-thread element split depend only on `hidden`, so a row's
// reduction order is the same whatever the number of rows.
// Fast path: the row is held in registers (kVecPerThread 16-byte vectors per thread): one HBM read, one write.
template <typename T, typename W, int kNumThreads, int kVecPerThread>
__global__ void __launch_bounds__(kNumThreads) rms_norm_reg_kernel(RmsNormParams p) {
  constexpr int kVec = 16 / sizeof(T);
  using V = Vec<T, kVec>;
  __shared__ float smem[kNumThreads / 32];
  const int64_t row = blockIdx.x;
  const V* xv = reinterpret_cast<const V*>(static_cast<const T*>(p.input) + row * p.input_row_stride);
  V* yv = reinterpret_cast<V*>(static_cast<T*>(p.out) + row * p.out_row_stride);
  const W* w = static_cast<const W*>(p.weight);
  const int num_vec = static_cast<int>(p.hidden / kVec);
  V cache[kVecPerThread];
  float acc = 0.f;
#pragma unroll
  for (int j = 0; j < kVecPerThread; ++j) {
    const int i = threadIdx.x + j * kNumThreads;
    if (i < num_vec) cache[j] = xv[i];
  }
#pragma unroll
  for (int j = 0; j < kVecPerThread; ++j) {
    const int i = threadIdx.x + j * kNumThreads;
    if (i < num_vec) {
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        const float f = to_float(cache[j].v[e]);
        acc += f * f;
      }
    }
  }
  const float sum = block_sum_fixed_order<kNumThreads>(acc, smem);
  const float inv = rsqrtf(sum / static_cast<float>(p.hidden) + p.eps);
#pragma unroll
  for (int j = 0; j < kVecPerThread; ++j) {
    const int i = threadIdx.x + j * kNumThreads;
    if (i < num_vec) {
      V o;
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        float f = to_float(cache[j].v[e]) * inv;
        if (w != nullptr) f *= to_float(w[static_cast<int64_t>(i) * kVec + e]);
        o.v[e] = from_float<T>(f);
      }
      yv[i] = o;
    }
  }
}

// General path (any hidden, alignment or stride): two passes over the row, the second from L2.
template <typename T, typename W, int kNumThreads>
__global__ void __launch_bounds__(kNumThreads) rms_norm_generic_kernel(RmsNormParams p) {
  __shared__ float smem[kNumThreads / 32];
  const int64_t row = blockIdx.x;
  const T* x = static_cast<const T*>(p.input) + row * p.input_row_stride;
  T* y = static_cast<T*>(p.out) + row * p.out_row_stride;
  const W* w = static_cast<const W*>(p.weight);
  float acc = 0.f;
  for (int64_t i = threadIdx.x; i < p.hidden; i += kNumThreads) {
    const float f = to_float(x[i]);
    acc += f * f;
  }
  const float sum = block_sum_fixed_order<kNumThreads>(acc, smem);
  const float inv = rsqrtf(sum / static_cast<float>(p.hidden) + p.eps);
  for (int64_t i = threadIdx.x; i < p.hidden; i += kNumThreads) {
    float f = to_float(x[i]) * inv;
    if (w != nullptr) f *= to_float(w[i]);
    y[i] = from_float<T>(f);
  }
}

template <typename T, typename W>
void launch_typed(const RmsNormParams& p, cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  const dim3 grid(static_cast<unsigned>(p.rows));
  const bool vec_ok = p.hidden % kVec == 0 && p.input_row_stride % kVec == 0 && p.out_row_stride % kVec == 0 &&
                      is_aligned(p.input, 16) && is_aligned(p.out, 16);
  const int64_t num_vec = p.hidden / kVec;
  if (vec_ok && num_vec <= 128 * 8) {
    // up to 8 vectors per thread with 128 threads (bf16: hidden <= 8192)
    const int per_thread = static_cast<int>((num_vec + 127) / 128);
    if (per_thread <= 1) {
      rms_norm_reg_kernel<T, W, 128, 1><<<grid, 128, 0, stream>>>(p);
    } else if (per_thread <= 2) {
      rms_norm_reg_kernel<T, W, 128, 2><<<grid, 128, 0, stream>>>(p);
    } else if (per_thread <= 4) {
      rms_norm_reg_kernel<T, W, 128, 4><<<grid, 128, 0, stream>>>(p);
    } else {
      rms_norm_reg_kernel<T, W, 128, 8><<<grid, 128, 0, stream>>>(p);
    }
  } else if (vec_ok && num_vec <= 512 * 8) {
    rms_norm_reg_kernel<T, W, 512, 8><<<grid, 512, 0, stream>>>(p);
  } else {
    rms_norm_generic_kernel<T, W, 256><<<grid, 256, 0, stream>>>(p);
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

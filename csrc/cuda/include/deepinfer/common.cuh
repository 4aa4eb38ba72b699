// Framework-independent helpers shared by every CUDA kernel (host part also read by g++): dtype tags, checked launches,
// vector load/store, and a fixed-order (deterministic) block reduction.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>

namespace deepinfer {

enum class DType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

inline void cuda_check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("deepinfer CUDA error in ") + what + ": " + cudaGetErrorString(err));
  }
}
#define DEEPINFER_CUDA_CHECK(expr) ::deepinfer::cuda_check((expr), #expr)
#define DEEPINFER_CHECK_LAUNCH(name) ::deepinfer::cuda_check(cudaGetLastError(), name)

// Runs `body` with `scalar_t` bound to the CUDA type of `dtype`.
#define DEEPINFER_DISPATCH_FLOAT(dtype, ...)                     \
  switch (dtype) {                                               \
    case ::deepinfer::DType::kFloat32: {                         \
      using scalar_t = float;                                    \
      __VA_ARGS__();                                             \
      break;                                                     \
    }                                                            \
    case ::deepinfer::DType::kBFloat16: {                        \
      using scalar_t = __nv_bfloat16;                            \
      __VA_ARGS__();                                             \
      break;                                                     \
    }                                                            \
    case ::deepinfer::DType::kFloat16: {                         \
      using scalar_t = __half;                                   \
      __VA_ARGS__();                                             \
      break;                                                     \
    }                                                            \
    default:                                                     \
      throw std::runtime_error("deepinfer: unsupported dtype");  \
  }

// Raises `kernel`'s dynamic shared-memory limit on the current device to at least `bytes`. cudaFuncSetAttribute
// runs only when a larger limit is first needed there, not on every launch (the attribute holds for the context;
// a cudaDeviceReset would need it again).
inline void ensure_dynamic_smem_ptr(const void* kernel, int bytes) {
  static std::mutex mu;
  static std::map<std::pair<const void*, int>, int> limits;
  int device = 0;
  cuda_check(cudaGetDevice(&device), "cudaGetDevice");
  std::lock_guard<std::mutex> lock(mu);
  int& have = limits[{kernel, device}];
  if (have >= bytes) return;
  cuda_check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes),
             "cudaFuncSetAttribute(cudaFuncAttributeMaxDynamicSharedMemorySize)");
  have = bytes;
}

template <class Kernel>
void ensure_dynamic_smem(Kernel* kernel, size_t bytes) {
  ensure_dynamic_smem_ptr(reinterpret_cast<const void*>(kernel), static_cast<int>(bytes));
}

inline bool is_aligned(const void* p, int bytes) { return (reinterpret_cast<uintptr_t>(p) % bytes) == 0; }

// SM count of the current device (cached per device index; read once with the runtime API).
inline int num_sms() {
  static std::mutex mu;
  static std::map<int, int> cache;
  int dev = 0;
  cuda_check(cudaGetDevice(&dev), "cudaGetDevice");
  std::lock_guard<std::mutex> lock(mu);
  int& n = cache[dev];
  if (n == 0) cuda_check(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev), "cudaDeviceGetAttribute");
  return n;
}


#if defined(__CUDACC__)  // device helpers; params headers are also read by the host compiler
template <typename T>
__device__ __forceinline__ float to_float(T v) {
  return static_cast<float>(v);
}
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 v) {
  return __bfloat162float(v);
}
template <>
__device__ __forceinline__ float to_float<__half>(__half v) {
  return __half2float(v);
}

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
template <>
__device__ __forceinline__ __half from_float<__half>(float v) {
  return __float2half_rn(v);
}

// N elements of T moved as one aligned access.
template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

// Sum over a block of kNumThreads threads (every thread calls it; it synchronises) with a fixed reduction tree:
// xor-shuffle within warps, then warp 0 adds the warp totals. The result, returned to every thread, depends only on
// blockDim and the inputs, never on gridDim. T: float (rms_norm) or int (exact counts, top-k).
template <int kNumThreads, typename T = float>
__device__ __forceinline__ T block_sum_fixed_order(T v, T* smem /* [kNumThreads / 32] */) {
  constexpr int kNumWarps = kNumThreads / 32;
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) v += __shfl_xor_sync(0xffffffffu, v, m);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) smem[warp] = v;
  __syncthreads();
  if (warp == 0) {
    T t = lane < kNumWarps ? smem[lane] : T(0);
#pragma unroll
    for (int m = 16; m > 0; m >>= 1) t += __shfl_xor_sync(0xffffffffu, t, m);
    if (lane == 0) smem[0] = t;
  }
  __syncthreads();
  const T total = smem[0];
  __syncthreads();
  return total;
}

#endif  // __CUDACC__

}  // namespace deepinfer

#include <cmath>

#include "deepinfer/sampling/logsumexp_rows.cuh"

namespace deepinfer::sampling {
namespace {

constexpr int kThreads = 512;

// Element v of a row belongs to thread (v / 4) % kThreads, which visits its elements in increasing v; the order is
// the same whether a group of 4 is read as one float4 (aligned row) or as 4 scalars (any other row), so the row's
// address never changes the arithmetic. Pass 1: the row max (exact in any order; fmaxf skips NaN, which then
// poisons pass 2). Pass 2: sum of exp(x - shift). Thread totals are combined by block_sum_fixed_order.
template <bool kVec>
__device__ __forceinline__ void load4(const float* row, int64_t v, int64_t V, float (&e)[4]) {
  if (kVec && v + 4 <= V) {
    const float4 q = *reinterpret_cast<const float4*>(row + v);
    e[0] = q.x, e[1] = q.y, e[2] = q.z, e[3] = q.w;
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) e[i] = v + i < V ? row[v + i] : -INFINITY;
  }
}

template <bool kVec>
__global__ void __launch_bounds__(kThreads) logsumexp_rows_kernel(LogsumexpRowsParams p) {
  __shared__ float smem[kThreads / 32];
  const float* row = p.x + static_cast<int64_t>(blockIdx.x) * p.x_row_stride;
  const int64_t step = 4 * static_cast<int64_t>(kThreads);
  float m = -INFINITY;
  for (int64_t v = 4 * threadIdx.x; v < p.V; v += step) {
    float e[4];
    load4<kVec>(row, v, p.V, e);
#pragma unroll
    for (int i = 0; i < 4; ++i) m = fmaxf(m, e[i]);
  }
  // block max: every order gives the same value
#pragma unroll
  for (int s = 16; s > 0; s >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, s));
  if (threadIdx.x % 32 == 0) smem[threadIdx.x / 32] = m;
  __syncthreads();
  m = -INFINITY;
#pragma unroll
  for (int w = 0; w < kThreads / 32; ++w) m = fmaxf(m, smem[w]);
  __syncthreads();
  const float shift = isfinite(m) ? m : 0.f;  // +inf row -> +inf (or NaN), all -inf (or empty) -> -inf
  float acc = 0.f;
  for (int64_t v = 4 * threadIdx.x; v < p.V; v += step) {
    float e[4];
    load4<kVec>(row, v, p.V, e);
#pragma unroll
    for (int i = 0; i < 4; ++i) acc += expf(e[i] - shift);
  }
  const float total = block_sum_fixed_order<kThreads>(acc, smem);
  if (threadIdx.x == 0) p.out[blockIdx.x] = logf(total) + shift;
}

}  // namespace

void launch_logsumexp_rows(const LogsumexpRowsParams& p, cudaStream_t stream) {
  if (p.rows == 0) return;
  const bool vec = is_aligned(p.x, 16) && p.x_row_stride % 4 == 0;
  if (vec) {
    logsumexp_rows_kernel<true><<<static_cast<unsigned>(p.rows), kThreads, 0, stream>>>(p);
  } else {
    logsumexp_rows_kernel<false><<<static_cast<unsigned>(p.rows), kThreads, 0, stream>>>(p);
  }
  DEEPINFER_CHECK_LAUNCH("logsumexp_rows_kernel");
}

}  // namespace deepinfer::sampling

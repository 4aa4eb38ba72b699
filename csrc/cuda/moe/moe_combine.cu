#include "deepinfer/moe/moe_combine.cuh"

namespace deepinfer::moe {
namespace {

// One thread per V consecutive hidden elements of one token; the token's slots in order j = 0 .. top_k - 1.
template <typename Y, typename O, int V>
__global__ void __launch_bounds__(256) moe_combine_kernel(MoeCombineParams p) {
  const int64_t per_row = p.hidden / V;
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= p.tokens * per_row) return;
  const int64_t t = idx / per_row, d0 = (idx % per_row) * V;
  float acc[V];
#pragma unroll
  for (int e = 0; e < V; ++e) acc[e] = 0.f;
  for (int64_t j = 0; j < p.top_k; ++j) {
    const int64_t r = p.slot_rows[t * p.top_k + j];
    if (r < 0 || r >= p.rows) continue;
    const float w = p.weights[t * p.top_k + j];
    const Vec<Y, V> v = *reinterpret_cast<const Vec<Y, V>*>(static_cast<const Y*>(p.y) + r * p.y_row_stride + d0);
#pragma unroll
    for (int e = 0; e < V; ++e) acc[e] += w * to_float(v.v[e]);
  }
  Vec<O, V> o;
#pragma unroll
  for (int e = 0; e < V; ++e) o.v[e] = from_float<O>(acc[e]);
  *reinterpret_cast<Vec<O, V>*>(static_cast<O*>(p.out) + t * p.hidden + d0) = o;
}

template <typename Y, typename O>
void launch_typed(const MoeCombineParams& p, cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(Y) < 16 / sizeof(O) ? 16 / sizeof(Y) : 16 / sizeof(O);
  const bool vec = p.hidden % kVec == 0 && p.y_row_stride % kVec == 0 && is_aligned(p.y, 16) &&
                   is_aligned(p.out, 16);
  const int64_t n = p.tokens * (vec ? p.hidden / kVec : p.hidden);
  const dim3 grid(static_cast<unsigned>((n + 255) / 256));
  if (vec) {
    moe_combine_kernel<Y, O, kVec><<<grid, 256, 0, stream>>>(p);
  } else {
    moe_combine_kernel<Y, O, 1><<<grid, 256, 0, stream>>>(p);
  }
  DEEPINFER_CHECK_LAUNCH("moe_combine_kernel");
}

}  // namespace

void launch_moe_combine(const MoeCombineParams& p, cudaStream_t stream) {
  if (p.tokens == 0 || p.hidden == 0) return;
  DEEPINFER_DISPATCH_FLOAT(p.y_dtype, [&] {
    using Y = scalar_t;
    DEEPINFER_DISPATCH_FLOAT(p.out_dtype, [&] { launch_typed<Y, scalar_t>(p, stream); });
  });
}

}  // namespace deepinfer::moe

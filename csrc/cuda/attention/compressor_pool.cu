#include "deepinfer/attention/compressor_pool.cuh"

namespace deepinfer::attention {
namespace {

// out[w, d] = sum_s kv[w, s, d] * softmax_s(gate[w, :, d]): pass 1 the max over the slots (exact in any order),
// pass 2 the exp-sum and the exp-weighted kv sum in slot order, one division, one rounding. Neighbouring threads take
// neighbouring d (coalesced rows of kv and gate).
template <typename T>
__global__ void __launch_bounds__(256) compressor_pool_kernel(CompressorPoolParams p) {
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= p.n * p.hd) return;
  const int64_t w = idx / p.hd, d = idx % p.hd;
  const float* g = p.gate + w * p.gate_n + d;
  const T* kv = static_cast<const T*>(p.kv) + w * p.kv_n + d;
  float m = -INFINITY;
  for (int64_t s = 0; s < p.S; ++s) m = fmaxf(m, g[s * p.gate_s]);
  float den = 0.f, num = 0.f;
  for (int64_t s = 0; s < p.S; ++s) {
    const float e = expf(g[s * p.gate_s] - m);
    den += e;
    num += e * to_float(kv[s * p.kv_s]);
  }
  if (!isfinite(num) && isfinite(den)) {
    // the exp-weighted sum overflowed (|kv| near FLT_MAX / S) though the weighted mean may be finite: redo it with kv
    // scaled by 2^-k (exact), 2^k >= 4 S, and scale the mean back; only such windows take this path, so every other
    // result keeps its bits (and inf / NaN kv still give inf / NaN)
    const int k = 2 + static_cast<int>(ceil(log2(static_cast<double>(p.S))));
    num = 0.f;
    for (int64_t s = 0; s < p.S; ++s) num += expf(g[s * p.gate_s] - m) * ldexpf(to_float(kv[s * p.kv_s]), -k);
    static_cast<T*>(p.out)[idx] = from_float<T>(ldexpf(num / den, k));
    return;
  }
  static_cast<T*>(p.out)[idx] = from_float<T>(num / den);
}

}  // namespace

void launch_compressor_pool(const CompressorPoolParams& p, cudaStream_t stream) {
  const int64_t total = p.n * p.hd;
  if (total == 0) return;
  const dim3 grid(static_cast<unsigned>((total + 255) / 256));
  DEEPINFER_DISPATCH_FLOAT(p.dtype, [&] { compressor_pool_kernel<scalar_t><<<grid, 256, 0, stream>>>(p); });
  DEEPINFER_CHECK_LAUNCH("compressor_pool_kernel");
}

}  // namespace deepinfer::attention

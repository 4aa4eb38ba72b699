#include "deepinfer/rope/rotary_embedding.cuh"

namespace deepinfer::rope {
namespace {

constexpr int kNumThreads = 128;

template <typename T>
__global__ void __launch_bounds__(kNumThreads) rotary_embedding_kernel(RotaryEmbeddingParams p) {
  const int64_t t = blockIdx.x;
  const int64_t pos = p.positions_int64 ? static_cast<const int64_t*>(p.positions)[t * p.positions_stride]
                                        : static_cast<const int32_t*>(p.positions)[t * p.positions_stride];
  const bool valid = pos >= 0 && pos < p.max_position;
  const int64_t half = p.rope_dim / 2;
  const float* c = p.cos_sin + (valid ? pos : 0) * p.rope_dim;
  const float sign = p.inverse ? -1.f : 1.f;
  T* base = static_cast<T*>(p.x) + t * p.token_stride + (p.head_dim - p.rope_dim);
  for (int64_t idx = threadIdx.x; idx < p.num_heads * half; idx += kNumThreads) {
    const int64_t h = idx / half, i = idx % half;
    T* v = base + h * p.head_stride + 2 * i;
    if (!valid) {
      v[0] = from_float<T>(__int_as_float(0x7fc00000));
      v[1] = from_float<T>(__int_as_float(0x7fc00000));
      continue;
    }
    const float cosv = c[i], sinv = sign * c[half + i];
    const float x0 = to_float(v[0]), x1 = to_float(v[1]);
    v[0] = from_float<T>(x0 * cosv - x1 * sinv);
    v[1] = from_float<T>(x0 * sinv + x1 * cosv);
  }
}

}  // namespace

void launch_rotary_embedding(const RotaryEmbeddingParams& p, cudaStream_t stream) {
  if (p.num_tokens == 0 || p.num_heads == 0) return;
  DEEPINFER_DISPATCH_FLOAT(p.dtype, [&] {
    rotary_embedding_kernel<scalar_t><<<static_cast<unsigned>(p.num_tokens), kNumThreads, 0, stream>>>(p);
  });
  DEEPINFER_CHECK_LAUNCH("rotary_embedding_kernel");
}

}  // namespace deepinfer::rope

// Torch-facing CUDA entry points of the rope domain.
#include "cuda/torch_utils.h"
#include "common/rope_checks.h"
#include "deepinfer/rope/rotary_embedding.cuh"
#include "ops.h"

namespace deepinfer {

void rotary_embedding_cuda(at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos_sin_cache, bool inverse) {
  check_rotary_embedding(x, positions, cos_sin_cache);
  if (x.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  rope::RotaryEmbeddingParams p{};
  p.x = x.mutable_data_ptr();
  p.positions = positions.const_data_ptr();
  p.cos_sin = cos_sin_cache.const_data_ptr<float>();
  p.num_tokens = x.size(0);
  p.num_heads = x.dim() == 3 ? x.size(1) : 1;
  p.head_dim = x.size(-1);
  p.rope_dim = cos_sin_cache.size(1);
  p.max_position = cos_sin_cache.size(0);
  p.token_stride = x.stride(0);
  p.head_stride = x.dim() == 3 ? x.stride(1) : 0;
  p.positions_stride = positions.stride(0);
  p.dtype = to_dtype(x.scalar_type());
  p.positions_int64 = positions.scalar_type() == at::kLong;
  p.inverse = inverse;
  rope::launch_rotary_embedding(p, current_stream());
}

}  // namespace deepinfer

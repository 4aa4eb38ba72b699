// Schemas of every deepinfer op and their implementations per dispatch key.
// Conventions: preallocated outputs first and marked `Tensor!` (mutated); the CUDA stream is the
// current stream, read inside the op. Fake (meta) implementations live in
// python/deepinfer_ops/_fake.py (torch.library.register_fake), one per op.
#include <torch/library.h>

#include "ops.h"

TORCH_LIBRARY(deepinfer_ops, m) {
  // norm
  m.def("rms_norm(Tensor! out, Tensor input, Tensor? weight, float eps) -> ()");
  // quant
  m.def(
      "per_token_group_quant_fp8(Tensor! out_q, Tensor! out_scale, Tensor input, int group_size, "
      "bool scale_ue8m0) -> ()");
  // rope
  m.def("rotary_embedding(Tensor! x, Tensor positions, Tensor cos_sin_cache, bool inverse) -> ()");
}

TORCH_LIBRARY_IMPL(deepinfer_ops, CPU, m) {
  m.impl("rms_norm", &deepinfer::rms_norm_cpu);
  m.impl("per_token_group_quant_fp8", &deepinfer::per_token_group_quant_fp8_cpu);
  m.impl("rotary_embedding", &deepinfer::rotary_embedding_cpu);
}

#ifdef DEEPINFER_WITH_CUDA
TORCH_LIBRARY_IMPL(deepinfer_ops, CUDA, m) {
  m.impl("rms_norm", &deepinfer::rms_norm_cuda);
  m.impl("per_token_group_quant_fp8", &deepinfer::per_token_group_quant_fp8_cuda);
  m.impl("rotary_embedding", &deepinfer::rotary_embedding_cuda);
}
#endif

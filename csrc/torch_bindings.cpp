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
  // gemm
  m.def(
      "fp8_gemm_nt(Tensor! out, Tensor a, Tensor a_scale, Tensor b, Tensor b_scale, bool accumulate, "
      "int split_k=1) -> ()");
  m.def(
      "m_grouped_fp8_gemm_nt_contiguous(Tensor! out, Tensor a, Tensor a_scale, Tensor b, Tensor b_scale, "
      "Tensor m_indices) -> ()");
  m.def(
      "m_grouped_fp8_gemm_nt_masked(Tensor! out, Tensor a, Tensor a_scale, Tensor b, Tensor b_scale, "
      "Tensor masked_m) -> ()");
  m.def("fp4_to_fp8_blockscaled(Tensor! out_q, Tensor! out_scale, Tensor w, Tensor w_scale) -> ()");
  m.def(
      "swiglu_clamp_quant_fp8(Tensor! out_q, Tensor! out_scale, Tensor gate_up, float limit, bool scale_ue8m0) -> ()");
}

TORCH_LIBRARY_IMPL(deepinfer_ops, CPU, m) {
  m.impl("rms_norm", &deepinfer::rms_norm_cpu);
  m.impl("per_token_group_quant_fp8", &deepinfer::per_token_group_quant_fp8_cpu);
  m.impl("rotary_embedding", &deepinfer::rotary_embedding_cpu);
  m.impl("fp8_gemm_nt", &deepinfer::fp8_gemm_nt_cpu);
  m.impl("m_grouped_fp8_gemm_nt_contiguous", &deepinfer::m_grouped_fp8_gemm_nt_contiguous_cpu);
  m.impl("m_grouped_fp8_gemm_nt_masked", &deepinfer::m_grouped_fp8_gemm_nt_masked_cpu);
  m.impl("fp4_to_fp8_blockscaled", &deepinfer::fp4_to_fp8_blockscaled_cpu);
  m.impl("swiglu_clamp_quant_fp8", &deepinfer::swiglu_clamp_quant_fp8_cpu);
}

#ifdef DEEPINFER_WITH_CUDA
TORCH_LIBRARY_IMPL(deepinfer_ops, CUDA, m) {
  m.impl("rms_norm", &deepinfer::rms_norm_cuda);
  m.impl("per_token_group_quant_fp8", &deepinfer::per_token_group_quant_fp8_cuda);
  m.impl("rotary_embedding", &deepinfer::rotary_embedding_cuda);
  m.impl("fp8_gemm_nt", &deepinfer::fp8_gemm_nt_cuda);
  m.impl("m_grouped_fp8_gemm_nt_contiguous", &deepinfer::m_grouped_fp8_gemm_nt_contiguous_cuda);
  m.impl("m_grouped_fp8_gemm_nt_masked", &deepinfer::m_grouped_fp8_gemm_nt_masked_cuda);
  m.impl("swiglu_clamp_quant_fp8", &deepinfer::swiglu_clamp_quant_fp8_cuda);
}
#endif

// Torch-facing CUDA entry points of the quant domain.
#include "cuda/torch_utils.h"
#include "common/quant_checks.h"
#include "deepinfer/quant/per_token_group_quant_fp8.cuh"
#include "ops.h"

namespace deepinfer {

void per_token_group_quant_fp8_cuda(at::Tensor& out_q, at::Tensor& out_scale, const at::Tensor& input,
                                    int64_t group_size, bool scale_ue8m0) {
  auto [in2, q2] = check_per_token_group_quant_fp8(out_q, out_scale, input, group_size);
  if (in2.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(input.device());
  quant::PerTokenGroupQuantParams p{};
  p.input = in2.const_data_ptr();
  p.out_q = static_cast<uint8_t*>(q2.mutable_data_ptr());
  p.out_scale = out_scale.mutable_data_ptr<float>();
  p.rows = in2.size(0);
  p.K = in2.size(1);
  p.group_size = group_size;
  p.num_groups = ceil_div(p.K, group_size);
  p.input_row_stride = in2.stride(0);
  p.q_row_stride = q2.stride(0);
  p.scale_row_stride = out_scale.stride(0);
  p.scale_col_stride = out_scale.stride(1);
  p.dtype = to_dtype(input.scalar_type());
  p.scale_ue8m0 = scale_ue8m0;
  quant::launch_per_token_group_quant_fp8(p, current_stream());
}

}  // namespace deepinfer

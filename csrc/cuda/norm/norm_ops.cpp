// Torch-facing CUDA entry points of the norm domain: checks, then launch on the current stream.
#include "cuda/torch_utils.h"
#include "common/norm_checks.h"
#include "deepinfer/norm/rms_norm.cuh"
#include "ops.h"

namespace deepinfer {

void rms_norm_cuda(at::Tensor& out, const at::Tensor& input, const std::optional<at::Tensor>& weight, double eps) {
  auto [in2, out2] = check_rms_norm(out, input, weight, eps);
  if (in2.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(input.device());
  norm::RmsNormParams p{};
  p.input = in2.const_data_ptr();
  p.out = out2.mutable_data_ptr();
  p.weight = weight.has_value() ? weight->const_data_ptr() : nullptr;
  p.weight_fp32 = weight.has_value() && weight->scalar_type() == at::kFloat;
  p.rows = in2.size(0);
  p.hidden = in2.size(1);
  p.input_row_stride = in2.stride(0);
  p.out_row_stride = out2.stride(0);
  p.eps = static_cast<float>(eps);
  p.dtype = to_dtype(input.scalar_type());
  norm::launch_rms_norm(p, current_stream());
}

}  // namespace deepinfer

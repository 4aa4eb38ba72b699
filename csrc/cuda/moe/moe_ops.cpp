// Torch-facing CUDA entry points of the MoE domain: checks, then launch on the current stream.
#include "cuda/torch_utils.h"
#include "common/moe_checks.h"
#include "deepinfer/moe/moe_combine.cuh"
#include "ops.h"

namespace deepinfer {

void moe_combine_cuda(at::Tensor& out, const at::Tensor& y, const at::Tensor& slot_rows, const at::Tensor& weights) {
  check_moe_combine(out, y, slot_rows, weights);
  if (out.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(y.device());
  moe::MoeCombineParams p{};
  p.y = y.const_data_ptr();
  p.slot_rows = slot_rows.const_data_ptr<int64_t>();
  p.weights = weights.const_data_ptr<float>();
  p.out = out.mutable_data_ptr();
  p.tokens = slot_rows.size(0);
  p.top_k = slot_rows.size(1);
  p.hidden = y.size(1);
  p.rows = y.size(0);
  p.y_row_stride = y.stride(0);
  p.y_dtype = to_dtype(y.scalar_type());
  p.out_dtype = to_dtype(out.scalar_type());
  moe::launch_moe_combine(p, current_stream());
}

}  // namespace deepinfer

// Torch-facing CUDA entry points of the MoE domain: checks, then launch on the current stream.
#include "cuda/torch_utils.h"
#include "common/moe_checks.h"
#include "deepinfer/moe/moe_combine.cuh"
#include "deepinfer/moe/moe_permute.cuh"
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

void moe_permute_cuda(at::Tensor& m_indices, at::Tensor& token_of_row, at::Tensor& slot_rows,
                      const at::Tensor& topk_idx, int64_t num_experts) {
  const char* op = "moe_permute";
  check_moe_permute(m_indices, token_of_row, slot_rows, topk_idx, num_experts);
  DEEPINFER_CHECK(num_experts <= moe::kMoePermuteMaxExperts, op, "num_experts must be <= ",
                  moe::kMoePermuteMaxExperts, " on CUDA, got ", num_experts);
  DEEPINFER_CHECK(topk_idx.numel() <= moe::kMoePermuteMaxRows, op, "topk_idx must have < 2^31 elements on CUDA");
  if (topk_idx.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(topk_idx.device());
  moe::MoePermuteParams p{};
  p.topk_idx = topk_idx.const_data_ptr();
  p.idx_int64 = topk_idx.scalar_type() == at::kLong;
  p.m_indices = m_indices.mutable_data_ptr<int32_t>();
  p.token_of_row = token_of_row.mutable_data_ptr<int64_t>();
  p.slot_rows = slot_rows.mutable_data_ptr<int64_t>();
  p.rows = topk_idx.numel();
  p.top_k = topk_idx.size(1);
  p.num_experts = num_experts;
  moe::launch_moe_permute(p, current_stream());
}

}  // namespace deepinfer

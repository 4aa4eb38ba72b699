// Torch-facing CUDA entry points of the sampling domain: checks, then launch on the current stream.
#include "common/sampling_checks.h"
#include "cuda/torch_utils.h"
#include "deepinfer/sampling/logsumexp_rows.cuh"
#include "ops.h"

namespace deepinfer {

void logsumexp_rows_cuda(at::Tensor& out, const at::Tensor& x) {
  check_logsumexp_rows(out, x);
  if (out.numel() == 0) return;
  DEEPINFER_CHECK(x.size(0) <= 2147483647, "logsumexp_rows", "x has ", x.size(0), " rows, at most 2^31 - 1 on CUDA");
  const c10::cuda::CUDAGuard guard(x.device());
  sampling::LogsumexpRowsParams p{};
  p.x = x.const_data_ptr<float>();
  p.out = out.mutable_data_ptr<float>();
  p.rows = x.size(0);
  p.V = x.size(1);
  p.x_row_stride = x.stride(0);
  sampling::launch_logsumexp_rows(p, current_stream());
}

}  // namespace deepinfer

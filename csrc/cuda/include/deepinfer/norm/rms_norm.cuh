// rms_norm device code. One CTA per row, kNumThreads fixed, so the reduction order of a row never
// depends on the number of rows (batch-invariant by construction).
#pragma once

#include "deepinfer/common.cuh"

namespace deepinfer::norm {

struct RmsNormParams {
  const void* input;   // [rows, hidden], row stride input_row_stride (elements), last dim contiguous
  void* out;           // [rows, hidden], row stride out_row_stride
  const void* weight;  // [hidden] or nullptr; dtype weight_fp32 ? fp32 : dtype
  int64_t rows, hidden, input_row_stride, out_row_stride;
  float eps;
  DType dtype;
  bool weight_fp32;
};

void launch_rms_norm(const RmsNormParams& p, cudaStream_t stream);

}  // namespace deepinfer::norm

// per_token_group_quant_fp8 device code: one warp per (row, group); amax -> scale (optionally rounded
// up to a power of two, UE8M0) -> e4m3 with round-to-nearest-even and saturation at +-448.
#pragma once

#include "deepinfer/common.cuh"

namespace deepinfer::quant {

struct PerTokenGroupQuantParams {
  const void* input;  // [rows, K], row stride input_row_stride (elements), last dim contiguous
  uint8_t* out_q;     // [rows, K] float8_e4m3fn bytes, row stride q_row_stride
  float* out_scale;   // [rows, num_groups] fp32 at out_scale[r * scale_row_stride + g * scale_col_stride]
  int64_t rows, K, group_size, num_groups;
  int64_t input_row_stride, q_row_stride, scale_row_stride, scale_col_stride;
  DType dtype;
  bool scale_ue8m0;
};

void launch_per_token_group_quant_fp8(const PerTokenGroupQuantParams& p, cudaStream_t stream);

}  // namespace deepinfer::quant

// swiglu_clamp_quant_fp8 device code: h = silu(min(gate, limit)) * clamp(up, -limit, limit) in fp32, then
// per-128 group FP8 e4m3 quantisation of h (same recipe as per_token_group_quant_fp8). One warp per (row, group).
#pragma once

#include "deepinfer/common.cuh"

namespace deepinfer::gemm {

struct SwigluClampQuantParams {
  const void* gate_up;  // [rows, 2 * I]: gate = [:, :I], up = [:, I:]; row stride in_row_stride (elements)
  uint8_t* out_q;       // [rows, I] float8_e4m3fn bytes, row stride q_row_stride
  float* out_scale;     // [rows, num_groups] at out_scale[r * scale_row_stride + g * scale_col_stride]
  int64_t rows, I, num_groups;
  int64_t in_row_stride, q_row_stride, scale_row_stride, scale_col_stride;
  float limit;
  DType dtype;
  bool scale_ue8m0;
};

void launch_swiglu_clamp_quant_fp8(const SwigluClampQuantParams& p, cudaStream_t stream);

}  // namespace deepinfer::gemm

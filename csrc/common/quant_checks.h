#pragma once

#include "common/checks.h"

namespace deepinfer {

constexpr float kFp8E4m3Max = 448.0f;
// amax floor so an all-zero group gets a finite, non-zero scale (as in vLLM's quantisers).
constexpr float kQuantAmaxEps = 1e-10f;

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// per_token_group_quant_fp8(out_q, out_scale, input, group_size, scale_ue8m0):
// input [..., K] (fp32/bf16/fp16), out_q same shape float8_e4m3fn, out_scale fp32 [rows, ceil(K/group_size)]
// with any strides (row-major [rows, G] or column-major, i.e. a transposed [G, rows] buffer).
// Returns (input2d, out_q2d).
inline std::pair<at::Tensor, at::Tensor> check_per_token_group_quant_fp8(const at::Tensor& out_q,
                                                                         const at::Tensor& out_scale,
                                                                         const at::Tensor& input, int64_t group_size) {
  const char* op = "per_token_group_quant_fp8";
  DEEPINFER_CHECK(is_float_activation(input.scalar_type()), op,
                  "input must be float32, bfloat16 or float16, got ", dtype_name(input.scalar_type()));
  DEEPINFER_CHECK(group_size > 0, op, "group_size must be > 0, got ", group_size);
  check_dtype(op, out_q, "out_q", at::kFloat8_e4m3fn);
  check_dtype(op, out_scale, "out_scale", at::kFloat);
  DEEPINFER_CHECK(out_q.sizes() == input.sizes(), op, "out_q shape ", out_q.sizes(), " != input shape ",
                  input.sizes());
  check_same_device(op, out_q, "out_q", input, "input");
  check_writable(op, out_q, "out_q");
  check_writable(op, out_scale, "out_scale");
  check_same_device(op, out_scale, "out_scale", input, "input");
  auto in2 = as_rows(op, input, "input");
  auto q2 = as_rows(op, out_q, "out_q");
  const int64_t rows = in2.size(0), groups = ceil_div(in2.size(1), group_size);
  DEEPINFER_CHECK(out_scale.dim() == 2 && out_scale.size(0) == rows && out_scale.size(1) == groups, op,
                  "out_scale must be [", rows, ", ", groups, "] (rows, ceil(K / group_size)), got ", out_scale.sizes());
  return {in2, q2};
}

}  // namespace deepinfer

#pragma once

#include "common/checks.h"

namespace deepinfer {

// rms_norm(out, input, weight, eps): input/out [..., hidden] same shape and dtype; weight [hidden] of the
// input dtype or fp32; returns (input2d, out2d) views [rows, hidden].
inline std::pair<at::Tensor, at::Tensor> check_rms_norm(const at::Tensor& out, const at::Tensor& input,
                                                        const std::optional<at::Tensor>& weight, double eps) {
  const char* op = "rms_norm";
  DEEPINFER_CHECK(is_float_activation(input.scalar_type()), op, "input must be float32, bfloat16 or float16, got ",
                  dtype_name(input.scalar_type()));
  DEEPINFER_CHECK(out.sizes() == input.sizes(), op, "out shape ", out.sizes(), " != input shape ", input.sizes());
  DEEPINFER_CHECK(out.scalar_type() == input.scalar_type(), op, "out dtype ", dtype_name(out.scalar_type()), " != input dtype ",
                  dtype_name(input.scalar_type()));
  check_same_device(op, out, "out", input, "input");
  check_writable(op, out, "out");
  check_no_partial_overlap(op, out, "out", input, "input", /*allow_in_place=*/true);
  DEEPINFER_CHECK(eps >= 0.0, op, "eps must be >= 0, got ", eps);
  if (weight.has_value()) {
    const auto& w = *weight;
    DEEPINFER_CHECK(w.dim() == 1 && w.size(0) == input.size(-1), op, "weight must be [", input.size(-1), "], got ",
                    w.sizes());
    DEEPINFER_CHECK(w.scalar_type() == input.scalar_type() || w.scalar_type() == at::kFloat, op,
                    "weight dtype must be float32 or the input dtype (", dtype_name(input.scalar_type()), "), got ",
                    dtype_name(w.scalar_type()));
    DEEPINFER_CHECK(w.stride(0) == 1 || w.size(0) <= 1, op, "weight must be contiguous");
    check_same_device(op, w, "weight", input, "input");
  }
  return {as_rows(op, input, "input"), as_rows(op, out, "out")};
}

}  // namespace deepinfer

#pragma once

#include "common/checks.h"

namespace deepinfer {

// moe_combine(out, y, slot_rows, weights): y [R, hidden] (last dim contiguous, any row stride), slot_rows [T, k]
// int64 (a row of y per slot; -1 or any id outside [0, R) = no expert), weights [T, k] float32, out [T, hidden]
// contiguous, float32 / bfloat16 / float16.
inline void check_moe_combine(const at::Tensor& out, const at::Tensor& y, const at::Tensor& slot_rows,
                              const at::Tensor& weights) {
  const char* op = "moe_combine";
  DEEPINFER_CHECK(is_float_activation(y.scalar_type()), op, "y must be float32, bfloat16 or float16, got ",
                  dtype_name(y.scalar_type()));
  DEEPINFER_CHECK(y.dim() == 2, op, "y must be [rows, hidden], got ", y.sizes());
  DEEPINFER_CHECK(y.size(1) <= 1 || y.stride(1) == 1, op, "y must be contiguous in its last dim, got strides ",
                  y.strides());
  check_dtype(op, slot_rows, "slot_rows", at::kLong);
  DEEPINFER_CHECK(slot_rows.dim() == 2, op, "slot_rows must be [tokens, top_k], got ", slot_rows.sizes());
  DEEPINFER_CHECK(slot_rows.is_contiguous(), op, "slot_rows must be contiguous, got strides ", slot_rows.strides());
  check_dtype(op, weights, "weights", at::kFloat);
  DEEPINFER_CHECK(weights.sizes() == slot_rows.sizes(), op, "weights shape ", weights.sizes(),
                  " != slot_rows shape ", slot_rows.sizes());
  DEEPINFER_CHECK(weights.is_contiguous(), op, "weights must be contiguous, got strides ", weights.strides());
  DEEPINFER_CHECK(is_float_activation(out.scalar_type()), op, "out must be float32, bfloat16 or float16, got ",
                  dtype_name(out.scalar_type()));
  DEEPINFER_CHECK(out.dim() == 2 && out.size(0) == slot_rows.size(0) && out.size(1) == y.size(1), op, "out must be [",
                  slot_rows.size(0), ", ", y.size(1), "], got ", out.sizes());
  DEEPINFER_CHECK(out.is_contiguous(), op, "out must be contiguous, got strides ", out.strides());
  check_same_device(op, y, "y", slot_rows, "slot_rows");
  check_same_device(op, weights, "weights", y, "y");
  check_same_device(op, out, "out", y, "y");
  check_writable(op, out, "out");
  check_disjoint(op, out, "out", y, "y");
  check_disjoint(op, out, "out", slot_rows, "slot_rows");
  check_disjoint(op, out, "out", weights, "weights");
}

}  // namespace deepinfer

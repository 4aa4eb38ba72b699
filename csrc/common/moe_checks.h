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

// moe_permute(m_indices, token_of_row, slot_rows, topk_idx, num_experts): topk_idx [T, k] int32 / int64, contiguous;
// m_indices [T*k] int32, token_of_row [T*k] int64, slot_rows [T, k] int64, all contiguous, on topk_idx's device.
inline void check_moe_permute(const at::Tensor& m_indices, const at::Tensor& token_of_row, const at::Tensor& slot_rows,
                              const at::Tensor& topk_idx, int64_t num_experts) {
  const char* op = "moe_permute";
  DEEPINFER_CHECK(topk_idx.scalar_type() == at::kInt || topk_idx.scalar_type() == at::kLong, op,
                  "topk_idx must be int32 or int64, got ", dtype_name(topk_idx.scalar_type()));
  DEEPINFER_CHECK(topk_idx.dim() == 2, op, "topk_idx must be [tokens, top_k], got ", topk_idx.sizes());
  DEEPINFER_CHECK(topk_idx.is_contiguous(), op, "topk_idx must be contiguous, got strides ", topk_idx.strides());
  DEEPINFER_CHECK(num_experts >= 0 && num_experts < (1ll << 31), op, "num_experts must be in [0, 2^31), got ",
                  num_experts);
  const int64_t rows = topk_idx.numel();
  check_dtype(op, m_indices, "m_indices", at::kInt);
  check_dtype(op, token_of_row, "token_of_row", at::kLong);
  check_dtype(op, slot_rows, "slot_rows", at::kLong);
  DEEPINFER_CHECK(m_indices.dim() == 1 && m_indices.size(0) == rows, op, "m_indices must be [", rows, "], got ",
                  m_indices.sizes());
  DEEPINFER_CHECK(token_of_row.dim() == 1 && token_of_row.size(0) == rows, op, "token_of_row must be [", rows,
                  "], got ", token_of_row.sizes());
  DEEPINFER_CHECK(slot_rows.sizes() == topk_idx.sizes(), op, "slot_rows shape ", slot_rows.sizes(),
                  " != topk_idx shape ", topk_idx.sizes());
  const auto check_out = [&](const at::Tensor& t, const char* name) {
    DEEPINFER_CHECK(t.is_contiguous(), op, name, " must be contiguous, got strides ", t.strides());
    check_same_device(op, t, name, topk_idx, "topk_idx");
    check_writable(op, t, name);
    check_disjoint(op, t, name, topk_idx, "topk_idx");
  };
  check_out(m_indices, "m_indices");
  check_out(token_of_row, "token_of_row");
  check_out(slot_rows, "slot_rows");
  check_disjoint(op, m_indices, "m_indices", token_of_row, "token_of_row");
  check_disjoint(op, m_indices, "m_indices", slot_rows, "slot_rows");
  check_disjoint(op, token_of_row, "token_of_row", slot_rows, "slot_rows");
}

}  // namespace deepinfer

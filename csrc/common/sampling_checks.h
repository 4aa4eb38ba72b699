#pragma once

#include "common/checks.h"

namespace deepinfer {

// logsumexp_rows(out, x): x [n, V] float32 (last dim contiguous, any row stride), out [n] float32 contiguous.
inline void check_logsumexp_rows(const at::Tensor& out, const at::Tensor& x) {
  const char* op = "logsumexp_rows";
  check_dtype(op, x, "x", at::kFloat);
  DEEPINFER_CHECK(x.dim() == 2, op, "x must be [rows, V], got ", x.sizes());
  DEEPINFER_CHECK(x.size(1) <= 1 || x.stride(1) == 1, op, "x must be contiguous in its last dim, got strides ",
                  x.strides());
  check_dtype(op, out, "out", at::kFloat);
  DEEPINFER_CHECK(out.dim() == 1 && out.size(0) == x.size(0), op, "out must be [", x.size(0), "], got ", out.sizes());
  DEEPINFER_CHECK(out.is_contiguous(), op, "out must be contiguous, got strides ", out.strides());
  check_same_device(op, out, "out", x, "x");
  check_writable(op, out, "out");
  check_disjoint(op, out, "out", x, "x");
}

}  // namespace deepinfer

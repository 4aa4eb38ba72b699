#pragma once

#include "common/checks.h"

namespace deepinfer {

// rotary_embedding(x, positions, cos_sin_cache, inverse): x [num_tokens, head_dim] or
// [num_tokens, num_heads, head_dim] (last dim contiguous), positions [num_tokens] int64/int32,
// cos_sin_cache fp32 [max_position, rope_dim] (cos | sin halves), rope_dim even and <= head_dim.
inline void check_rotary_embedding(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& cache) {
  const char* op = "rotary_embedding";
  DEEPINFER_CHECK(is_float_activation(x.scalar_type()), op, "x must be float32, bfloat16 or float16, got ",
                  dtype_name(x.scalar_type()));
  DEEPINFER_CHECK(x.dim() == 2 || x.dim() == 3, op, "x must be [num_tokens, head_dim] or [num_tokens, num_heads, head_dim], got ",
                  x.sizes());
  DEEPINFER_CHECK(x.numel() == 0 || x.stride(-1) == 1, op, "x must be contiguous in its last dim, got strides ", x.strides());
  DEEPINFER_CHECK(positions.dim() == 1 && positions.size(0) == x.size(0), op, "positions must be [", x.size(0),
                  "], got ", positions.sizes());
  DEEPINFER_CHECK(positions.scalar_type() == at::kLong || positions.scalar_type() == at::kInt, op,
                  "positions must be int64 or int32, got ", dtype_name(positions.scalar_type()));
  check_dtype(op, cache, "cos_sin_cache", at::kFloat);
  DEEPINFER_CHECK(cache.dim() == 2 && cache.is_contiguous(), op, "cos_sin_cache must be a contiguous [max_position, rope_dim], got ",
                  cache.sizes());
  const int64_t rope_dim = cache.size(1);
  DEEPINFER_CHECK(rope_dim % 2 == 0 && rope_dim > 0 && rope_dim <= x.size(-1), op, "rope_dim (cos_sin_cache.size(1) = ",
                  rope_dim, ") must be even, > 0 and <= head_dim ", x.size(-1));
  check_same_device(op, positions, "positions", x, "x");
  check_writable(op, x, "x");
  check_same_device(op, cache, "cos_sin_cache", x, "x");
}

}  // namespace deepinfer

// Argument checks of the engine's host-work ops (CPU int64 tensors only).
#pragma once

#include <ATen/ATen.h>

#include "common/checks.h"

namespace deepinfer {

inline void check_host_i64(const char* op, const at::Tensor& t, const char* name, int64_t dim) {
  DEEPINFER_CHECK(t.device().is_cpu(), op, name, " must be a CPU tensor");
  DEEPINFER_CHECK(t.scalar_type() == at::kLong, op, name, " must be int64");
  DEEPINFER_CHECK(t.dim() == dim, op, name, " must be ", dim, "-D, got ", t.dim(), "-D");
}

}  // namespace deepinfer

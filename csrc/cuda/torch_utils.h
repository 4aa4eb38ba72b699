// Torch-facing helpers for the CUDA launchers (csrc/cuda/<domain>/*_ops.cpp): dtype tags, stream, guard.
#pragma once

#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>

#include "common/checks.h"
#include "deepinfer/common.cuh"

namespace deepinfer {

inline DType to_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return DType::kFloat32;
    case at::kBFloat16: return DType::kBFloat16;
    case at::kHalf: return DType::kFloat16;
    default: TORCH_CHECK(false, "deepinfer_ops: unsupported dtype ", t);
  }
}

inline cudaStream_t current_stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

}  // namespace deepinfer

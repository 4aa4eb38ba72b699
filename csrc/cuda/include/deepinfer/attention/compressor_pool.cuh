// compressor_pool device code: one thread per (window, dim), the window's slots in slot order, float32.
// A window's arithmetic depends on its own slots only: batch-invariant by construction.
#pragma once

#include "deepinfer/common.cuh"

namespace deepinfer::attention {

struct CompressorPoolParams {
  const void* kv;     // [n, S, hd], strides kv_n / kv_s (elements), last dim contiguous
  const float* gate;  // [n, S, hd], strides gate_n / gate_s, last dim contiguous
  void* out;          // [n, hd] contiguous, kv's dtype
  int64_t n, S, hd, kv_n, kv_s, gate_n, gate_s;
  DType dtype;
};

void launch_compressor_pool(const CompressorPoolParams& p, cudaStream_t stream);

}  // namespace deepinfer::attention

// moe_combine device code: out[t] = sum_j weights[t, j] * y[slot_rows[t, j]] in slot order, float32, one rounding.
// A token's arithmetic depends only on its own slots: batch-invariant by construction.
#pragma once

#include "deepinfer/common.cuh"

namespace deepinfer::moe {

struct MoeCombineParams {
  const void* y;             // [rows, hidden], row stride y_row_stride (elements)
  const int64_t* slot_rows;  // [tokens, top_k]; outside [0, rows) = no expert
  const float* weights;      // [tokens, top_k]
  void* out;                 // [tokens, hidden] contiguous
  int64_t tokens, top_k, hidden, rows, y_row_stride;
  DType y_dtype, out_dtype;
};

void launch_moe_combine(const MoeCombineParams& p, cudaStream_t stream);

}  // namespace deepinfer::moe

// logsumexp_rows device code: one CTA per row, a fixed element-to-thread map and a fixed reduction tree, so a row's
// result depends on its values only (batch-invariant by construction).
#pragma once

#include "deepinfer/common.cuh"

namespace deepinfer::sampling {

struct LogsumexpRowsParams {
  const float* x;  // [rows, V], row stride x_row_stride (elements)
  float* out;      // [rows]
  int64_t rows, V, x_row_stride;
};

void launch_logsumexp_rows(const LogsumexpRowsParams& p, cudaStream_t stream);

}  // namespace deepinfer::sampling

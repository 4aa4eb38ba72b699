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

// Row r of all = cat(ring[ring_src], new) (see common/attention_checks.h): ring row ring_src[r] for r < n_ring,
// else new row r - n_ring.
struct CompressorRows {
  const void *ring_kv, *ring_gate;  // [ring_slots, C] contiguous
  const void *new_kv, *new_gate;    // [new_rows, C], row strides new_kv_ld / new_gate_ld (elements)
  const int64_t* ring_src;          // [n_ring]
  int64_t ring_slots, new_rows, new_kv_ld, new_gate_ld, n_ring, C;
  DType dtype;
};

struct CompressorPoolRowsParams {
  CompressorRows rows;
  const float* ape;                                  // [m, C]
  const int64_t *cur, *prev, *prev_ok, *dst;         // [n, m], [n, m] or null, [n] or null, [n]
  void* out;                                         // [n, hd]
  int64_t n, m, hd;
};

struct CompressorStateWriteParams {
  CompressorRows rows;
  void *ring_kv, *ring_gate;  // the rings written (the same tensors as rows.ring_*)
  const int64_t *st_src, *st_dst;
  int64_t n_st;
};

void launch_compressor_pool_rows(const CompressorPoolRowsParams& p, cudaStream_t stream);
void launch_compressor_state_write(const CompressorStateWriteParams& p, cudaStream_t stream);

}  // namespace deepinfer::attention

// Pieces shared by the topk_rows CUDA paths (topk.cu: multi-CTA radix; topk_row.cu: keys in shared memory).
// Private to csrc/cuda/attention.
#pragma once

#include "deepinfer/attention/sparse_mqa.cuh"

namespace deepinfer::attention::topk_detail {

// The rows and outputs of a topk_rows launch, as both paths' kernels see them.
struct TopkRows {
  const float* scores;
  int64_t score_row_stride;
  float* values;
  int64_t* indices;
  int64_t row0;  // first row of this group
  int n, k;
  bool vec;      // every row 16-byte aligned: float4 loads
};

inline TopkRows topk_rows_of(const TopkParams& p) {
  TopkRows r{};
  r.scores = p.scores;
  r.score_row_stride = p.score_row_stride;
  r.values = p.values;
  r.indices = p.indices;
  r.n = p.n;
  r.k = p.k;
  r.vec = is_aligned(p.scores, 16) && p.score_row_stride % 4 == 0;
  return r;
}

// Order-preserving map of a float to uint32 (larger float -> larger key); NaN is the largest, -0.0 == +0.0.
__device__ __forceinline__ uint32_t topk_key(float x) {
  if (isnan(x)) return 0xffffffffu;
  if (x == 0.f) x = 0.f;
  const uint32_t b = __float_as_uint(x);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// Descending order of this value is (key desc, index asc); every real entry is > 0 (topk_key(-inf) > 0).
__device__ __forceinline__ uint64_t sel_entry(uint32_t key, int index) {
  return (static_cast<uint64_t>(key) << 32) | static_cast<uint64_t>(~static_cast<uint32_t>(index));
}

__device__ __forceinline__ int warp_inclusive_scan(int v, int lane) {
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const int y = __shfl_up_sync(0xffffffffu, v, off);
    if (lane >= off) v += y;
  }
  return v;
}

// Warp-aggregated append: lanes with `take` get consecutive slots from *counter (in lane order) and write `entry`
// there (slots >= cap are dropped: never reached, the counts are exact). Call from all 32 lanes.
__device__ __forceinline__ void warp_append(bool take, uint64_t entry, int* counter, uint64_t* buf, int cap,
                                            int lane) {
  const unsigned ballot = __ballot_sync(0xffffffffu, take);
  if (ballot == 0u) return;  // warp-uniform
  const int leader = __ffs(ballot) - 1;
  int base = 0;
  if (lane == leader) base = atomicAdd(counter, __popc(ballot));
  base = __shfl_sync(0xffffffffu, base, leader);
  const int slot = base + __popc(ballot & ((1u << lane) - 1u));
  if (take && slot < cap) buf[slot] = entry;
}

// h[bin] += 1 for each lane with take (warp-uniform call). Lanes sharing a bin with the round's first taking lane add
// once through it (two rounds), the rest one by one: a radix pass's keys crowd into a few bins (scores share an
// exponent byte; ReLU scores are half zeros), and shared atomics on one address serialise.
__device__ __forceinline__ void warp_hist_add(int* h, bool take, uint32_t bin, int lane) {
#pragma unroll
  for (int round = 0; round < 2; ++round) {
    const unsigned active = __ballot_sync(0xffffffffu, take);
    if (active == 0u) return;  // warp-uniform
    const int leader = __ffs(active) - 1;
    const uint32_t lead_bin = __shfl_sync(0xffffffffu, bin, leader);
    const unsigned same = __ballot_sync(0xffffffffu, take && bin == lead_bin);
    if (lane == leader) atomicAdd(&h[lead_bin], __popc(same));
    take = take && bin != lead_bin;
  }
  if (take) atomicAdd(&h[bin], 1);
}

// Where the keys fit in shared memory (topk_row.cu): one CTA per row, or per chunk of a row then one merge CTA
// per row. Whether p takes that path, and the workspace it needs then (bytes, 16-byte aligned); the launch
// returns false, launching nothing, where it does not.
bool topk_chunked_fits(const TopkParams& p, int64_t* workspace_bytes);
// Short rows with a small k (n <= 1024, k <= 32): one warp per row, no workspace (topk_row.cu).
bool topk_warp_fits(const TopkParams& p);
bool launch_topk_warp(const TopkParams& p, cudaStream_t stream);
bool launch_topk_chunked(const TopkParams& p, cudaStream_t stream);

}  // namespace deepinfer::attention::topk_detail

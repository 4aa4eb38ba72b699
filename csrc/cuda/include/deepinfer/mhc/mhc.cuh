// mHC (manifold-constrained hyper-connection) device code of DeepSeek-V4. Every token is computed on its own with a
// reduction order fixed by the op's shapes (K, M, hc), never by the number of tokens: batch-invariant by construction.
#pragma once

#include "deepinfer/common.cuh"

namespace deepinfer::mhc {

inline constexpr int kMaxMix = 32;     // hc_mix outputs per token
inline constexpr int kMaxStreams = 8;  // streams per token
inline constexpr int64_t kHcMixPartK = 256;  // hc_mix: K is cut into parts of this many columns (one CTA row each)
inline constexpr int64_t kHcMixMaxK = 65535 * kHcMixPartK;  // at most 65535 parts (gridDim.y)

struct HcMixParams {
  const void* x;     // [tokens, k], row stride x_row_stride (elements), last dim contiguous
  const float* fn;   // [m, k] contiguous
  float* out;        // [tokens, m] contiguous
  int64_t tokens, k, x_row_stride;
  int m;
  float eps;
  DType dtype;
};

struct HcStreamParams {
  const void* streams;  // [tokens, hc, hidden] contiguous
  const void* x;        // hc_post: [tokens, hidden] contiguous
  const float* pre;     // hc_collapse: [tokens, hc]; hc_post: post [tokens, hc]
  const float* comb;    // hc_post: [tokens, hc, hc]
  void* out;            // hc_collapse: [tokens, hidden]; hc_post: [tokens, hc, hidden] (may be streams)
  int64_t tokens, hidden;
  int hc;
  DType dtype;
};

// float32 scratch hc_mix needs for p (tokens, k, m set): one partial per kHcMixPartK-wide part of K, token and
// output + 1
int64_t hc_mix_workspace_floats(const HcMixParams& p);
void launch_hc_mix(const HcMixParams& p, float* workspace, cudaStream_t stream);
struct HcWeightsParams {
  const float* mix;    // [tokens, 2 hc + hc^2]
  const float* base;   // [2 hc + hc^2]
  const float* scale;  // [3]
  float* pre;          // [tokens, hc]
  float* post;         // [tokens, hc]
  float* comb;         // [tokens, hc, hc]
  int64_t tokens;
  int hc, sinkhorn_iters;
  float eps;
};

void launch_hc_weights(const HcWeightsParams& p, cudaStream_t stream);
void launch_hc_collapse(const HcStreamParams& p, cudaStream_t stream);
void launch_hc_post(const HcStreamParams& p, cudaStream_t stream);

}  // namespace deepinfer::mhc

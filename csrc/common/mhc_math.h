// Per-token mHC weight math shared by the CPU and CUDA implementations of hc_weights (host and device code,
// no torch): one token's pre / post / Sinkhorn-normalised comb from its mixing coefficients, float32, in a fixed
// order of operations.
#pragma once

#include <cmath>

#if defined(__CUDACC__)
#define DEEPINFER_HD __host__ __device__ __forceinline__
#else
#define DEEPINFER_HD inline
#endif

namespace deepinfer::mhc_math {

inline constexpr int kMaxHc = 8;

DEEPINFER_HD float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// mix [2 hc + hc^2], base [2 hc + hc^2], scale [3] -> pre [hc], post [hc], comb [hc * hc] (row i = old stream i).
//   pre  = sigmoid(mix[:hc] * scale[0] + base[:hc]) + eps
//   post = 2 sigmoid(mix[hc:2hc] * scale[1] + base[hc:2hc])
//   comb = softmax_j(mix[2hc:] * scale[2] + base[2hc:]) + eps, then comb /= (column sum + eps), then
//          (sinkhorn_iters - 1) times (none for 0 or 1): comb /= (row sum + eps); comb /= (column sum + eps)
// Sums run in index order. HC > 0: the stream count at compile time (the matrix stays in registers on the GPU);
// HC = 0: `hc` at run time (up to kMaxHc). Both give the same result for the same hc.
template <int HC>
DEEPINFER_HD void hc_weights_token_n(const float* mix, const float* base, const float* scale, int hc_rt, float eps,
                                     int sinkhorn_iters, float* pre, float* post, float* comb) {
  const int hc = HC > 0 ? HC : hc_rt;
  constexpr int kDim = HC > 0 ? HC : kMaxHc;
#if defined(__CUDACC__)
#pragma unroll
#endif
  for (int i = 0; i < hc; ++i) {
    pre[i] = sigmoid(mix[i] * scale[0] + base[i]) + eps;
    post[i] = 2.0f * sigmoid(mix[hc + i] * scale[1] + base[hc + i]);
  }
  float c[kDim][kDim];
#if defined(__CUDACC__)
#pragma unroll
#endif
  for (int i = 0; i < hc; ++i) {
    float mx = -INFINITY;
    for (int j = 0; j < hc; ++j) {
      c[i][j] = mix[2 * hc + i * hc + j] * scale[2] + base[2 * hc + i * hc + j];
      mx = c[i][j] > mx ? c[i][j] : mx;
    }
    float sum = 0.0f;
    for (int j = 0; j < hc; ++j) {
      c[i][j] = expf(c[i][j] - mx);
      sum += c[i][j];
    }
    for (int j = 0; j < hc; ++j) c[i][j] = c[i][j] / sum + eps;
  }
  for (int it = 0; it < (sinkhorn_iters > 1 ? sinkhorn_iters : 1); ++it) {
    if (it > 0) {
#if defined(__CUDACC__)
#pragma unroll
#endif
      for (int i = 0; i < hc; ++i) {
        float sum = 0.0f;
        for (int j = 0; j < hc; ++j) sum += c[i][j];
        for (int j = 0; j < hc; ++j) c[i][j] = c[i][j] / (sum + eps);
      }
    }
#if defined(__CUDACC__)
#pragma unroll
#endif
    for (int j = 0; j < hc; ++j) {
      float sum = 0.0f;
      for (int i = 0; i < hc; ++i) sum += c[i][j];
      for (int i = 0; i < hc; ++i) c[i][j] = c[i][j] / (sum + eps);
    }
  }
#if defined(__CUDACC__)
#pragma unroll
#endif
  for (int i = 0; i < hc; ++i)
    for (int j = 0; j < hc; ++j) comb[i * hc + j] = c[i][j];
}

DEEPINFER_HD void hc_weights_token(const float* mix, const float* base, const float* scale, int hc, float eps,
                                   int sinkhorn_iters, float* pre, float* post, float* comb) {
  switch (hc) {
    case 1: hc_weights_token_n<1>(mix, base, scale, hc, eps, sinkhorn_iters, pre, post, comb); break;
    case 2: hc_weights_token_n<2>(mix, base, scale, hc, eps, sinkhorn_iters, pre, post, comb); break;
    case 3: hc_weights_token_n<3>(mix, base, scale, hc, eps, sinkhorn_iters, pre, post, comb); break;
    case 4: hc_weights_token_n<4>(mix, base, scale, hc, eps, sinkhorn_iters, pre, post, comb); break;
    default: hc_weights_token_n<0>(mix, base, scale, hc, eps, sinkhorn_iters, pre, post, comb); break;
  }
}

}  // namespace deepinfer::mhc_math

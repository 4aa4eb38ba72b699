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
// Sums run in index order.
DEEPINFER_HD void hc_weights_token(const float* mix, const float* base, const float* scale, int hc, float eps,
                                   int sinkhorn_iters, float* pre, float* post, float* comb) {
  for (int i = 0; i < hc; ++i) {
    pre[i] = sigmoid(mix[i] * scale[0] + base[i]) + eps;
    post[i] = 2.0f * sigmoid(mix[hc + i] * scale[1] + base[hc + i]);
  }
  float c[kMaxHc][kMaxHc];
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
      for (int i = 0; i < hc; ++i) {
        float sum = 0.0f;
        for (int j = 0; j < hc; ++j) sum += c[i][j];
        for (int j = 0; j < hc; ++j) c[i][j] = c[i][j] / (sum + eps);
      }
    }
    for (int j = 0; j < hc; ++j) {
      float sum = 0.0f;
      for (int i = 0; i < hc; ++i) sum += c[i][j];
      for (int i = 0; i < hc; ++i) c[i][j] = c[i][j] / (sum + eps);
    }
  }
  for (int i = 0; i < hc; ++i)
    for (int j = 0; j < hc; ++j) comb[i * hc + j] = c[i][j];
}

}  // namespace deepinfer::mhc_math

// CPU mHC ops: one token at a time, float32 accumulation in a fixed order (8 interleaved partial sums combined
// pairwise for the K-long dot products; stream order for the stream sums), so a token's result never depends on how
// many tokens are in the batch.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <cmath>

#include "common/mhc_checks.h"
#include "common/mhc_math.h"
#include "ops.h"

namespace deepinfer {
namespace {

// sum_k a(k) * b(k) over k < n, 8 interleaved partial sums combined pairwise.
template <typename A, typename B>
float dot8(const A* a, const B* b, int64_t n) {
  float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int j = 0; j < 8; ++j) acc[j] += static_cast<float>(a[i + j]) * static_cast<float>(b[i + j]);
  }
  for (int j = 0; i < n; ++i, ++j) acc[j] += static_cast<float>(a[i]) * static_cast<float>(b[i]);
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

template <typename T>
void hc_mix_rows(at::Tensor& out, const at::Tensor& x, const at::Tensor& fn, float eps) {
  const int64_t T_ = x.size(0), K = x.size(1), M = fn.size(0), stride = x.stride(0);
  const T* xp = x.const_data_ptr<T>();
  const float* w = fn.const_data_ptr<float>();
  float* o = out.mutable_data_ptr<float>();
  at::parallel_for(0, T_, 4, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* row = xp + t * stride;
      const float inv = 1.0f / std::sqrt(dot8(row, row, K) / static_cast<float>(K) + eps);
      for (int64_t m = 0; m < M; ++m) o[t * M + m] = dot8(row, w + m * K, K) * inv;
    }
  });
}

template <typename T>
void hc_collapse_rows(at::Tensor& out, const at::Tensor& streams, const at::Tensor& pre) {
  const int64_t T_ = streams.size(0), hc = streams.size(1), D = streams.size(2);
  const T* s = streams.const_data_ptr<T>();
  const float* p = pre.const_data_ptr<float>();
  T* o = out.mutable_data_ptr<T>();
  at::parallel_for(0, T_, 4, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* st = s + t * hc * D;
      const float* pt = p + t * hc;
      for (int64_t d = 0; d < D; ++d) {
        float acc = pt[0] * static_cast<float>(st[d]);
        for (int64_t i = 1; i < hc; ++i) acc += pt[i] * static_cast<float>(st[i * D + d]);
        o[t * D + d] = static_cast<T>(acc);
      }
    }
  });
}

template <typename T>
void hc_post_rows(at::Tensor& out, const at::Tensor& streams, const at::Tensor& x, const at::Tensor& post,
                  const at::Tensor& comb) {
  const int64_t T_ = streams.size(0), hc = streams.size(1), D = streams.size(2);
  const T* s = streams.const_data_ptr<T>();
  const T* xp = x.const_data_ptr<T>();
  const float* pp = post.const_data_ptr<float>();
  const float* cp = comb.const_data_ptr<float>();
  T* o = out.mutable_data_ptr<T>();
  at::parallel_for(0, T_, 4, [&](int64_t begin, int64_t end) {
    float in[kHcMaxStreams];
    for (int64_t t = begin; t < end; ++t) {
      const T* st = s + t * hc * D;
      const float* ct = cp + t * hc * hc;
      for (int64_t d = 0; d < D; ++d) {
        for (int64_t i = 0; i < hc; ++i) in[i] = static_cast<float>(st[i * D + d]);  // all read before any write
        const float xv = static_cast<float>(xp[t * D + d]);
        for (int64_t j = 0; j < hc; ++j) {
          float acc = pp[t * hc + j] * xv;
          for (int64_t i = 0; i < hc; ++i) acc += ct[i * hc + j] * in[i];
          o[(t * hc + j) * D + d] = static_cast<T>(acc);
        }
      }
    }
  });
}

}  // namespace

void hc_mix_cpu(at::Tensor& out, const at::Tensor& x, const at::Tensor& fn, double eps) {
  check_hc_mix(out, x, fn, eps);
  if (out.numel() == 0) return;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "hc_mix_cpu",
                                  [&] { hc_mix_rows<scalar_t>(out, x, fn, static_cast<float>(eps)); });
}

void hc_collapse_cpu(at::Tensor& out, const at::Tensor& streams, const at::Tensor& pre) {
  check_hc_collapse(out, streams, pre);
  if (out.numel() == 0) return;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, streams.scalar_type(), "hc_collapse_cpu",
                                  [&] { hc_collapse_rows<scalar_t>(out, streams, pre); });
}

void hc_post_cpu(at::Tensor& out, const at::Tensor& streams, const at::Tensor& x, const at::Tensor& post,
                 const at::Tensor& comb) {
  check_hc_post(out, streams, x, post, comb);
  if (out.numel() == 0) return;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, streams.scalar_type(), "hc_post_cpu",
                                  [&] { hc_post_rows<scalar_t>(out, streams, x, post, comb); });
}

void hc_weights_cpu(at::Tensor& pre, at::Tensor& post, at::Tensor& comb, const at::Tensor& mix, const at::Tensor& base,
                    const at::Tensor& scale, double eps, int64_t sinkhorn_iters) {
  check_hc_weights_op(pre, post, comb, mix, base, scale, eps, sinkhorn_iters);
  const int64_t T_ = pre.size(0);
  const int hc = static_cast<int>(pre.size(1));
  if (T_ == 0) return;
  const float* mx = mix.const_data_ptr<float>();
  const float* b = base.const_data_ptr<float>();
  const float* sc = scale.const_data_ptr<float>();
  float* pr = pre.mutable_data_ptr<float>();
  float* po = post.mutable_data_ptr<float>();
  float* cb = comb.mutable_data_ptr<float>();
  const int m = 2 * hc + hc * hc;
  at::parallel_for(0, T_, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      mhc_math::hc_weights_token(mx + t * m, b, sc, hc, static_cast<float>(eps), static_cast<int>(sinkhorn_iters),
                                 pr + t * hc, po + t * hc, cb + t * hc * hc);
    }
  });
}

}  // namespace deepinfer

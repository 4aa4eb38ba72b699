// CPU sparse MQA (decode and prefill): for each query row and head, softmax over the gathered KV entries of up to two
// index lists (K = V, one shared KV head), with an optional per-head sink logit in the denominator. fp32 math.
// Semantics (same as the CUDA kernel and deepinfer_ops.testing.refs.sparse_mqa_ref):
//   entry j of list l is valid iff j < topk_length_l[row / rows_per_length] (when given) and
//   0 <= idx < num_blocks * block_size; s_j = softmax_scale * q . k_j; lse = log(sum_valid exp(s_j)) (-inf if none);
//   out = sum_valid exp(s_j) k_j / (sum_valid exp(s_j) + exp(sink)) (0 if none valid).
// Element types: bf16 q/out with bf16 or FP8 (MODEL1) caches (as on CUDA), or, on CPU only, float32 q/out/caches
// (the model's fp32 CPU path); the math is float32 either way.
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <limits>
#include <vector>

#include "common/attention_checks.h"
#include "cpu/attention/fp8_entry.h"
#include "ops.h"

namespace deepinfer {
namespace {

using bf16 = c10::BFloat16;

template <typename T>
void sparse_mqa_cpu_impl(const SparseMqaArgs& a) {
  const int64_t rows = a.q.size(0), h = a.q.size(1), d = a.q.size(2);
  if (rows == 0 || h == 0) return;
  const T* q = a.q.const_data_ptr<T>();
  T* out = a.out.mutable_data_ptr<T>();
  float* lse = a.lse.mutable_data_ptr<float>();
  const float* sink = a.attn_sink.defined() ? a.attn_sink.const_data_ptr<float>() : nullptr;
  const float scale = static_cast<float>(a.softmax_scale);
  const float neg_inf = -std::numeric_limits<float>::infinity();

  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    std::vector<const T*> keys;
    std::vector<float> qf(d), acc(d), scores;
    std::vector<T> dequant;  // FP8 entries decoded to bf16 (exact; bf16 q only)
    for (int64_t r = r0; r < r1; ++r) {
      // Gather the valid entries of every list, in list order.
      keys.clear();
      int64_t max_keys = 0;
      for (const auto& l : a.lists) max_keys += l.indices.size(1);
      dequant.resize(max_keys * d);  // reserved up front: pointers into it stay valid
      for (const auto& l : a.lists) {
        const int64_t topk = l.indices.size(1);
        int64_t len = topk;
        if (l.topk_length.defined()) {
          len = l.topk_length.const_data_ptr<int32_t>()[r / a.rows_per_length];
          len = std::clamp<int64_t>(len, 0, topk);
        }
        const int32_t* idx = l.indices.const_data_ptr<int32_t>() + r * topk;
        const int64_t block_size = l.cache.size(1), num_slots = l.cache.size(0) * block_size;
        [[maybe_unused]] const bool fp8 = l.cache.scalar_type() == at::kByte;
        const auto* base = static_cast<const uint8_t*>(l.cache.const_data_ptr());
        const int64_t esize = l.cache.element_size();
        for (int64_t j = 0; j < len; ++j) {
          const int64_t s = idx[j];
          if (s < 0 || s >= num_slots) continue;
          if constexpr (std::is_same_v<T, bf16>) {
            if (fp8) {
              bf16* row = dequant.data() + keys.size() * d;
              fp8_entry::decode(row, base + (s / block_size) * l.cache.stride(0), block_size, s % block_size);
              keys.push_back(row);
              continue;
            }
          }
          keys.push_back(reinterpret_cast<const T*>(
              base + ((s / block_size) * l.cache.stride(0) + (s % block_size) * l.cache.stride(1)) * esize));
        }
      }
      const int64_t n = static_cast<int64_t>(keys.size());
      scores.resize(n);
      for (int64_t hh = 0; hh < h; ++hh) {
        const T* qr = q + (r * h + hh) * d;
        for (int64_t c = 0; c < d; ++c) qf[c] = static_cast<float>(qr[c]);
        float m = neg_inf;
        bool any_nan = false;
        for (int64_t j = 0; j < n; ++j) {
          float s = 0.f;
          for (int64_t c = 0; c < d; ++c) s += qf[c] * static_cast<float>(keys[j][c]);
          scores[j] = s * scale;
          m = std::max(m, scores[j]);  // NaN scores leave m alone and propagate through exp below
          any_nan |= std::isnan(scores[j]);
        }
        // No entry, or every score -inf (e.g. -inf in q): the empty-set rule (out 0, lse -inf), as on CUDA.
        const bool empty = m == neg_inf && !any_nan;
        std::fill(acc.begin(), acc.end(), 0.f);
        double l = 0.0;  // a long fp32 running sum drifts past lse's fp32-rounding bound (thousands of entries)
        for (int64_t j = 0; j < n && !empty; ++j) {
          const float p = std::exp(scores[j] - m);
          l += p;
          for (int64_t c = 0; c < d; ++c) acc[c] += p * static_cast<float>(keys[j][c]);
        }
        double denom = l;
        if (sink != nullptr && !empty) denom += std::exp(static_cast<double>(sink[hh]) - m);
        const float inv = empty ? 0.f : static_cast<float>(1.0 / denom);
        T* o = out + (r * h + hh) * d;
        for (int64_t c = 0; c < d; ++c) o[c] = static_cast<T>(acc[c] * inv);
        lse[r * h + hh] = empty ? neg_inf : static_cast<float>(m + std::log(l));
      }
    }
  });
}

void sparse_mqa_cpu(const SparseMqaArgs& a) {
  if (a.q.scalar_type() == at::kFloat) {
    sparse_mqa_cpu_impl<float>(a);
  } else {
    sparse_mqa_cpu_impl<bf16>(a);
  }
}

}  // namespace

void sparse_mqa_decode_cpu(at::Tensor& out, at::Tensor& lse, const at::Tensor& q, const at::Tensor& kv_cache,
                           const at::Tensor& indices, const std::optional<at::Tensor>& topk_length,
                           const std::optional<at::Tensor>& extra_kv_cache,
                           const std::optional<at::Tensor>& extra_indices,
                           const std::optional<at::Tensor>& extra_topk_length,
                           const std::optional<at::Tensor>& attn_sink, double softmax_scale) {
  auto a = check_sparse_mqa("sparse_mqa_decode", false, out, lse, q, kv_cache, indices, topk_length, extra_kv_cache,
                            extra_indices, extra_topk_length, attn_sink, softmax_scale,
                            /*allow_fp32=*/true);
  sparse_mqa_cpu(a);
}

void sparse_mqa_prefill_cpu(at::Tensor& out, at::Tensor& lse, const at::Tensor& q, const at::Tensor& kv_cache,
                            const at::Tensor& indices, const std::optional<at::Tensor>& topk_length,
                            const std::optional<at::Tensor>& extra_kv_cache,
                            const std::optional<at::Tensor>& extra_indices,
                            const std::optional<at::Tensor>& extra_topk_length,
                            const std::optional<at::Tensor>& attn_sink, double softmax_scale) {
  auto a = check_sparse_mqa("sparse_mqa_prefill", true, out, lse, q, kv_cache, indices, topk_length, extra_kv_cache,
                            extra_indices, extra_topk_length, attn_sink, softmax_scale,
                            /*allow_fp32=*/true);
  sparse_mqa_cpu(a);
}

}  // namespace deepinfer

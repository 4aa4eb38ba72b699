// CPU lightning-indexer ops: mqa_logits (sum over index heads of weight_h * ReLU(q_h . k)), topk_rows (the project's
// tie rule: higher score first, then lower index) and kv_cache_write (scatter rows into a paged cache by slot).
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

#include "common/attention_checks.h"
#include "cpu/attention/fp8_entry.h"
#include "ops.h"

namespace deepinfer {
namespace {

using bf16 = c10::BFloat16;

// Order-preserving map of a float to uint32 (larger float -> larger key); NaN is the largest, -0.0 == +0.0.
inline uint32_t topk_key(float x) {
  if (std::isnan(x)) return 0xffffffffu;
  if (x == 0.f) x = 0.f;
  uint32_t b;
  std::memcpy(&b, &x, 4);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

}  // namespace

namespace {

// T: the element type of q (and of k_cache unless kFp8Keys: uint8 FP8 keys, decoded per candidate).
template <typename T, bool kFp8Keys = false>
void mqa_logits_cpu_impl(at::Tensor& logits, const at::Tensor& q, const at::Tensor& weights, const at::Tensor& k_cache,
                         const std::optional<at::Tensor>& block_table, const std::optional<at::Tensor>& k_start,
                         const std::optional<at::Tensor>& k_end) {
  const int64_t t = q.size(0), H = q.size(1), d = q.size(2), n = logits.size(1);
  if (t == 0 || n == 0) return;
  const int64_t block_size = k_cache.size(1), num_blocks = k_cache.size(0);
  const int64_t bstride = k_cache.stride(0), tstride = k_cache.stride(1);
  const T* kc = static_cast<const T*>(k_cache.const_data_ptr());
  const T* qp = q.const_data_ptr<T>();
  const float* w = weights.const_data_ptr<float>();
  float* out = logits.mutable_data_ptr<float>();
  const bool paged = block_table.has_value();  // (an empty table's data pointer may be null: not "no table")
  const int32_t* bt = paged ? block_table->const_data_ptr<int32_t>() : nullptr;
  const int64_t max_blocks = block_table.has_value() ? block_table->size(1) : 0;
  const int32_t* ks = k_start.has_value() ? k_start->const_data_ptr<int32_t>() : nullptr;
  const int32_t* ke = k_end.has_value() ? k_end->const_data_ptr<int32_t>() : nullptr;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, t, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> qf(H * d), kf(d);
    for (int64_t i = t0; i < t1; ++i) {
      for (int64_t e = 0; e < H * d; ++e) qf[e] = static_cast<float>(qp[i * H * d + e]);
      const int64_t lo = ks ? ks[i] : 0, hi = ke ? ke[i] : n;
      for (int64_t c = 0; c < n; ++c) {
        int64_t block = c / block_size;
        if (paged) block = block < max_blocks ? bt[i * max_blocks + block] : -1;
        if (c < lo || c >= hi || block < 0 || block >= num_blocks) {
          out[i * n + c] = neg_inf;
          continue;
        }
        if constexpr (kFp8Keys) {  // decode the key (exact bf16 values): same sums as over the decoded cache
          const uint8_t* blk = reinterpret_cast<const uint8_t*>(kc) + block * bstride;
          const int64_t j = c % block_size;
          const float sc = fp8_entry::indexer_key_scale(blk, block_size, d, j);
          const uint8_t* codes = fp8_entry::indexer_key_codes(blk, d, j);
          for (int64_t e = 0; e < d; ++e) kf[e] = fp8_entry::indexer_key_decode(codes, sc, e);
        } else {
          const T* k = kc + block * bstride + (c % block_size) * tstride;
          for (int64_t e = 0; e < d; ++e) kf[e] = static_cast<float>(k[e]);
        }
        float acc = 0.f;
        for (int64_t hh = 0; hh < H; ++hh) {
          float s = 0.f;
          for (int64_t e = 0; e < d; ++e) s += qf[hh * d + e] * kf[e];
          acc += w[i * H + hh] * std::max(s, 0.f);
        }
        out[i * n + c] = acc;
      }
    }
  });
}

}  // namespace

// bf16 q with bf16 or FP8 keys as on CUDA, or (CPU only) float32 q / keys: the model's fp32 CPU path.
void mqa_logits_cpu(at::Tensor& logits, const at::Tensor& q, const at::Tensor& weights, const at::Tensor& k_cache,
                    const std::optional<at::Tensor>& block_table, const std::optional<at::Tensor>& k_start,
                    const std::optional<at::Tensor>& k_end) {
  check_mqa_logits(logits, q, weights, k_cache, block_table, k_start, k_end, /*allow_fp32=*/true);
  if (k_cache.scalar_type() == at::kByte) {
    mqa_logits_cpu_impl<bf16, /*kFp8Keys=*/true>(logits, q, weights, k_cache, block_table, k_start, k_end);
  } else if (q.scalar_type() == at::kFloat) {
    mqa_logits_cpu_impl<float>(logits, q, weights, k_cache, block_table, k_start, k_end);
  } else {
    mqa_logits_cpu_impl<bf16>(logits, q, weights, k_cache, block_table, k_start, k_end);
  }
}

void topk_rows_cpu(at::Tensor& values, at::Tensor& indices, const at::Tensor& scores) {
  check_topk_rows(values, indices, scores);
  const int64_t rows = scores.size(0), n = scores.size(1), k = values.size(1);
  if (rows == 0 || k == 0) return;
  const float* s = scores.const_data_ptr<float>();
  const int64_t rs = scores.stride(0);
  float* v = values.mutable_data_ptr<float>();
  int64_t* ix = indices.mutable_data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    std::vector<uint32_t> key(n);
    std::vector<int64_t> order(n);
    for (int64_t r = r0; r < r1; ++r) {
      const float* row = s + r * rs;
      for (int64_t i = 0; i < n; ++i) key[i] = topk_key(row[i]);
      std::iota(order.begin(), order.end(), int64_t(0));
      std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int64_t a, int64_t b) {
        return key[a] != key[b] ? key[a] > key[b] : a < b;
      });
      for (int64_t j = 0; j < k; ++j) {
        ix[r * k + j] = order[j];
        v[r * k + j] = row[order[j]];
      }
    }
  });
}

void kv_cache_write_cpu(at::Tensor& kv_cache, const at::Tensor& kv, const at::Tensor& slot_mapping) {
  check_kv_cache_write(kv_cache, kv, slot_mapping);
  const int64_t t = kv.size(0);
  if (t == 0 || kv_cache.numel() == 0) return;
  const int64_t esize = kv.element_size(), row_bytes = kv.size(1) * esize;
  const int64_t block_size = kv_cache.size(1), num_slots = kv_cache.size(0) * block_size;
  auto* dst = static_cast<char*>(kv_cache.mutable_data_ptr());
  const auto* src = static_cast<const char*>(kv.const_data_ptr());
  const int64_t* slots = slot_mapping.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < t; ++i) {
    const int64_t s = slots[i];
    if (s < 0 || s >= num_slots) continue;
    std::memcpy(dst + ((s / block_size) * kv_cache.stride(0) + (s % block_size) * kv_cache.stride(1)) * esize,
                src + i * kv.stride(0) * esize, row_bytes);
  }
}

}  // namespace deepinfer

// CPU kv_cache_write_fp8 (quantise bf16 rows into MODEL1 FP8 entries of a paged cache) and kv_cache_dequant_fp8;
// indexer_k_cache_write_fp8 / indexer_k_cache_dequant_fp8 (FP8 indexer keys, one fp32 scale per key).
#include <ATen/Parallel.h>

#include "cpu/attention/fp8_entry.h"
#include "ops.h"

namespace deepinfer {

void kv_cache_write_fp8_cpu(at::Tensor& kv_cache, const at::Tensor& kv, const at::Tensor& slot_mapping) {
  check_fp8_cache("kv_cache_write_fp8", kv_cache, kv, "kv", slot_mapping, /*writes_cache=*/true);
  const int64_t t = kv.size(0), block_size = kv_cache.size(1), num_slots = kv_cache.size(0) * block_size;
  if (t == 0 || num_slots == 0) return;
  auto* cache = kv_cache.mutable_data_ptr<uint8_t>();
  const auto* x = kv.const_data_ptr<c10::BFloat16>();
  const int64_t* slots = slot_mapping.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < t; ++i) {
    const int64_t s = slots[i];
    if (s < 0 || s >= num_slots) continue;
    fp8_entry::encode(cache + (s / block_size) * kv_cache.stride(0) + (s % block_size) * kv_cache.stride(1),
                      x + i * kv.stride(0));
  }
}

void kv_cache_dequant_fp8_cpu(at::Tensor& out, const at::Tensor& kv_cache, const at::Tensor& slot_mapping) {
  check_fp8_cache("kv_cache_dequant_fp8", kv_cache, out, "out", slot_mapping, /*writes_cache=*/false);
  const int64_t t = out.size(0), block_size = kv_cache.size(1), num_slots = kv_cache.size(0) * block_size;
  if (t == 0) return;
  const auto* cache = kv_cache.const_data_ptr<uint8_t>();
  auto* o = out.mutable_data_ptr<c10::BFloat16>();
  const int64_t* slots = slot_mapping.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < t; ++i) {
    const int64_t s = slots[i];
    c10::BFloat16* row = o + i * out.stride(0);
    if (s < 0 || s >= num_slots) {
      std::fill(row, row + kFp8HeadDim, c10::BFloat16(0.f));
      continue;
    }
    fp8_entry::decode(row, cache + (s / block_size) * kv_cache.stride(0) + (s % block_size) * kv_cache.stride(1));
  }
}

void indexer_k_cache_write_fp8_cpu(at::Tensor& k_cache, const at::Tensor& k, const at::Tensor& slot_mapping) {
  check_indexer_k_cache_fp8("indexer_k_cache_write_fp8", k_cache, k, "k", slot_mapping, /*writes_cache=*/true);
  const int64_t t = k.size(0), d = k.size(1), block_size = k_cache.size(1), num_slots = k_cache.size(0) * block_size;
  if (t == 0 || num_slots == 0) return;
  auto* cache = k_cache.mutable_data_ptr<uint8_t>();
  const auto* x = k.const_data_ptr<c10::BFloat16>();
  const int64_t* slots = slot_mapping.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < t; ++i) {
    const int64_t s = slots[i];
    if (s < 0 || s >= num_slots) continue;
    fp8_entry::indexer_key_encode(cache + (s / block_size) * k_cache.stride(0), block_size, d, s % block_size,
                                  x + i * k.stride(0));
  }
}

void indexer_k_cache_dequant_fp8_cpu(at::Tensor& out, const at::Tensor& k_cache, const at::Tensor& slot_mapping) {
  check_indexer_k_cache_fp8("indexer_k_cache_dequant_fp8", k_cache, out, "out", slot_mapping, /*writes_cache=*/false);
  const int64_t t = out.size(0), d = out.size(1), block_size = k_cache.size(1);
  const int64_t num_slots = k_cache.size(0) * block_size;
  if (t == 0) return;
  const auto* cache = k_cache.const_data_ptr<uint8_t>();
  auto* o = out.mutable_data_ptr<c10::BFloat16>();
  const int64_t* slots = slot_mapping.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < t; ++i) {
    const int64_t s = slots[i];
    c10::BFloat16* row = o + i * out.stride(0);
    if (s < 0 || s >= num_slots) {
      std::fill(row, row + d, c10::BFloat16(0.f));
      continue;
    }
    const uint8_t* block = cache + (s / block_size) * k_cache.stride(0);
    const int64_t j = s % block_size;
    const float sc = fp8_entry::indexer_key_scale(block, block_size, d, j);
    const uint8_t* codes = fp8_entry::indexer_key_codes(block, d, j);
    for (int64_t e = 0; e < d; ++e) row[e] = c10::BFloat16(fp8_entry::indexer_key_decode(codes, sc, e));
  }
}

}  // namespace deepinfer

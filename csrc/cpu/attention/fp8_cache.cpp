// CPU kv_cache_write_fp8 (quantise bf16 rows into MODEL1 FP8 entries of a paged cache) and kv_cache_dequant_fp8;
// indexer_k_cache_write_fp8 / indexer_k_cache_dequant_fp8 (FP8 indexer keys, one fp32 scale per key).
#include <ATen/Parallel.h>

#include <algorithm>

#include "cpu/attention/fp8_entry.h"
#include "ops.h"

namespace deepinfer {
namespace {

// encode(row i's bf16 values, slot s) for every row i whose slot s = slot_mapping[i] is in [0, num_slots).
template <class Encode>
void write_rows(const at::Tensor& rows, const at::Tensor& slot_mapping, int64_t num_slots, Encode encode) {
  const auto* x = rows.const_data_ptr<c10::BFloat16>();
  const int64_t* slots = slot_mapping.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < rows.size(0); ++i) {
    const int64_t s = slots[i];
    if (s >= 0 && s < num_slots) encode(x + i * rows.stride(0), s);
  }
}

// decode(out row i, slot s) for every row i whose slot s = slot_mapping[i] is in [0, num_slots); zeros otherwise.
template <class Decode>
void dequant_rows(at::Tensor& out, const at::Tensor& slot_mapping, int64_t num_slots, Decode decode) {
  auto* o = out.mutable_data_ptr<c10::BFloat16>();
  const int64_t* slots = slot_mapping.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < out.size(0); ++i) {
    const int64_t s = slots[i];
    c10::BFloat16* row = o + i * out.stride(0);
    if (s >= 0 && s < num_slots) {
      decode(row, s);
    } else {
      std::fill(row, row + out.size(1), c10::BFloat16(0.f));
    }
  }
}

}  // namespace

void kv_cache_write_fp8_cpu(at::Tensor& kv_cache, const at::Tensor& kv, const at::Tensor& slot_mapping) {
  check_fp8_cache("kv_cache_write_fp8", kv_cache, kv, "kv", slot_mapping, /*writes_cache=*/true);
  const int64_t block_size = kv_cache.size(1), num_slots = kv_cache.size(0) * block_size;
  if (kv.size(0) == 0 || num_slots == 0) return;
  auto* cache = kv_cache.mutable_data_ptr<uint8_t>();
  write_rows(kv, slot_mapping, num_slots, [&](const c10::BFloat16* x, int64_t s) {
    fp8_entry::encode(cache + (s / block_size) * kv_cache.stride(0), block_size, s % block_size, x);
  });
}

void kv_cache_dequant_fp8_cpu(at::Tensor& out, const at::Tensor& kv_cache, const at::Tensor& slot_mapping) {
  check_fp8_cache("kv_cache_dequant_fp8", kv_cache, out, "out", slot_mapping, /*writes_cache=*/false);
  const int64_t block_size = kv_cache.size(1), num_slots = kv_cache.size(0) * block_size;
  if (out.size(0) == 0) return;
  const auto* cache = kv_cache.const_data_ptr<uint8_t>();
  dequant_rows(out, slot_mapping, num_slots, [&](c10::BFloat16* row, int64_t s) {
    fp8_entry::decode(row, cache + (s / block_size) * kv_cache.stride(0), block_size, s % block_size);
  });
}

void indexer_k_cache_write_fp8_cpu(at::Tensor& k_cache, const at::Tensor& k, const at::Tensor& slot_mapping) {
  check_indexer_k_cache_fp8("indexer_k_cache_write_fp8", k_cache, k, "k", slot_mapping, /*writes_cache=*/true);
  const int64_t d = k.size(1), block_size = k_cache.size(1), num_slots = k_cache.size(0) * block_size;
  if (k.size(0) == 0 || num_slots == 0) return;
  auto* cache = k_cache.mutable_data_ptr<uint8_t>();
  write_rows(k, slot_mapping, num_slots, [&](const c10::BFloat16* x, int64_t s) {
    fp8_entry::indexer_key_encode(cache + (s / block_size) * k_cache.stride(0), block_size, d, s % block_size, x);
  });
}

void indexer_k_cache_dequant_fp8_cpu(at::Tensor& out, const at::Tensor& k_cache, const at::Tensor& slot_mapping) {
  check_indexer_k_cache_fp8("indexer_k_cache_dequant_fp8", k_cache, out, "out", slot_mapping, /*writes_cache=*/false);
  const int64_t d = out.size(1), block_size = k_cache.size(1), num_slots = k_cache.size(0) * block_size;
  if (out.size(0) == 0) return;
  const auto* cache = k_cache.const_data_ptr<uint8_t>();
  dequant_rows(out, slot_mapping, num_slots, [&](c10::BFloat16* row, int64_t s) {
    const uint8_t* block = cache + (s / block_size) * k_cache.stride(0);
    const int64_t j = s % block_size;
    const float sc = fp8_entry::indexer_key_scale(block, block_size, d, j);
    const uint8_t* codes = fp8_entry::indexer_key_codes(block, d, j);
    for (int64_t e = 0; e < d; ++e) row[e] = c10::BFloat16(fp8_entry::indexer_key_decode(codes, sc, e));
  });
}

}  // namespace deepinfer

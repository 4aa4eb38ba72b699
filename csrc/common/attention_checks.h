// Argument checks of the attention domain (sparse MQA decode/prefill, indexer logits, top-k, paged-cache writes),
// shared by the CPU and CUDA implementations. Each check names the op and the tensor at fault.
#pragma once

#include <optional>
#include <utility>
#include <vector>

#include "common/checks.h"

namespace deepinfer {

// FlashMLA "MODEL1" FP8 KV cache (V4), FlashMLA's block layout: a token is 584 bytes, 576 of row and 8 of scales.
// Block b of block_size tokens (block_stride bytes apart, >= block_size * 584; FlashMLA rounds it up to a multiple
// of 576) holds first the rows of its tokens, token t's at byte 576 t: [0, 448) e4m3 codes of the 448 no-RoPE dims
// | [448, 576) the 64 RoPE dims as bf16; then the scales, token t's at byte 576 block_size + 8 t: 7 UE8M0 exponents,
// one per 64 no-RoPE dims (scale = 2^(byte - 127)), and a zero pad byte. The tensor is uint8
// [num_blocks, block_size, 584] with stride(1) == 584: its shape counts the bytes, its rows are not the tokens'.
// Scales: 2^ceil(log2(max(amax / 448, 1e-4))) per tile, as FlashMLA's quantiser.
constexpr int64_t kFp8EntryBytes = 584;
constexpr int64_t kFp8RowBytes = 576;
constexpr int64_t kFp8ScaleBytes = 8;
constexpr int64_t kFp8NopeDims = 448;
constexpr int64_t kFp8RopeDims = 64;
constexpr int64_t kFp8TileDims = 64;
constexpr int64_t kFp8HeadDim = kFp8NopeDims + kFp8RopeDims;

// FP8 indexer-key cache (DeepGEMM / vLLM paged layout for the V3.2 / V4 lightning indexer): uint8
// [num_blocks, block_size, head_dim + 4]; within a block, the block_size x head_dim e4m3 codes of its keys (token
// after token), then block_size fp32 scales (one per key, a power of two): key j's codes at byte j * head_dim of the
// block, its scale at byte block_size * head_dim + 4 j. The block's bytes are one dense [block_size, head_dim + 4]
// view (stride(1) == head_dim + 4); blocks may be padded (stride(0) >= that, a multiple of 4).
constexpr int64_t kIndexerFp8ScaleBytes = 4;

inline bool is_indexer_head_dim(int64_t d) { return d == 48 || d == 64 || d == 128; }

// The FP8 indexer-key cache layout above, for keys of head_dim d.
inline void check_indexer_fp8_cache_layout(const char* op, const at::Tensor& k_cache, const char* name, int64_t d) {
  check_dtype(op, k_cache, name, at::kByte);
  DEEPINFER_CHECK(k_cache.dim() == 3 && k_cache.size(2) == d + kIndexerFp8ScaleBytes && k_cache.size(1) > 0, op, name,
                  " must be uint8 [num_blocks, block_size > 0, ", d + kIndexerFp8ScaleBytes, "] for head_dim ", d,
                  " (per block: the keys' e4m3 codes, then one fp32 scale per key), got ", k_cache.sizes());
  DEEPINFER_CHECK(k_cache.numel() == 0 ||
                      (k_cache.stride(2) == 1 && k_cache.stride(1) == d + kIndexerFp8ScaleBytes &&
                       k_cache.stride(0) >= k_cache.size(1) * (d + kIndexerFp8ScaleBytes) &&
                       k_cache.stride(0) % 4 == 0),
                  op, name, " must hold each block densely (strides [>= block_size * ", d + kIndexerFp8ScaleBytes,
                  " and a multiple of 4, ", d + kIndexerFp8ScaleBytes, ", 1]), got strides ", k_cache.strides());
}

// indexer_k_cache_write_fp8(k_cache!, k [t, d] bf16, slot_mapping [t] int64) and
// indexer_k_cache_dequant_fp8(out [t, d] bf16!, k_cache, slot_mapping). writes_cache: the op writes k_cache.
inline void check_indexer_k_cache_fp8(const char* op, const at::Tensor& k_cache, const at::Tensor& rows,
                                      const char* rows_name, const at::Tensor& slot_mapping, bool writes_cache) {
  check_dtype(op, rows, rows_name, at::kBFloat16);
  DEEPINFER_CHECK(rows.dim() == 2 && is_indexer_head_dim(rows.size(1)) && (rows.numel() == 0 || rows.stride(1) == 1),
                  op, rows_name, " must be [num_tokens, head_dim] with head_dim 48, 64 or 128 and a contiguous last "
                  "dim, got ", rows.sizes());
  check_indexer_fp8_cache_layout(op, k_cache, "k_cache", rows.size(1));
  check_writable(op, writes_cache ? k_cache : rows, writes_cache ? "k_cache" : rows_name);
  check_same_device(op, rows, rows_name, k_cache, "k_cache");
  check_dtype(op, slot_mapping, "slot_mapping", at::kLong);
  check_same_device(op, slot_mapping, "slot_mapping", k_cache, "k_cache");
  DEEPINFER_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == rows.size(0) && slot_mapping.is_contiguous(), op,
                  "slot_mapping must be a contiguous [", rows.size(0), "], got ", slot_mapping.sizes(), " strides ",
                  slot_mapping.strides());
  // The written tensor shares no byte with what the op reads (any layout, padded or strided ones included).
  const at::Tensor& written = writes_cache ? k_cache : rows;
  const char* written_name = writes_cache ? "k_cache" : rows_name;
  check_disjoint(op, written, written_name, writes_cache ? rows : k_cache, writes_cache ? rows_name : "k_cache");
  check_disjoint(op, written, written_name, slot_mapping, "slot_mapping");
}

// Largest top-k the native top-k kernels select (the selected set is sorted in shared memory on CUDA).
constexpr int64_t kTopkMaxK = 2048;
// Largest candidate count per row of the native top-k (int32 positions; 262,144 is V4's longest context / 4).
constexpr int64_t kTopkMaxN = int64_t(1) << 30;

// One list of KV entries read by a sparse MQA call: a paged cache and, per query row, indices into it.
struct SparseKvList {
  at::Tensor cache;        // [num_blocks, block_size, head_dim] bf16, last dim contiguous
  at::Tensor indices;      // [rows, topk] int32, contiguous; entry = block_id * block_size + offset, -1 invalid
  at::Tensor topk_length;  // [rows / rows_per_length] int32 or undefined
};

// Normalised arguments of a sparse MQA call: q and out as [rows, h, d], lse as [rows, h].
struct SparseMqaArgs {
  at::Tensor q, out, lse;
  std::vector<SparseKvList> lists;
  at::Tensor attn_sink;         // [h] fp32 or undefined
  int64_t rows_per_length = 1;  // query rows sharing one topk_length entry (s_q for decode, 1 for prefill)
  double softmax_scale = 1.0;
};

// A MODEL1 FP8 cache's blocks are whole (layout above): stride(1) == 584 (any for one token per block) and blocks
// that do not overlap.
inline void check_fp8_block_layout(const char* op, const at::Tensor& cache, const char* name) {
  if (cache.numel() == 0) return;
  DEEPINFER_CHECK((cache.size(1) == 1 || cache.stride(1) == kFp8EntryBytes) &&
                      (cache.size(0) == 1 || cache.stride(0) >= cache.size(1) * kFp8EntryBytes),
                  op, name, " (FP8 MODEL1) must hold whole blocks: stride(1) == ", kFp8EntryBytes,
                  " and stride(0) >= block_size * ", kFp8EntryBytes, ", got strides ", cache.strides());
}

inline void check_kv_list(const char* op, const at::Tensor& q, const at::Tensor& cache, const char* cache_name,
                          const at::Tensor& indices, const char* indices_name,
                          const std::optional<at::Tensor>& topk_length, const char* len_name,
                          at::IntArrayRef idx_lead, int64_t num_lengths) {
  if (q.scalar_type() == at::kFloat) {
    DEEPINFER_CHECK(cache.scalar_type() == at::kFloat, op, cache_name, " must be torch.float32 with a float32 q, got ",
                    dtype_name(cache.scalar_type()));
  } else {
    DEEPINFER_CHECK(cache.scalar_type() == at::kBFloat16 || cache.scalar_type() == at::kByte, op, cache_name,
                    " must be torch.bfloat16 or torch.uint8 (FP8 MODEL1 entries), got ",
                    dtype_name(cache.scalar_type()));
  }
  check_same_device(op, cache, cache_name, q, "q");
  DEEPINFER_CHECK(cache.dim() == 3, op, cache_name, " must be [num_blocks, block_size, head_dim], got ",
                  cache.sizes());
  if (cache.scalar_type() == at::kByte) {
    DEEPINFER_CHECK(cache.size(2) == kFp8EntryBytes && q.size(-1) == kFp8HeadDim, op, cache_name,
                    " (FP8 MODEL1) must be [num_blocks, block_size, ", kFp8EntryBytes, "] with q head_dim ",
                    kFp8HeadDim, ", got ", cache.sizes(), " and head_dim ", q.size(-1));
    check_fp8_block_layout(op, cache, cache_name);
  } else {
    DEEPINFER_CHECK(cache.size(2) == q.size(-1), op, cache_name, " head_dim ", cache.size(2),
                    " != q head_dim ", q.size(-1));
  }
  DEEPINFER_CHECK(cache.numel() == 0 || cache.stride(2) == 1, op, cache_name,
                  " must be contiguous in head_dim (stride(2) == 1), got strides ", cache.strides());
  DEEPINFER_CHECK(cache.size(1) > 0, op, cache_name, " block_size must be > 0");
  check_dtype(op, indices, indices_name, at::kInt);
  check_same_device(op, indices, indices_name, q, "q");
  DEEPINFER_CHECK(indices.is_contiguous(), op, indices_name, " must be contiguous");
  DEEPINFER_CHECK(indices.dim() == static_cast<int64_t>(idx_lead.size()) + 1 &&
                      indices.sizes().slice(0, idx_lead.size()) == idx_lead,
                  op, indices_name, " must be [", idx_lead, ", topk], got ", indices.sizes());
  if (topk_length.has_value()) {
    check_dtype(op, *topk_length, len_name, at::kInt);
    check_same_device(op, *topk_length, len_name, q, "q");
    DEEPINFER_CHECK(topk_length->dim() == 1 && topk_length->size(0) == num_lengths && topk_length->is_contiguous(),
                    op, len_name, " must be a contiguous [", num_lengths, "], got ", topk_length->sizes());
  }
}

// decode: q [b, s_q, h, d]; prefill: q [t, h, d] (is_prefill). Returns the normalised arguments.
// allow_fp32 (CPU only): q, out and both caches may instead all be float32 (the model's fp32 CPU path).
inline SparseMqaArgs check_sparse_mqa(const char* op, bool is_prefill, const at::Tensor& out, const at::Tensor& lse,
                                      const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& indices,
                                      const std::optional<at::Tensor>& topk_length,
                                      const std::optional<at::Tensor>& extra_kv_cache,
                                      const std::optional<at::Tensor>& extra_indices,
                                      const std::optional<at::Tensor>& extra_topk_length,
                                      const std::optional<at::Tensor>& attn_sink, double softmax_scale,
                                      bool allow_fp32 = false) {
  const int64_t lead_dims = is_prefill ? 1 : 2;
  if (allow_fp32 && q.scalar_type() == at::kFloat) {
    // float32 q: out and the caches must be float32 too (checked below and in check_kv_list)
  } else if (allow_fp32) {
    DEEPINFER_CHECK(q.scalar_type() == at::kBFloat16, op, "q must be torch.bfloat16 or torch.float32, got ",
                    dtype_name(q.scalar_type()));
  } else {
    check_dtype(op, q, "q", at::kBFloat16);
  }
  DEEPINFER_CHECK(q.dim() == lead_dims + 2, op, "q must be ", is_prefill ? "[num_tokens, h, head_dim]" :
                  "[b, s_q, h, head_dim]", ", got ", q.sizes());
  DEEPINFER_CHECK(q.is_contiguous(), op, "q must be contiguous, got strides ", q.strides());
  const int64_t h = q.size(-2), d = q.size(-1);
  DEEPINFER_CHECK(d == 64 || d == 128 || d == 256 || d == 512, op, "head_dim must be 64, 128, 256 or 512, got ", d);
  check_dtype(op, out, "out", q.scalar_type());
  check_writable(op, out, "out");
  DEEPINFER_CHECK(out.sizes() == q.sizes() && out.is_contiguous(), op, "out must be contiguous ", q.sizes(),
                  ", got ", out.sizes(), " strides ", out.strides());
  check_same_device(op, out, "out", q, "q");
  check_dtype(op, lse, "lse", at::kFloat);
  check_writable(op, lse, "lse");
  DEEPINFER_CHECK(lse.sizes() == q.sizes().slice(0, lead_dims + 1) && lse.is_contiguous(), op,
                  "lse must be contiguous ", q.sizes().slice(0, lead_dims + 1), ", got ", lse.sizes());
  check_same_device(op, lse, "lse", q, "q");
  const auto idx_lead = q.sizes().slice(0, lead_dims);
  const int64_t rows = is_prefill ? q.size(0) : q.size(0) * q.size(1);
  const int64_t num_lengths = q.size(0);
  SparseMqaArgs a;
  a.q = q.view({rows, h, d});
  a.out = out.view({rows, h, d});
  a.lse = lse.view({rows, h});
  a.rows_per_length = is_prefill ? 1 : q.size(1);
  a.softmax_scale = softmax_scale;
  check_kv_list(op, q, kv_cache, "kv_cache", indices, "indices", topk_length, "topk_length", idx_lead, num_lengths);
  a.lists.push_back({kv_cache, indices.view({rows, indices.size(-1)}),
                     topk_length.has_value() ? *topk_length : at::Tensor()});
  DEEPINFER_CHECK(extra_kv_cache.has_value() == extra_indices.has_value(), op,
                  "extra_kv_cache and extra_indices must be given together");
  DEEPINFER_CHECK(extra_indices.has_value() || !extra_topk_length.has_value(), op,
                  "extra_topk_length given without extra_indices");
  if (extra_kv_cache.has_value()) {
    check_kv_list(op, q, *extra_kv_cache, "extra_kv_cache", *extra_indices, "extra_indices", extra_topk_length,
                  "extra_topk_length", idx_lead, num_lengths);
    a.lists.push_back({*extra_kv_cache, extra_indices->view({rows, extra_indices->size(-1)}),
                       extra_topk_length.has_value() ? *extra_topk_length : at::Tensor()});
  }
  if (attn_sink.has_value()) {
    check_dtype(op, *attn_sink, "attn_sink", at::kFloat);
    check_same_device(op, *attn_sink, "attn_sink", q, "q");
    DEEPINFER_CHECK(attn_sink->dim() == 1 && attn_sink->size(0) == h && attn_sink->is_contiguous(), op,
                    "attn_sink must be a contiguous [", h, "] (one sink logit per query head), got ",
                    attn_sink->sizes());
    a.attn_sink = *attn_sink;
  }
  // out and lse share no byte with each other or with anything the op reads (any layout).
  check_disjoint(op, out, "out", lse, "lse");
  const std::pair<const std::optional<at::Tensor>*, const char*> optional_reads[] = {
      {&topk_length, "topk_length"}, {&extra_kv_cache, "extra_kv_cache"}, {&extra_indices, "extra_indices"},
      {&extra_topk_length, "extra_topk_length"}, {&attn_sink, "attn_sink"}};
  for (const auto& [written, written_name] : {std::pair<const at::Tensor&, const char*>{out, "out"}, {lse, "lse"}}) {
    check_disjoint(op, written, written_name, q, "q");
    check_disjoint(op, written, written_name, kv_cache, "kv_cache");
    check_disjoint(op, written, written_name, indices, "indices");
    for (const auto& [read, read_name] : optional_reads) {
      if (read->has_value()) check_disjoint(op, written, written_name, **read, read_name);
    }
  }
  return a;
}

// mqa_logits(logits [t, n] fp32, q [t, H, d] bf16, weights [t, H] fp32, k_cache [num_blocks, block_size, d] bf16 or
//            uint8 FP8 keys [num_blocks, block_size, d + 4], block_table [t, max_blocks] int32?, k_start [t] int32?,
//            k_end [t] int32?)
// allow_fp32 (CPU only): q and k_cache may instead both be float32 (the model's fp32 CPU path).
inline void check_mqa_logits(const at::Tensor& logits, const at::Tensor& q, const at::Tensor& weights,
                             const at::Tensor& k_cache, const std::optional<at::Tensor>& block_table,
                             const std::optional<at::Tensor>& k_start, const std::optional<at::Tensor>& k_end,
                             bool allow_fp32 = false) {
  const char* op = "mqa_logits";
  const bool fp32 = allow_fp32 && q.scalar_type() == at::kFloat;
  if (allow_fp32 && !fp32) {
    DEEPINFER_CHECK(q.scalar_type() == at::kBFloat16, op, "q must be torch.bfloat16 or torch.float32, got ",
                    dtype_name(q.scalar_type()));
  } else if (!fp32) {
    check_dtype(op, q, "q", at::kBFloat16);
  }
  DEEPINFER_CHECK(q.dim() == 3 && q.is_contiguous(), op,
                  "q must be a contiguous [num_tokens, num_heads, head_dim], got ", q.sizes(), " strides ", q.strides());
  const int64_t t = q.size(0), H = q.size(1), d = q.size(2);
  DEEPINFER_CHECK(is_indexer_head_dim(d), op, "head_dim must be 48, 64 or 128, got ", d);
  DEEPINFER_CHECK(H >= 1, op, "num_heads must be >= 1");
  check_dtype(op, weights, "weights", at::kFloat);
  DEEPINFER_CHECK(weights.dim() == 2 && weights.size(0) == t && weights.size(1) == H && weights.is_contiguous(), op,
                  "weights must be a contiguous [", t, ", ", H, "], got ", weights.sizes());
  check_same_device(op, weights, "weights", q, "q");
  if (fp32) {
    DEEPINFER_CHECK(k_cache.scalar_type() == at::kFloat, op, "k_cache must be torch.float32 with a float32 q (FP8 "
                    "keys need a bf16 q), got ", dtype_name(k_cache.scalar_type()));
  } else {
    DEEPINFER_CHECK(k_cache.scalar_type() == at::kBFloat16 || k_cache.scalar_type() == at::kByte, op,
                    "k_cache must be torch.bfloat16 (or uint8 FP8 keys), got ", dtype_name(k_cache.scalar_type()));
  }
  check_same_device(op, k_cache, "k_cache", q, "q");
  if (k_cache.scalar_type() == at::kByte) {
    check_indexer_fp8_cache_layout(op, k_cache, "k_cache", d);
  } else {
    DEEPINFER_CHECK(k_cache.dim() == 3 && k_cache.size(2) == d && k_cache.size(1) > 0, op,
                    "k_cache must be [num_blocks, block_size > 0, ", d, "], got ", k_cache.sizes());
    DEEPINFER_CHECK(k_cache.numel() == 0 || k_cache.stride(2) == 1, op, "k_cache must be contiguous in head_dim");
  }
  check_dtype(op, logits, "logits", at::kFloat);
  check_writable(op, logits, "logits");
  check_same_device(op, logits, "logits", q, "q");
  DEEPINFER_CHECK(logits.dim() == 2 && logits.size(0) == t && logits.is_contiguous(), op,
                  "logits must be a contiguous [", t, ", num_candidates], got ", logits.sizes());
  check_disjoint(op, logits, "logits", q, "q");
  check_disjoint(op, logits, "logits", weights, "weights");
  check_disjoint(op, logits, "logits", k_cache, "k_cache");
  if (block_table.has_value()) {
    check_disjoint(op, logits, "logits", *block_table, "block_table");
    check_dtype(op, *block_table, "block_table", at::kInt);
    check_same_device(op, *block_table, "block_table", q, "q");
    DEEPINFER_CHECK(block_table->dim() == 2 && block_table->size(0) == t && block_table->is_contiguous(), op,
                    "block_table must be a contiguous [", t, ", max_blocks], got ", block_table->sizes());
  }
  for (const auto* p : {&k_start, &k_end}) {
    const char* name = p == &k_start ? "k_start" : "k_end";
    if (p->has_value()) {
      check_dtype(op, **p, name, at::kInt);
      check_same_device(op, **p, name, q, "q");
      DEEPINFER_CHECK((*p)->dim() == 1 && (*p)->size(0) == t && (*p)->is_contiguous(), op, name,
                      " must be a contiguous [", t, "], got ", (*p)->sizes());
      check_disjoint(op, logits, "logits", **p, name);
    }
  }
}

// topk_rows(values [rows, k] fp32, indices [rows, k] int64, scores [rows, n] fp32)
inline void check_topk_rows(const at::Tensor& values, const at::Tensor& indices, const at::Tensor& scores) {
  const char* op = "topk_rows";
  check_dtype(op, scores, "scores", at::kFloat);
  DEEPINFER_CHECK(scores.dim() == 2 && (scores.numel() == 0 || scores.stride(1) == 1), op,
                  "scores must be [rows, n] with a contiguous last dim, got ", scores.sizes(), " strides ",
                  scores.strides());
  DEEPINFER_CHECK(scores.size(1) <= kTopkMaxN, op, "n = ", scores.size(1), " exceeds ", kTopkMaxN);
  check_dtype(op, values, "values", at::kFloat);
  check_dtype(op, indices, "indices", at::kLong);
  check_writable(op, values, "values");
  check_writable(op, indices, "indices");
  check_same_device(op, values, "values", scores, "scores");
  check_same_device(op, indices, "indices", scores, "scores");
  DEEPINFER_CHECK(values.dim() == 2 && values.size(0) == scores.size(0) && values.is_contiguous(), op,
                  "values must be a contiguous [", scores.size(0), ", k], got ", values.sizes());
  DEEPINFER_CHECK(indices.sizes() == values.sizes() && indices.is_contiguous(), op,
                  "indices must be a contiguous ", values.sizes(), ", got ", indices.sizes());
  DEEPINFER_CHECK(values.size(1) <= scores.size(1), op, "k = ", values.size(1), " exceeds n = ", scores.size(1));
  check_disjoint(op, values, "values", indices, "indices");
  check_disjoint(op, values, "values", scores, "scores");
  check_disjoint(op, indices, "indices", scores, "scores");
}

// kv_cache_write(kv_cache [num_blocks, block_size, d]!, kv [t, d], slot_mapping [t] int64)
inline void check_kv_cache_write(const at::Tensor& kv_cache, const at::Tensor& kv, const at::Tensor& slot_mapping) {
  const char* op = "kv_cache_write";
  check_writable(op, kv_cache, "kv_cache");
  DEEPINFER_CHECK(kv_cache.dim() == 3, op, "kv_cache must be [num_blocks, block_size, entry_dim], got ",
                  kv_cache.sizes());
  DEEPINFER_CHECK(kv_cache.numel() == 0 || kv_cache.stride(2) == 1, op, "kv_cache must be contiguous in entry_dim");
  DEEPINFER_CHECK(kv.dim() == 2 && kv.size(1) == kv_cache.size(2), op, "kv must be [num_tokens, ",
                  kv_cache.size(2), "], got ", kv.sizes());
  DEEPINFER_CHECK(kv.numel() == 0 || kv.stride(1) == 1, op, "kv must be contiguous in its last dim");
  DEEPINFER_CHECK(kv.scalar_type() == kv_cache.scalar_type(), op, "kv dtype ", dtype_name(kv.scalar_type()),
                  " != kv_cache dtype ", dtype_name(kv_cache.scalar_type()));
  check_same_device(op, kv, "kv", kv_cache, "kv_cache");
  check_dtype(op, slot_mapping, "slot_mapping", at::kLong);
  check_same_device(op, slot_mapping, "slot_mapping", kv_cache, "kv_cache");
  DEEPINFER_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == kv.size(0) && slot_mapping.is_contiguous(), op,
                  "slot_mapping must be a contiguous [", kv.size(0), "], got ", slot_mapping.sizes());
  check_disjoint(op, kv_cache, "kv_cache", kv, "kv");
  check_disjoint(op, kv_cache, "kv_cache", slot_mapping, "slot_mapping");
}

// kv_cache_write_fp8(kv_cache [num_blocks, block_size, 584] uint8!, kv [t, 512] bf16, slot_mapping [t] int64) and
// kv_cache_dequant_fp8(out [t, 512] bf16!, kv_cache, slot_mapping). writes_cache: the op writes kv_cache (else rows).
inline void check_fp8_cache(const char* op, const at::Tensor& kv_cache, const at::Tensor& rows, const char* rows_name,
                            const at::Tensor& slot_mapping, bool writes_cache) {
  check_dtype(op, kv_cache, "kv_cache", at::kByte);
  if (writes_cache) {
    check_writable(op, kv_cache, "kv_cache");
  } else {
    check_writable(op, rows, rows_name);
  }
  DEEPINFER_CHECK(kv_cache.dim() == 3 && kv_cache.size(2) == kFp8EntryBytes && kv_cache.size(1) > 0, op,
                  "kv_cache must be uint8 [num_blocks, block_size, ", kFp8EntryBytes, "], got ", kv_cache.sizes());
  DEEPINFER_CHECK(kv_cache.numel() == 0 || kv_cache.stride(2) == 1, op,
                  "kv_cache must be contiguous in its last dim, got strides ", kv_cache.strides());
  check_fp8_block_layout(op, kv_cache, "kv_cache");
  check_dtype(op, rows, rows_name, at::kBFloat16);
  DEEPINFER_CHECK(rows.dim() == 2 && rows.size(1) == kFp8HeadDim && (rows.numel() == 0 || rows.stride(1) == 1), op,
                  rows_name, " must be [num_tokens, ", kFp8HeadDim, "] with a contiguous last dim, got ", rows.sizes(),
                  " with strides ", rows.strides());
  check_same_device(op, rows, rows_name, kv_cache, "kv_cache");
  check_dtype(op, slot_mapping, "slot_mapping", at::kLong);
  check_same_device(op, slot_mapping, "slot_mapping", kv_cache, "kv_cache");
  DEEPINFER_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == rows.size(0) && slot_mapping.is_contiguous(), op,
                  "slot_mapping must be a contiguous [", rows.size(0), "], got ", slot_mapping.sizes());
  const at::Tensor& written = writes_cache ? kv_cache : rows;
  const char* written_name = writes_cache ? "kv_cache" : rows_name;
  check_disjoint(op, written, written_name, writes_cache ? rows : kv_cache, writes_cache ? rows_name : "kv_cache");
  check_disjoint(op, written, written_name, slot_mapping, "slot_mapping");
}

// compressor_pool(out, kv, gate): kv [n, S, hd] float32 / bfloat16 / float16 and gate [n, S, hd] float32, both with
// a contiguous last dim (any strides for n and S); out [n, hd] contiguous, kv's dtype.
inline void check_compressor_pool(const at::Tensor& out, const at::Tensor& kv, const at::Tensor& gate) {
  const char* op = "compressor_pool";
  DEEPINFER_CHECK(is_float_activation(kv.scalar_type()), op, "kv must be float32, bfloat16 or float16, got ",
                  dtype_name(kv.scalar_type()));
  DEEPINFER_CHECK(kv.dim() == 3, op, "kv must be [windows, slots, head_dim], got ", kv.sizes());
  check_dtype(op, gate, "gate", at::kFloat);
  DEEPINFER_CHECK(gate.sizes() == kv.sizes(), op, "gate shape ", gate.sizes(), " != kv shape ", kv.sizes());
  DEEPINFER_CHECK(kv.size(2) <= 1 || kv.stride(2) == 1, op, "kv must be contiguous in its last dim, got strides ",
                  kv.strides());
  DEEPINFER_CHECK(gate.size(2) <= 1 || gate.stride(2) == 1, op,
                  "gate must be contiguous in its last dim, got strides ", gate.strides());
  DEEPINFER_CHECK(out.scalar_type() == kv.scalar_type(), op, "out must be ", dtype_name(kv.scalar_type()),
                  " (kv's dtype), got ", dtype_name(out.scalar_type()));
  DEEPINFER_CHECK(out.dim() == 2 && out.size(0) == kv.size(0) && out.size(1) == kv.size(2), op, "out must be [",
                  kv.size(0), ", ", kv.size(2), "], got ", out.sizes());
  DEEPINFER_CHECK(out.is_contiguous(), op, "out must be contiguous, got strides ", out.strides());
  check_same_device(op, gate, "gate", kv, "kv");
  check_same_device(op, out, "out", kv, "kv");
  check_writable(op, out, "out");
  check_disjoint(op, out, "out", kv, "kv");
  check_disjoint(op, out, "out", gate, "gate");
}

// The compressor's row sources (compressor_pool_rows / compressor_state_write): row r of the virtual
// all = cat(ring[ring_src], new) is ring row ring_src[r] for r < n_ring, else new row r - n_ring.
// ring_kv / ring_gate [ring_slots, C] contiguous; new_kv / new_gate [new_rows, C] contiguous in C (any row stride);
// one float dtype for all four; ring_src [n_ring] int64 contiguous.
inline void check_compressor_rows(const char* op, const at::Tensor& ring_kv, const at::Tensor& ring_gate,
                                  const at::Tensor& new_kv, const at::Tensor& new_gate, const at::Tensor& ring_src) {
  DEEPINFER_CHECK(is_float_activation(ring_kv.scalar_type()), op,
                  "ring_kv must be float32, bfloat16 or float16, got ", dtype_name(ring_kv.scalar_type()));
  DEEPINFER_CHECK(ring_kv.dim() == 2 && ring_kv.is_contiguous(), op, "ring_kv must be a contiguous [slots, C], got ",
                  ring_kv.sizes(), " strides ", ring_kv.strides());
  const int64_t C = ring_kv.size(1);
  const std::pair<const at::Tensor*, const char*> others[] = {{&ring_gate, "ring_gate"}, {&new_kv, "new_kv"},
                                                              {&new_gate, "new_gate"}};
  for (const auto& [t, name] : others) {
    DEEPINFER_CHECK(t->scalar_type() == ring_kv.scalar_type(), op, name, " dtype ", dtype_name(t->scalar_type()),
                    " != ring_kv dtype ", dtype_name(ring_kv.scalar_type()));
    DEEPINFER_CHECK(t->dim() == 2 && t->size(1) == C, op, name, " must be [rows, ", C, "], got ", t->sizes());
    DEEPINFER_CHECK(t->size(0) <= 1 || t->stride(0) >= C, op, name, " rows overlap (stride ", t->stride(0), ")");
    DEEPINFER_CHECK(C <= 1 || t->stride(1) == 1, op, name, " must be contiguous in its last dim, got strides ",
                    t->strides());
    check_same_device(op, *t, name, ring_kv, "ring_kv");
  }
  DEEPINFER_CHECK(ring_gate.sizes() == ring_kv.sizes() && ring_gate.is_contiguous(), op,
                  "ring_gate must be a contiguous ", ring_kv.sizes(), ", got ", ring_gate.sizes());
  DEEPINFER_CHECK(new_gate.size(0) == new_kv.size(0), op, "new_gate has ", new_gate.size(0), " rows, new_kv ",
                  new_kv.size(0));
  check_dtype(op, ring_src, "ring_src", at::kLong);
  DEEPINFER_CHECK(ring_src.dim() == 1 && ring_src.is_contiguous(), op, "ring_src must be a contiguous 1-D, got ",
                  ring_src.sizes());
  check_same_device(op, ring_src, "ring_src", ring_kv, "ring_kv");
}

inline void check_index_list(const char* op, const at::Tensor& t, const char* name, at::IntArrayRef shape,
                             const at::Tensor& like) {
  check_dtype(op, t, name, at::kLong);
  DEEPINFER_CHECK(t.sizes() == shape && t.is_contiguous(), op, name, " must be a contiguous ", shape, ", got ",
                  t.sizes(), " strides ", t.strides());
  check_same_device(op, t, name, like, "ring_kv");
}

// compressor_pool_rows(out [n, hd]!, ring_kv, ring_gate, new_kv, new_gate, ape [m, C] float32, ring_src,
//                      cur [n, m], prev [n, m]?, prev_ok [n]?, dst [n]); overlap (prev given): C = 2 hd, else C = hd.
inline void check_compressor_pool_rows(const at::Tensor& out, const at::Tensor& ring_kv, const at::Tensor& ring_gate,
                                       const at::Tensor& new_kv, const at::Tensor& new_gate, const at::Tensor& ape,
                                       const at::Tensor& ring_src, const at::Tensor& cur,
                                       const std::optional<at::Tensor>& prev,
                                       const std::optional<at::Tensor>& prev_ok, const at::Tensor& dst) {
  const char* op = "compressor_pool_rows";
  check_compressor_rows(op, ring_kv, ring_gate, new_kv, new_gate, ring_src);
  const int64_t C = ring_kv.size(1);
  DEEPINFER_CHECK(cur.dim() == 2, op, "cur must be [windows, ratio], got ", cur.sizes());
  const int64_t n = cur.size(0), m = cur.size(1);
  check_index_list(op, cur, "cur", {n, m}, ring_kv);
  DEEPINFER_CHECK(prev.has_value() == prev_ok.has_value(), op, "prev and prev_ok come together (overlap)");
  const bool overlap = prev.has_value();
  if (overlap) {
    check_index_list(op, *prev, "prev", {n, m}, ring_kv);
    check_index_list(op, *prev_ok, "prev_ok", {n}, ring_kv);
    DEEPINFER_CHECK(C % 2 == 0, op, "with overlap the row width must be even (2 head_dim), got ", C);
  }
  check_index_list(op, dst, "dst", {n}, ring_kv);
  check_dtype(op, ape, "ape", at::kFloat);
  DEEPINFER_CHECK(ape.dim() == 2 && ape.size(0) == m && ape.size(1) == C && ape.is_contiguous(), op,
                  "ape must be a contiguous [", m, ", ", C, "], got ", ape.sizes());
  check_same_device(op, ape, "ape", ring_kv, "ring_kv");
  const int64_t hd = overlap ? C / 2 : C;
  DEEPINFER_CHECK(out.scalar_type() == ring_kv.scalar_type(), op, "out must be ", dtype_name(ring_kv.scalar_type()),
                  ", got ", dtype_name(out.scalar_type()));
  DEEPINFER_CHECK(out.dim() == 2 && out.size(0) == n && out.size(1) == hd && out.is_contiguous(), op,
                  "out must be a contiguous [", n, ", ", hd, "], got ", out.sizes());
  check_same_device(op, out, "out", ring_kv, "ring_kv");
  check_writable(op, out, "out");
  for (const auto& [t, name] : {std::pair<const at::Tensor*, const char*>{&ring_kv, "ring_kv"}, {&ring_gate, "ring_gate"},
                                {&new_kv, "new_kv"}, {&new_gate, "new_gate"}})
    check_disjoint(op, out, "out", *t, name);
}

// compressor_state_write(ring_kv!, ring_gate!, new_kv, new_gate, ring_src, st_src [n_st], st_dst [n_st]).
inline void check_compressor_state_write(const at::Tensor& ring_kv, const at::Tensor& ring_gate,
                                         const at::Tensor& new_kv, const at::Tensor& new_gate,
                                         const at::Tensor& ring_src, const at::Tensor& st_src,
                                         const at::Tensor& st_dst) {
  const char* op = "compressor_state_write";
  check_compressor_rows(op, ring_kv, ring_gate, new_kv, new_gate, ring_src);
  DEEPINFER_CHECK(st_src.dim() == 1, op, "st_src must be 1-D, got ", st_src.sizes());
  check_index_list(op, st_src, "st_src", {st_src.size(0)}, ring_kv);
  check_index_list(op, st_dst, "st_dst", {st_src.size(0)}, ring_kv);
  check_writable(op, ring_kv, "ring_kv");
  check_writable(op, ring_gate, "ring_gate");
  check_disjoint(op, ring_kv, "ring_kv", ring_gate, "ring_gate");
  for (const at::Tensor* w : {&ring_kv, &ring_gate}) {
    check_disjoint(op, *w, "ring", new_kv, "new_kv");
    check_disjoint(op, *w, "ring", new_gate, "new_gate");
  }
}

}  // namespace deepinfer

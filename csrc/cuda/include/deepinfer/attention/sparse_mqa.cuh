// Sparse MQA attention (decode and prefill share one kernel): per query row, softmax over KV entries gathered by index
// from up to two paged caches (K = V, one shared KV head), per-head sink logit, fp32 accumulation, bf16 out.
#pragma once

#include "deepinfer/common.cuh"

namespace deepinfer::attention {

constexpr int kMaxKvLists = 2;

// FlashMLA "MODEL1" FP8 cache (common/attention_checks.h): per block, the tokens' 576-byte rows ([0, 448) e4m3 |
// [448, 576) 64 bf16 RoPE dims), then their 8-byte scales (7 UE8M0 exponents | pad): token t's row at byte 576 t of
// its block, its scales at byte 576 block_size + 8 t.
constexpr int kFp8EntryBytes = 584;
constexpr int kFp8RowBytes = 576;
constexpr int kFp8ScaleBytes = 8;
constexpr int kFp8NopeDims = 448;

struct SparseKvListParams {
  const void* cache;  // bf16 [num_blocks, block_size, head_dim]: entry (b, o) at b * block_stride + o * token_stride;
                      // or (is_fp8) uint8 [num_blocks, block_size, 584] in the block layout above (token_stride unused)
  int64_t block_stride, token_stride;  // elements of the cache dtype (64-bit: large page ids overflow 2^31 bytes)
  bool is_fp8;
  int64_t num_blocks;
  int block_size;
  const int32_t* indices;       // [rows, topk] contiguous; block_id * block_size + offset; invalid if < 0 or >= slots
  int topk;
  const int32_t* topk_length;   // [rows / rows_per_length] or nullptr (= topk); clamped to [0, topk]
};

struct SparseMqaParams {
  const __nv_bfloat16* q;  // [rows, num_heads, head_dim] contiguous
  __nv_bfloat16* out;      // [rows, num_heads, head_dim] contiguous
  float* lse;              // [rows, num_heads] contiguous, natural log, excludes the sink; -inf when no valid entry
  const float* attn_sink;  // [num_heads] or nullptr
  int64_t rows;
  int num_heads, head_dim;  // head_dim in {64, 128, 256, 512} (V4: 512)
  int rows_per_length;      // query rows per topk_length entry (s_q for decode, 1 for prefill)
  float softmax_scale;
  int num_lists;
  SparseKvListParams lists[kMaxKvLists];
};

void launch_sparse_mqa(const SparseMqaParams& p, cudaStream_t stream);

struct MqaLogitsParams {
  const __nv_bfloat16* q;  // [t, num_heads, head_dim] contiguous
  const float* weights;    // [t, num_heads]
  const void* k_cache;  // bf16 [num_blocks, block_size, head_dim] or (k_fp8) uint8 FP8 keys [.., head_dim + 4]
  bool k_fp8;           // FP8 keys: block_stride in bytes; codes at j * head_dim, scales at block_size * head_dim + 4 j
  int64_t block_stride, token_stride, num_blocks;  // elements of the cache's dtype
  int block_size;
  bool paged;                  // a block table was given (it may have no columns: every candidate invalid)
  const int32_t* block_table;  // [t, max_blocks] (paged), else unused (candidate c -> flat slot c)
  int max_blocks;
  const int32_t* k_start;  // [t] or nullptr
  const int32_t* k_end;    // [t] or nullptr
  float* logits;           // [t, num_candidates] contiguous
  int64_t t, num_candidates;
  int num_heads, head_dim;  // num_heads <= 128; head_dim 48, 64 or 128
};

void launch_mqa_logits(const MqaLogitsParams& p, cudaStream_t stream);

struct TopkParams {
  const float* scores;  // [rows, n], row stride score_row_stride
  int64_t score_row_stride;
  float* values;        // [rows, k]
  int64_t* indices;     // [rows, k]
  int64_t rows;
  int n, k;             // k <= min(n, 2048), n < 2^30
  int num_sms;          // of the device (sizes the number of CTAs per row; results do not depend on it)
  void* workspace;      // topk_rows_workspace_bytes(*this) bytes, 16-byte aligned, on the device (contents ignored)
  int64_t workspace_bytes;
};

// Workspace bytes launch_topk_rows needs for p (rows, n, k and num_sms set).
int64_t topk_rows_workspace_bytes(const TopkParams& p);
// The keys of a row, or of its chunks, in shared memory, then one select per row where the chunks' candidates fit
// (topk_row.cu); else radix select over several CTAs per row, then a bitonic sort of the k selected (topk.cu).
void launch_topk_rows(const TopkParams& p, cudaStream_t stream);

struct KvCacheWriteParams {
  char* cache;  // [num_blocks, block_size, row_bytes]; byte strides
  int64_t block_stride_bytes, token_stride_bytes, num_slots;
  int block_size;
  const char* src;  // [t, row_bytes], row stride src_row_stride_bytes
  int64_t src_row_stride_bytes, row_bytes, t;
  const int64_t* slot_mapping;  // [t]; < 0 or >= num_slots: skipped
};

void launch_kv_cache_write(const KvCacheWriteParams& p, cudaStream_t stream);

struct Fp8CacheParams {
  uint8_t* cache;  // [num_blocks, block_size, 584] MODEL1 (block layout above) or [.., head_dim + 4] indexer keys
                   // (const for dequant)
  int64_t block_stride, token_stride, num_slots;  // bytes (token_stride: indexer keys only)
  int block_size;
  int head_dim;         // indexer keys only: 48, 64 or 128
  __nv_bfloat16* rows;  // [t, 512] / [t, head_dim] (read by the write, written by the dequant), row stride elements
  int64_t row_stride, t;
  const int64_t* slot_mapping;  // [t]; invalid slots: skipped (write) or zero rows (dequant)
};

void launch_kv_cache_write_fp8(const Fp8CacheParams& p, cudaStream_t stream);
void launch_kv_cache_dequant_fp8(const Fp8CacheParams& p, cudaStream_t stream);
void launch_indexer_k_cache_write_fp8(const Fp8CacheParams& p, cudaStream_t stream);
void launch_indexer_k_cache_dequant_fp8(const Fp8CacheParams& p, cudaStream_t stream);

}  // namespace deepinfer::attention

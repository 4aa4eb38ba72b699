// Declarations of every op entry point, one section per domain. Each op has a shared
// argument check (csrc/common/<domain>_checks.h), a CPU implementation (csrc/cpu/<domain>/)
// and, when built with CUDA, a CUDA implementation (csrc/cuda/<domain>/). torch_bindings.cpp
// registers the schemas and binds each implementation to its dispatch key.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

namespace deepinfer {

// ---- norm ----
void rms_norm_cpu(at::Tensor& out, const at::Tensor& input, const std::optional<at::Tensor>& weight, double eps);
void rms_norm_cuda(at::Tensor& out, const at::Tensor& input, const std::optional<at::Tensor>& weight, double eps);

// ---- mhc ----
void hc_mix_cpu(at::Tensor& out, const at::Tensor& x, const at::Tensor& fn, double eps);
void hc_mix_cuda(at::Tensor& out, const at::Tensor& x, const at::Tensor& fn, double eps);
void hc_weights_cpu(at::Tensor& pre, at::Tensor& post, at::Tensor& comb, const at::Tensor& mix, const at::Tensor& base,
                    const at::Tensor& scale, double eps, int64_t sinkhorn_iters);
void hc_weights_cuda(at::Tensor& pre, at::Tensor& post, at::Tensor& comb, const at::Tensor& mix, const at::Tensor& base,
                     const at::Tensor& scale, double eps, int64_t sinkhorn_iters);
void hc_collapse_cpu(at::Tensor& out, const at::Tensor& streams, const at::Tensor& pre);
void hc_collapse_cuda(at::Tensor& out, const at::Tensor& streams, const at::Tensor& pre);
void hc_post_cpu(at::Tensor& out, const at::Tensor& streams, const at::Tensor& x, const at::Tensor& post,
                 const at::Tensor& comb);
void hc_post_cuda(at::Tensor& out, const at::Tensor& streams, const at::Tensor& x, const at::Tensor& post,
                  const at::Tensor& comb);

// ---- moe ----
void moe_combine_cpu(at::Tensor& out, const at::Tensor& y, const at::Tensor& slot_rows, const at::Tensor& weights);
void moe_combine_cuda(at::Tensor& out, const at::Tensor& y, const at::Tensor& slot_rows, const at::Tensor& weights);
void moe_permute_cpu(at::Tensor& m_indices, at::Tensor& token_of_row, at::Tensor& slot_rows,
                     const at::Tensor& topk_idx, int64_t num_experts);
void moe_permute_cuda(at::Tensor& m_indices, at::Tensor& token_of_row, at::Tensor& slot_rows,
                      const at::Tensor& topk_idx, int64_t num_experts);

// ---- sampling ----
void logsumexp_rows_cpu(at::Tensor& out, const at::Tensor& x);
void logsumexp_rows_cuda(at::Tensor& out, const at::Tensor& x);

// ---- quant ----
void per_token_group_quant_fp8_cpu(at::Tensor& out_q, at::Tensor& out_scale, const at::Tensor& input,
                                   int64_t group_size, bool scale_ue8m0);
void per_token_group_quant_fp8_cuda(at::Tensor& out_q, at::Tensor& out_scale, const at::Tensor& input,
                                    int64_t group_size, bool scale_ue8m0);

// ---- rope ----
void rotary_embedding_cpu(at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos_sin_cache, bool inverse);
void rotary_embedding_cuda(at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos_sin_cache, bool inverse);

// ---- gemm ----
void fp8_gemm_nt_cpu(at::Tensor& out, const at::Tensor& a, const at::Tensor& a_scale, const at::Tensor& b,
                     const at::Tensor& b_scale, bool accumulate, int64_t split_k);
void fp8_gemm_nt_cuda(at::Tensor& out, const at::Tensor& a, const at::Tensor& a_scale, const at::Tensor& b,
                      const at::Tensor& b_scale, bool accumulate, int64_t split_k);
void m_grouped_fp8_gemm_nt_contiguous_cpu(at::Tensor& out, const at::Tensor& a, const at::Tensor& a_scale,
                                          const at::Tensor& b, const at::Tensor& b_scale, const at::Tensor& m_indices);
void m_grouped_fp8_gemm_nt_contiguous_cuda(at::Tensor& out, const at::Tensor& a, const at::Tensor& a_scale,
                                           const at::Tensor& b, const at::Tensor& b_scale, const at::Tensor& m_indices);
void m_grouped_fp8_gemm_nt_masked_cpu(at::Tensor& out, const at::Tensor& a, const at::Tensor& a_scale,
                                      const at::Tensor& b, const at::Tensor& b_scale, const at::Tensor& masked_m);
void m_grouped_fp8_gemm_nt_masked_cuda(at::Tensor& out, const at::Tensor& a, const at::Tensor& a_scale,
                                       const at::Tensor& b, const at::Tensor& b_scale, const at::Tensor& masked_m);
void fp4_to_fp8_blockscaled_cpu(at::Tensor& out_q, at::Tensor& out_scale, const at::Tensor& w,
                                const at::Tensor& w_scale);
void swiglu_clamp_quant_fp8_cpu(at::Tensor& out_q, at::Tensor& out_scale, const at::Tensor& gate_up, double limit,
                                bool scale_ue8m0);
void swiglu_clamp_quant_fp8_cuda(at::Tensor& out_q, at::Tensor& out_scale, const at::Tensor& gate_up, double limit,
                                 bool scale_ue8m0);
// ---- attention ----
#define DEEPINFER_SPARSE_MQA_ARGS                                                                              \
  at::Tensor &out, at::Tensor &lse, const at::Tensor &q, const at::Tensor &kv_cache, const at::Tensor &indices, \
      const std::optional<at::Tensor> &topk_length, const std::optional<at::Tensor> &extra_kv_cache,           \
      const std::optional<at::Tensor> &extra_indices, const std::optional<at::Tensor> &extra_topk_length,      \
      const std::optional<at::Tensor> &attn_sink, double softmax_scale
void sparse_mqa_decode_cpu(DEEPINFER_SPARSE_MQA_ARGS);
void sparse_mqa_decode_cuda(DEEPINFER_SPARSE_MQA_ARGS);
void sparse_mqa_prefill_cpu(DEEPINFER_SPARSE_MQA_ARGS);
void sparse_mqa_prefill_cuda(DEEPINFER_SPARSE_MQA_ARGS);
#undef DEEPINFER_SPARSE_MQA_ARGS
void mqa_logits_cpu(at::Tensor& logits, const at::Tensor& q, const at::Tensor& weights, const at::Tensor& k_cache,
                    const std::optional<at::Tensor>& block_table, const std::optional<at::Tensor>& k_start,
                    const std::optional<at::Tensor>& k_end);
void mqa_logits_cuda(at::Tensor& logits, const at::Tensor& q, const at::Tensor& weights, const at::Tensor& k_cache,
                     const std::optional<at::Tensor>& block_table, const std::optional<at::Tensor>& k_start,
                     const std::optional<at::Tensor>& k_end);
void topk_rows_cpu(at::Tensor& values, at::Tensor& indices, const at::Tensor& scores);
void topk_rows_cuda(at::Tensor& values, at::Tensor& indices, const at::Tensor& scores);
void kv_cache_write_cpu(at::Tensor& kv_cache, const at::Tensor& kv, const at::Tensor& slot_mapping);
void kv_cache_write_cuda(at::Tensor& kv_cache, const at::Tensor& kv, const at::Tensor& slot_mapping);
void kv_cache_write_fp8_cpu(at::Tensor& kv_cache, const at::Tensor& kv, const at::Tensor& slot_mapping);
void kv_cache_write_fp8_cuda(at::Tensor& kv_cache, const at::Tensor& kv, const at::Tensor& slot_mapping);
void kv_cache_dequant_fp8_cpu(at::Tensor& out, const at::Tensor& kv_cache, const at::Tensor& slot_mapping);
void kv_cache_dequant_fp8_cuda(at::Tensor& out, const at::Tensor& kv_cache, const at::Tensor& slot_mapping);
void indexer_k_cache_write_fp8_cpu(at::Tensor& k_cache, const at::Tensor& k, const at::Tensor& slot_mapping);
void indexer_k_cache_write_fp8_cuda(at::Tensor& k_cache, const at::Tensor& k, const at::Tensor& slot_mapping);
void indexer_k_cache_dequant_fp8_cpu(at::Tensor& out, const at::Tensor& k_cache, const at::Tensor& slot_mapping);
void indexer_k_cache_dequant_fp8_cuda(at::Tensor& out, const at::Tensor& k_cache, const at::Tensor& slot_mapping);
void compressor_pool_cpu(at::Tensor& out, const at::Tensor& kv, const at::Tensor& gate);
void compressor_pool_cuda(at::Tensor& out, const at::Tensor& kv, const at::Tensor& gate);
void compressor_pool_rows_cpu(at::Tensor& out, const at::Tensor& ring_kv, const at::Tensor& ring_gate,
                              const at::Tensor& new_kv, const at::Tensor& new_gate, const at::Tensor& ape,
                              const at::Tensor& ring_src, const at::Tensor& cur, const std::optional<at::Tensor>& prev,
                              const std::optional<at::Tensor>& prev_ok, const at::Tensor& dst);
void decode_plan_fill_cpu(at::Tensor& out, const at::Tensor& c0, const at::Tensor& query_lens,
                          const at::Tensor& row_starts, const at::Tensor& block_tables, const at::Tensor& window_tables,
                          const at::Tensor& shared_len, const at::Tensor& input_ids, const at::Tensor& logits_indices,
                          int64_t num_seqs, int64_t tokens_per_seq, int64_t max_blocks, int64_t block_size,
                          int64_t lookback, at::IntArrayRef ratios, at::IntArrayRef overlaps);
void step_tables_check_cpu(at::Tensor& out, const at::Tensor& c0, const at::Tensor& query_lens,
                           const at::Tensor& block_tables, const at::Tensor& window_tables,
                           const at::Tensor& shared_len, const at::Tensor& window_floor, int64_t block_size,
                           int64_t lookback, int64_t num_blocks, int64_t window_blocks, int64_t max_positions);
void compressor_state_write_cpu(at::Tensor& ring_kv, at::Tensor& ring_gate, const at::Tensor& new_kv,
                                const at::Tensor& new_gate, const at::Tensor& ring_src, const at::Tensor& st_src,
                                const at::Tensor& st_dst);
void compressor_pool_rows_cuda(at::Tensor& out, const at::Tensor& ring_kv, const at::Tensor& ring_gate,
                              const at::Tensor& new_kv, const at::Tensor& new_gate, const at::Tensor& ape,
                              const at::Tensor& ring_src, const at::Tensor& cur, const std::optional<at::Tensor>& prev,
                              const std::optional<at::Tensor>& prev_ok, const at::Tensor& dst);
void compressor_state_write_cuda(at::Tensor& ring_kv, at::Tensor& ring_gate, const at::Tensor& new_kv,
                                const at::Tensor& new_gate, const at::Tensor& ring_src, const at::Tensor& st_src,
                                const at::Tensor& st_dst);

}  // namespace deepinfer

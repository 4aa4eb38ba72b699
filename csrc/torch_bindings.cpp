// Schemas of every deepinfer op and their implementations per dispatch key.
// Conventions: preallocated outputs first and marked `Tensor!` (mutated); the CUDA stream is the
// current stream, read inside the op. Fake (meta) implementations live in
// python/deepinfer_ops/_fake.py (torch.library.register_fake), one per op.
#include <torch/library.h>

#include "ops.h"

TORCH_LIBRARY(deepinfer_ops, m) {
  // norm
  m.def("rms_norm(Tensor! out, Tensor input, Tensor? weight, float eps) -> ()");
  // mhc
  m.def("hc_mix(Tensor! out, Tensor x, Tensor fn, float eps) -> ()");
  m.def(
      "hc_weights(Tensor! pre, Tensor! post, Tensor! comb, Tensor mix, Tensor base, Tensor scale, float eps, "
      "int sinkhorn_iters) -> ()");
  m.def("hc_collapse(Tensor! out, Tensor streams, Tensor pre) -> ()");
  m.def("hc_post(Tensor! out, Tensor streams, Tensor x, Tensor post, Tensor comb) -> ()");
  // sampling
  m.def("logsumexp_rows(Tensor! out, Tensor x) -> ()");
  // quant
  m.def(
      "per_token_group_quant_fp8(Tensor! out_q, Tensor! out_scale, Tensor input, int group_size, "
      "bool scale_ue8m0) -> ()");
  // rope
  m.def("rotary_embedding(Tensor! x, Tensor positions, Tensor cos_sin_cache, bool inverse) -> ()");
  // gemm
  m.def(
      "fp8_gemm_nt(Tensor! out, Tensor a, Tensor a_scale, Tensor b, Tensor b_scale, bool accumulate, "
      "int split_k=1) -> ()");
  m.def(
      "m_grouped_fp8_gemm_nt_contiguous(Tensor! out, Tensor a, Tensor a_scale, Tensor b, Tensor b_scale, "
      "Tensor m_indices) -> ()");
  m.def(
      "m_grouped_fp8_gemm_nt_masked(Tensor! out, Tensor a, Tensor a_scale, Tensor b, Tensor b_scale, "
      "Tensor masked_m) -> ()");
  m.def("fp4_to_fp8_blockscaled(Tensor! out_q, Tensor! out_scale, Tensor w, Tensor w_scale) -> ()");
  m.def(
      "swiglu_clamp_quant_fp8(Tensor! out_q, Tensor! out_scale, Tensor gate_up, float limit, bool scale_ue8m0) -> ()");
  m.def("moe_combine(Tensor! out, Tensor y, Tensor slot_rows, Tensor weights) -> ()");
  m.def(
      "moe_permute(Tensor! m_indices, Tensor! token_of_row, Tensor! slot_rows, Tensor topk_idx, int num_experts) "
      "-> ()");
  // attention
  m.def(
      "sparse_mqa_decode(Tensor! out, Tensor! lse, Tensor q, Tensor kv_cache, Tensor indices, Tensor? topk_length, "
      "Tensor? extra_kv_cache, Tensor? extra_indices, Tensor? extra_topk_length, Tensor? attn_sink, "
      "float softmax_scale) -> ()");
  m.def(
      "sparse_mqa_prefill(Tensor! out, Tensor! lse, Tensor q, Tensor kv_cache, Tensor indices, Tensor? topk_length, "
      "Tensor? extra_kv_cache, Tensor? extra_indices, Tensor? extra_topk_length, Tensor? attn_sink, "
      "float softmax_scale) -> ()");
  m.def(
      "mqa_logits(Tensor! logits, Tensor q, Tensor weights, Tensor k_cache, Tensor? block_table, Tensor? k_start, "
      "Tensor? k_end) -> ()");
  m.def("topk_rows(Tensor! values, Tensor! indices, Tensor scores) -> ()");
  m.def("kv_cache_write(Tensor! kv_cache, Tensor kv, Tensor slot_mapping) -> ()");
  m.def("kv_cache_write_fp8(Tensor! kv_cache, Tensor kv, Tensor slot_mapping) -> ()");
  m.def("kv_cache_dequant_fp8(Tensor! out, Tensor kv_cache, Tensor slot_mapping) -> ()");
  m.def("indexer_k_cache_write_fp8(Tensor! k_cache, Tensor k, Tensor slot_mapping) -> ()");
  m.def("indexer_k_cache_dequant_fp8(Tensor! out, Tensor k_cache, Tensor slot_mapping) -> ()");
  m.def("compressor_pool(Tensor! out, Tensor kv, Tensor gate) -> ()");
  m.def("compressor_pool_rows(Tensor! out, Tensor ring_kv, Tensor ring_gate, Tensor new_kv, Tensor new_gate, "
        "Tensor ape, Tensor ring_src, Tensor cur, Tensor? prev, Tensor? prev_ok, Tensor dst) -> ()");
  // engine host work: a graph-mode decode step's plan lists (CPU tensors only)
  m.def(
      "decode_plan_fill(Tensor! out, Tensor c0, Tensor query_lens, Tensor row_starts, Tensor block_tables, "
      "Tensor window_tables, Tensor shared_len, Tensor input_ids, Tensor logits_indices, int num_seqs, "
      "int tokens_per_seq, int max_blocks, int block_size, int lookback, int[] ratios, int[] overlaps) -> ()");
  m.def("step_tables_check(Tensor! out, Tensor c0, Tensor query_lens, Tensor block_tables, Tensor window_tables, "
        "Tensor shared_len, Tensor window_floor, int block_size, int lookback, int num_blocks, int window_blocks, "
        "int max_positions) -> ()");
  m.def("compressor_state_write(Tensor! ring_kv, Tensor! ring_gate, Tensor new_kv, Tensor new_gate, Tensor ring_src, "
        "Tensor st_src, Tensor st_dst) -> ()");
}

TORCH_LIBRARY_IMPL(deepinfer_ops, CPU, m) {
  m.impl("rms_norm", &deepinfer::rms_norm_cpu);
  m.impl("hc_mix", &deepinfer::hc_mix_cpu);
  m.impl("hc_weights", &deepinfer::hc_weights_cpu);
  m.impl("hc_collapse", &deepinfer::hc_collapse_cpu);
  m.impl("hc_post", &deepinfer::hc_post_cpu);
  m.impl("per_token_group_quant_fp8", &deepinfer::per_token_group_quant_fp8_cpu);
  m.impl("rotary_embedding", &deepinfer::rotary_embedding_cpu);
  m.impl("fp8_gemm_nt", &deepinfer::fp8_gemm_nt_cpu);
  m.impl("m_grouped_fp8_gemm_nt_contiguous", &deepinfer::m_grouped_fp8_gemm_nt_contiguous_cpu);
  m.impl("m_grouped_fp8_gemm_nt_masked", &deepinfer::m_grouped_fp8_gemm_nt_masked_cpu);
  m.impl("fp4_to_fp8_blockscaled", &deepinfer::fp4_to_fp8_blockscaled_cpu);
  m.impl("swiglu_clamp_quant_fp8", &deepinfer::swiglu_clamp_quant_fp8_cpu);
  m.impl("moe_combine", &deepinfer::moe_combine_cpu);
  m.impl("moe_permute", &deepinfer::moe_permute_cpu);
  m.impl("sparse_mqa_decode", &deepinfer::sparse_mqa_decode_cpu);
  m.impl("sparse_mqa_prefill", &deepinfer::sparse_mqa_prefill_cpu);
  m.impl("mqa_logits", &deepinfer::mqa_logits_cpu);
  m.impl("topk_rows", &deepinfer::topk_rows_cpu);
  m.impl("kv_cache_write", &deepinfer::kv_cache_write_cpu);
  m.impl("kv_cache_write_fp8", &deepinfer::kv_cache_write_fp8_cpu);
  m.impl("kv_cache_dequant_fp8", &deepinfer::kv_cache_dequant_fp8_cpu);
  m.impl("indexer_k_cache_write_fp8", &deepinfer::indexer_k_cache_write_fp8_cpu);
  m.impl("indexer_k_cache_dequant_fp8", &deepinfer::indexer_k_cache_dequant_fp8_cpu);
  m.impl("compressor_pool", &deepinfer::compressor_pool_cpu);
  m.impl("compressor_pool_rows", &deepinfer::compressor_pool_rows_cpu);
  m.impl("compressor_state_write", &deepinfer::compressor_state_write_cpu);
  m.impl("decode_plan_fill", &deepinfer::decode_plan_fill_cpu);
  m.impl("step_tables_check", &deepinfer::step_tables_check_cpu);
  m.impl("logsumexp_rows", &deepinfer::logsumexp_rows_cpu);
}

#ifdef DEEPINFER_WITH_CUDA
TORCH_LIBRARY_IMPL(deepinfer_ops, CUDA, m) {
  m.impl("rms_norm", &deepinfer::rms_norm_cuda);
  m.impl("hc_mix", &deepinfer::hc_mix_cuda);
  m.impl("hc_weights", &deepinfer::hc_weights_cuda);
  m.impl("hc_collapse", &deepinfer::hc_collapse_cuda);
  m.impl("hc_post", &deepinfer::hc_post_cuda);
  m.impl("per_token_group_quant_fp8", &deepinfer::per_token_group_quant_fp8_cuda);
  m.impl("rotary_embedding", &deepinfer::rotary_embedding_cuda);
  m.impl("fp8_gemm_nt", &deepinfer::fp8_gemm_nt_cuda);
  m.impl("m_grouped_fp8_gemm_nt_contiguous", &deepinfer::m_grouped_fp8_gemm_nt_contiguous_cuda);
  m.impl("m_grouped_fp8_gemm_nt_masked", &deepinfer::m_grouped_fp8_gemm_nt_masked_cuda);
  m.impl("swiglu_clamp_quant_fp8", &deepinfer::swiglu_clamp_quant_fp8_cuda);
  m.impl("moe_combine", &deepinfer::moe_combine_cuda);
  m.impl("moe_permute", &deepinfer::moe_permute_cuda);
  m.impl("sparse_mqa_decode", &deepinfer::sparse_mqa_decode_cuda);
  m.impl("sparse_mqa_prefill", &deepinfer::sparse_mqa_prefill_cuda);
  m.impl("mqa_logits", &deepinfer::mqa_logits_cuda);
  m.impl("topk_rows", &deepinfer::topk_rows_cuda);
  m.impl("kv_cache_write", &deepinfer::kv_cache_write_cuda);
  m.impl("kv_cache_write_fp8", &deepinfer::kv_cache_write_fp8_cuda);
  m.impl("kv_cache_dequant_fp8", &deepinfer::kv_cache_dequant_fp8_cuda);
  m.impl("indexer_k_cache_write_fp8", &deepinfer::indexer_k_cache_write_fp8_cuda);
  m.impl("indexer_k_cache_dequant_fp8", &deepinfer::indexer_k_cache_dequant_fp8_cuda);
  m.impl("compressor_pool", &deepinfer::compressor_pool_cuda);
  m.impl("compressor_pool_rows", &deepinfer::compressor_pool_rows_cuda);
  m.impl("compressor_state_write", &deepinfer::compressor_state_write_cuda);
  m.impl("logsumexp_rows", &deepinfer::logsumexp_rows_cuda);
}
#endif

// Torch-facing CUDA entry points of the attention domain: shared checks, CUDA-only limits, params, launch on the
// current stream.
#include "cuda/torch_utils.h"
#include "common/attention_checks.h"
#include "deepinfer/attention/compressor_pool.cuh"
#include "deepinfer/attention/sparse_mqa.cuh"
#include "ops.h"

namespace deepinfer {
namespace {

void run_sparse_mqa_cuda(const char* op, const SparseMqaArgs& a) {
  const int64_t rows = a.q.size(0), h = a.q.size(1), d = a.q.size(2);
  if (rows == 0 || h == 0) return;
  DEEPINFER_CHECK(a.q.is_cuda(), op, "q must be a CUDA tensor");
  DEEPINFER_CHECK(rows < (int64_t(1) << 31), op, "rows = ", rows, " exceeds the grid limit 2^31 - 1");
  DEEPINFER_CHECK(is_aligned(a.q.const_data_ptr(), 16) && is_aligned(a.out.const_data_ptr(), 16), op,
                  "q and out must be 16-byte aligned");
  const c10::cuda::CUDAGuard guard(a.q.device());
  attention::SparseMqaParams p{};
  p.q = static_cast<const __nv_bfloat16*>(a.q.const_data_ptr());
  p.out = static_cast<__nv_bfloat16*>(a.out.mutable_data_ptr());
  p.lse = a.lse.mutable_data_ptr<float>();
  p.attn_sink = a.attn_sink.defined() ? a.attn_sink.const_data_ptr<float>() : nullptr;
  p.rows = rows;
  p.num_heads = static_cast<int>(h);
  p.head_dim = static_cast<int>(d);
  p.rows_per_length = static_cast<int>(a.rows_per_length);
  p.softmax_scale = static_cast<float>(a.softmax_scale);
  p.num_lists = static_cast<int>(a.lists.size());
  for (size_t l = 0; l < a.lists.size(); ++l) {
    const auto& kl = a.lists[l];
    const char* name = l == 0 ? "kv_cache" : "extra_kv_cache";
    const bool fp8 = kl.cache.scalar_type() == at::kByte;
    if (fp8) {
      DEEPINFER_CHECK(kl.cache.numel() == 0 || (is_aligned(kl.cache.const_data_ptr(), 8) &&
                                                 kl.cache.stride(0) % 8 == 0),  // tokens: 576 B rows, 8 B scales
                      op, name, " (FP8) must be 8-byte aligned with a block stride that is a multiple of 8, ",
                      "got strides ", kl.cache.strides());
    } else {
      DEEPINFER_CHECK(kl.cache.numel() == 0 || (is_aligned(kl.cache.const_data_ptr(), 16) &&
                                                 kl.cache.stride(0) % 8 == 0 && kl.cache.stride(1) % 8 == 0),
                      op, name, " must be 16-byte aligned with strides that are multiples of 8 elements, got strides ",
                      kl.cache.strides());
    }
    DEEPINFER_CHECK(kl.indices.size(1) < (int64_t(1) << 31), op, "topk too large");
    auto& lp = p.lists[l];
    lp.cache = kl.cache.const_data_ptr();
    lp.is_fp8 = fp8;
    lp.block_stride = kl.cache.stride(0);
    lp.token_stride = kl.cache.stride(1);
    lp.num_blocks = kl.cache.numel() == 0 ? 0 : kl.cache.size(0);
    lp.block_size = static_cast<int>(kl.cache.size(1));
    lp.indices = kl.indices.const_data_ptr<int32_t>();
    lp.topk = static_cast<int>(kl.indices.size(1));
    lp.topk_length = kl.topk_length.defined() ? kl.topk_length.const_data_ptr<int32_t>() : nullptr;
  }
  attention::launch_sparse_mqa(p, current_stream());
}

}  // namespace

void sparse_mqa_decode_cuda(at::Tensor& out, at::Tensor& lse, const at::Tensor& q, const at::Tensor& kv_cache,
                            const at::Tensor& indices, const std::optional<at::Tensor>& topk_length,
                            const std::optional<at::Tensor>& extra_kv_cache,
                            const std::optional<at::Tensor>& extra_indices,
                            const std::optional<at::Tensor>& extra_topk_length,
                            const std::optional<at::Tensor>& attn_sink, double softmax_scale) {
  auto a = check_sparse_mqa("sparse_mqa_decode", false, out, lse, q, kv_cache, indices, topk_length, extra_kv_cache,
                            extra_indices, extra_topk_length, attn_sink, softmax_scale);
  run_sparse_mqa_cuda("sparse_mqa_decode", a);
}

void sparse_mqa_prefill_cuda(at::Tensor& out, at::Tensor& lse, const at::Tensor& q, const at::Tensor& kv_cache,
                             const at::Tensor& indices, const std::optional<at::Tensor>& topk_length,
                             const std::optional<at::Tensor>& extra_kv_cache,
                             const std::optional<at::Tensor>& extra_indices,
                             const std::optional<at::Tensor>& extra_topk_length,
                             const std::optional<at::Tensor>& attn_sink, double softmax_scale) {
  auto a = check_sparse_mqa("sparse_mqa_prefill", true, out, lse, q, kv_cache, indices, topk_length, extra_kv_cache,
                            extra_indices, extra_topk_length, attn_sink, softmax_scale);
  run_sparse_mqa_cuda("sparse_mqa_prefill", a);
}

void mqa_logits_cuda(at::Tensor& logits, const at::Tensor& q, const at::Tensor& weights, const at::Tensor& k_cache,
                     const std::optional<at::Tensor>& block_table, const std::optional<at::Tensor>& k_start,
                     const std::optional<at::Tensor>& k_end) {
  const char* op = "mqa_logits";
  check_mqa_logits(logits, q, weights, k_cache, block_table, k_start, k_end);
  const int64_t t = q.size(0), n = logits.size(1);
  if (t == 0 || n == 0) return;
  DEEPINFER_CHECK(q.size(1) <= 128, op, "num_heads must be <= 128 on CUDA, got ", q.size(1));
  const bool k_fp8 = k_cache.scalar_type() == at::kByte;
  if (k_fp8) {
    DEEPINFER_CHECK(k_cache.numel() == 0 || (is_aligned(k_cache.const_data_ptr(), 16) && k_cache.stride(0) % 16 == 0),
                    op, "k_cache (FP8 keys) must be 16-byte aligned with a block stride that is a multiple of 16");
  } else {
    DEEPINFER_CHECK(k_cache.numel() == 0 || (is_aligned(k_cache.const_data_ptr(), 16) && k_cache.stride(0) % 8 == 0 &&
                                              k_cache.stride(1) % 8 == 0),
                    op, "k_cache must be 16-byte aligned with strides that are multiples of 8 elements");
  }
  const c10::cuda::CUDAGuard guard(q.device());
  attention::MqaLogitsParams p{};
  p.q = static_cast<const __nv_bfloat16*>(q.const_data_ptr());
  p.weights = weights.const_data_ptr<float>();
  p.k_cache = k_cache.const_data_ptr();
  p.k_fp8 = k_fp8;
  p.block_stride = k_cache.stride(0);
  p.token_stride = k_cache.stride(1);
  p.num_blocks = k_cache.numel() == 0 ? 0 : k_cache.size(0);
  p.block_size = static_cast<int>(k_cache.size(1));
  p.paged = block_table.has_value();
  p.block_table = p.paged ? block_table->const_data_ptr<int32_t>() : nullptr;
  p.max_blocks = block_table.has_value() ? static_cast<int>(block_table->size(1)) : 0;
  p.k_start = k_start.has_value() ? k_start->const_data_ptr<int32_t>() : nullptr;
  p.k_end = k_end.has_value() ? k_end->const_data_ptr<int32_t>() : nullptr;
  p.logits = logits.mutable_data_ptr<float>();
  p.t = t;
  p.num_candidates = n;
  p.num_heads = static_cast<int>(q.size(1));
  p.head_dim = static_cast<int>(q.size(2));
  attention::launch_mqa_logits(p, current_stream());
}

void topk_rows_cuda(at::Tensor& values, at::Tensor& indices, const at::Tensor& scores) {
  const char* op = "topk_rows";
  check_topk_rows(values, indices, scores);
  const int64_t rows = scores.size(0), k = values.size(1);
  if (rows == 0 || k == 0) return;
  DEEPINFER_CHECK(k <= kTopkMaxK, op, "k = ", k, " exceeds the CUDA limit ", kTopkMaxK);
  DEEPINFER_CHECK(scores.size(1) < (int64_t(1) << 30), op, "n = ", scores.size(1), " must be < 2^30 on CUDA");
  const c10::cuda::CUDAGuard guard(scores.device());
  attention::TopkParams p{};
  p.scores = scores.const_data_ptr<float>();
  p.score_row_stride = scores.stride(0);
  p.values = values.mutable_data_ptr<float>();
  p.indices = indices.mutable_data_ptr<int64_t>();
  p.rows = rows;
  p.n = static_cast<int>(scores.size(1));
  p.k = static_cast<int>(k);
  DEEPINFER_CUDA_CHECK(cudaDeviceGetAttribute(&p.num_sms, cudaDevAttrMultiProcessorCount, scores.device().index()));
  const int64_t ws_bytes = attention::topk_rows_workspace_bytes(p);
  const at::Tensor workspace = at::empty({ws_bytes}, scores.options().dtype(at::kByte));  // stream-ordered reuse
  p.workspace = workspace.mutable_data_ptr();
  p.workspace_bytes = ws_bytes;
  attention::launch_topk_rows(p, current_stream());
}

void kv_cache_write_cuda(at::Tensor& kv_cache, const at::Tensor& kv, const at::Tensor& slot_mapping) {
  check_kv_cache_write(kv_cache, kv, slot_mapping);
  if (kv.size(0) == 0 || kv_cache.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(kv_cache.device());
  const int64_t es = kv.element_size();
  attention::KvCacheWriteParams p{};
  p.cache = static_cast<char*>(kv_cache.mutable_data_ptr());
  p.block_stride_bytes = kv_cache.stride(0) * es;
  p.token_stride_bytes = kv_cache.stride(1) * es;
  p.block_size = static_cast<int>(kv_cache.size(1));
  p.num_slots = kv_cache.size(0) * kv_cache.size(1);
  p.src = static_cast<const char*>(kv.const_data_ptr());
  p.src_row_stride_bytes = kv.stride(0) * es;
  p.row_bytes = kv.size(1) * es;
  p.t = kv.size(0);
  p.slot_mapping = slot_mapping.const_data_ptr<int64_t>();
  attention::launch_kv_cache_write(p, current_stream());
}

namespace {

attention::Fp8CacheParams fp8_params(const at::Tensor& kv_cache, const at::Tensor& rows,
                                     const at::Tensor& slot_mapping) {
  attention::Fp8CacheParams p{};
  p.cache = static_cast<uint8_t*>(const_cast<void*>(kv_cache.const_data_ptr()));
  p.block_stride = kv_cache.stride(0);
  p.token_stride = kv_cache.stride(1);
  p.block_size = static_cast<int>(kv_cache.size(1));
  p.num_slots = kv_cache.size(0) * kv_cache.size(1);
  p.head_dim = static_cast<int>(rows.size(1));
  p.rows = static_cast<__nv_bfloat16*>(const_cast<void*>(rows.const_data_ptr()));
  p.row_stride = rows.stride(0);
  p.t = rows.size(0);
  p.slot_mapping = slot_mapping.const_data_ptr<int64_t>();
  return p;
}

}  // namespace

void kv_cache_write_fp8_cuda(at::Tensor& kv_cache, const at::Tensor& kv, const at::Tensor& slot_mapping) {
  check_fp8_cache("kv_cache_write_fp8", kv_cache, kv, "kv", slot_mapping, /*writes_cache=*/true);
  if (kv.size(0) == 0 || kv_cache.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(kv_cache.device());
  attention::launch_kv_cache_write_fp8(fp8_params(kv_cache, kv, slot_mapping), current_stream());
}

void kv_cache_dequant_fp8_cuda(at::Tensor& out, const at::Tensor& kv_cache, const at::Tensor& slot_mapping) {
  check_fp8_cache("kv_cache_dequant_fp8", kv_cache, out, "out", slot_mapping, /*writes_cache=*/false);
  if (out.size(0) == 0) return;
  const c10::cuda::CUDAGuard guard(kv_cache.device());
  attention::launch_kv_cache_dequant_fp8(fp8_params(kv_cache, out, slot_mapping), current_stream());
}

void compressor_pool_cuda(at::Tensor& out, const at::Tensor& kv, const at::Tensor& gate) {
  check_compressor_pool(out, kv, gate);
  if (out.numel() == 0) return;
  DEEPINFER_CHECK(out.numel() / 256 < (int64_t(1) << 31), "compressor_pool", "out has ", out.numel(),
                  " elements, beyond the CUDA grid limit");
  const c10::cuda::CUDAGuard guard(kv.device());
  attention::CompressorPoolParams p{};
  p.kv = kv.const_data_ptr();
  p.gate = gate.const_data_ptr<float>();
  p.out = out.mutable_data_ptr();
  p.n = kv.size(0);
  p.S = kv.size(1);
  p.hd = kv.size(2);
  p.kv_n = kv.stride(0);
  p.kv_s = kv.stride(1);
  p.gate_n = gate.stride(0);
  p.gate_s = gate.stride(1);
  p.dtype = to_dtype(kv.scalar_type());
  attention::launch_compressor_pool(p, current_stream());
}

namespace {
attention::CompressorRows compressor_rows(const at::Tensor& ring_kv, const at::Tensor& ring_gate,
                                          const at::Tensor& new_kv, const at::Tensor& new_gate,
                                          const at::Tensor& ring_src) {
  attention::CompressorRows r{};
  r.ring_kv = ring_kv.const_data_ptr();
  r.ring_gate = ring_gate.const_data_ptr();
  r.new_kv = new_kv.const_data_ptr();
  r.new_gate = new_gate.const_data_ptr();
  r.ring_src = ring_src.const_data_ptr<int64_t>();
  r.ring_slots = ring_kv.size(0);
  r.new_rows = new_kv.size(0);
  r.new_kv_ld = new_kv.stride(0);
  r.new_gate_ld = new_gate.stride(0);
  r.n_ring = ring_src.size(0);
  r.C = ring_kv.size(1);
  r.dtype = to_dtype(ring_kv.scalar_type());
  return r;
}
}  // namespace

void compressor_pool_rows_cuda(at::Tensor& out, const at::Tensor& ring_kv, const at::Tensor& ring_gate,
                               const at::Tensor& new_kv, const at::Tensor& new_gate, const at::Tensor& ape,
                               const at::Tensor& ring_src, const at::Tensor& cur, const std::optional<at::Tensor>& prev,
                               const std::optional<at::Tensor>& prev_ok, const at::Tensor& dst) {
  check_compressor_pool_rows(out, ring_kv, ring_gate, new_kv, new_gate, ape, ring_src, cur, prev, prev_ok, dst);
  if (out.numel() == 0) return;
  DEEPINFER_CHECK(out.numel() / 256 < (int64_t(1) << 31), "compressor_pool_rows", "out has ", out.numel(),
                  " elements, beyond the CUDA grid limit");
  const c10::cuda::CUDAGuard guard(ring_kv.device());
  attention::CompressorPoolRowsParams p{};
  p.rows = compressor_rows(ring_kv, ring_gate, new_kv, new_gate, ring_src);
  p.ape = ape.const_data_ptr<float>();
  p.cur = cur.const_data_ptr<int64_t>();
  p.prev = prev.has_value() ? prev->const_data_ptr<int64_t>() : nullptr;
  p.prev_ok = prev_ok.has_value() ? prev_ok->const_data_ptr<int64_t>() : nullptr;
  p.dst = dst.const_data_ptr<int64_t>();
  p.out = out.mutable_data_ptr();
  p.n = cur.size(0);
  p.m = cur.size(1);
  p.hd = out.size(1);
  attention::launch_compressor_pool_rows(p, current_stream());
}

void compressor_state_write_cuda(at::Tensor& ring_kv, at::Tensor& ring_gate, const at::Tensor& new_kv,
                                 const at::Tensor& new_gate, const at::Tensor& ring_src, const at::Tensor& st_src,
                                 const at::Tensor& st_dst) {
  check_compressor_state_write(ring_kv, ring_gate, new_kv, new_gate, ring_src, st_src, st_dst);
  if (st_src.numel() == 0 || ring_kv.numel() == 0) return;
  DEEPINFER_CHECK(st_src.numel() * ring_kv.size(1) / 256 < (int64_t(1) << 31), "compressor_state_write",
                  "too many state rows for the CUDA grid");
  const c10::cuda::CUDAGuard guard(ring_kv.device());
  attention::CompressorStateWriteParams p{};
  p.rows = compressor_rows(ring_kv, ring_gate, new_kv, new_gate, ring_src);
  p.ring_kv = ring_kv.mutable_data_ptr();
  p.ring_gate = ring_gate.mutable_data_ptr();
  p.st_src = st_src.const_data_ptr<int64_t>();
  p.st_dst = st_dst.const_data_ptr<int64_t>();
  p.n_st = st_src.size(0);
  attention::launch_compressor_state_write(p, current_stream());
}

void indexer_k_cache_write_fp8_cuda(at::Tensor& k_cache, const at::Tensor& k, const at::Tensor& slot_mapping) {
  check_indexer_k_cache_fp8("indexer_k_cache_write_fp8", k_cache, k, "k", slot_mapping, /*writes_cache=*/true);
  if (k.size(0) == 0 || k_cache.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(k_cache.device());
  attention::launch_indexer_k_cache_write_fp8(fp8_params(k_cache, k, slot_mapping), current_stream());
}

void indexer_k_cache_dequant_fp8_cuda(at::Tensor& out, const at::Tensor& k_cache, const at::Tensor& slot_mapping) {
  check_indexer_k_cache_fp8("indexer_k_cache_dequant_fp8", k_cache, out, "out", slot_mapping, /*writes_cache=*/false);
  if (out.size(0) == 0) return;
  const c10::cuda::CUDAGuard guard(k_cache.device());
  attention::launch_indexer_k_cache_dequant_fp8(fp8_params(k_cache, out, slot_mapping), current_stream());
}

}  // namespace deepinfer

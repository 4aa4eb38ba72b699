// Torch-facing CUDA entry points of the gemm domain: argument checks, operand layout normalisation (scale
// tensors into the layouts the kernels read), workspace allocation, then the launchers in
// csrc/cuda/gemm/instantiations/ (CUTLASS) and swiglu_clamp_quant_fp8.cu.
#include <limits>

#include "common/gemm_checks.h"
#include "cuda/torch_utils.h"
#include "deepinfer/common.cuh"
#include "deepinfer/gemm/fp8_gemm.cuh"
#include "deepinfer/gemm/swiglu_clamp_quant_fp8.cuh"
#include "ops.h"

namespace deepinfer {
namespace {

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

bool aligned16(const void* p) { return is_aligned(p, 16); }

void check_tma_operand(const char* op, const at::Tensor& t, const char* name, int64_t row_stride, int elem_bytes) {
  DEEPINFER_CHECK(aligned16(t.const_data_ptr()), op, name, " must be 16-byte aligned for TMA");
  DEEPINFER_CHECK((row_stride * elem_bytes) % 16 == 0, op, name, " row stride (", row_stride,
                  " elements) must be a multiple of 16 bytes for TMA (for A/B: K % 16 == 0; for out: N % ",
                  16 / elem_bytes, " == 0)");
}

// 2-D scales [rows, kb] as an M-major buffer: returns (tensor holding the data, leading dim) with
// element (r, kb) at ptr[kb * ld + r]. With tma (the dense kernel loads A scales with TMA and CUTLASS requires the
// scale layout's M extent and strides to be multiples of 4 floats), the buffer must also hold round_up(rows, 4)
// rows per K block (the padding rows, whatever they hold, only meet A rows that TMA zero-fills and D rows that are
// not stored), ld % 4 == 0 and a 16-byte-aligned base -- quant.scale_buffer's layout --; otherwise the scales are
// copied into such a buffer (zero-padded rows). Without tma, any M-major layout is read in place.
std::pair<at::Tensor, int64_t> m_major_scales(const at::Tensor& s, bool tma) {
  const int64_t rows = s.size(0), kb = s.size(1);
  const int64_t need_rows = tma ? round_up(std::max<int64_t>(rows, 1), 4) : rows;
  const bool m_major = rows <= 1 || s.stride(0) == 1;
  const int64_t ld = kb <= 1 ? need_rows : s.stride(1);
  // The padding rows of the last K block must lie inside the tensor's storage.
  const bool holds_padding =
      rows == need_rows ||
      (s.storage_offset() + (kb - 1) * ld + need_rows) * static_cast<int64_t>(sizeof(float)) <=
          static_cast<int64_t>(s.storage().nbytes());
  // The kernel takes ld and the layout's batch stride ld * kb as int: a larger ld (a view into a buffer of
  // >= 8 GiB) would wrap, so such a view is copied too.
  const bool fits_int = ld * std::max<int64_t>(kb, 1) <= std::numeric_limits<int>::max();
  const bool direct = m_major && ld >= need_rows && fits_int &&
                      (!tma || (holds_padding && ld % 4 == 0 && aligned16(s.const_data_ptr())));
  if (direct) return {s, ld};
  const int64_t ld_new = round_up(std::max<int64_t>(rows, 1), 4);
  auto buf = at::zeros({kb, ld_new}, s.options());
  buf.narrow(1, 0, rows).copy_(s.t());
  return {buf, ld_new};
}

// [..., nb, kb] scales as K-major rows: returns (tensor, row stride); group stride = tensor.stride(0) for 3-D.
at::Tensor k_major_scales(const at::Tensor& s) {
  const int64_t kb = s.size(-1);
  if (kb == 1 || s.stride(-1) == 1) return s;
  return s.contiguous();
}

}  // namespace

void fp8_gemm_nt_cuda(at::Tensor& out, const at::Tensor& a, const at::Tensor& a_scale, const at::Tensor& b,
                      const at::Tensor& b_scale, bool accumulate, int64_t split_k) {
  const char* op = "fp8_gemm_nt";
  check_fp8_gemm_nt(out, a, a_scale, b, b_scale, accumulate, split_k);
  const int64_t M = a.size(0), K = a.size(1), N = b.size(0);
  if (M == 0 || N == 0) return;
  const c10::cuda::CUDAGuard guard(out.device());
  if (K == 0) {
    if (!accumulate) out.zero_();
    return;
  }
  const bool fp32 = out.scalar_type() == at::kFloat;
  check_tma_operand(op, a, "a", a.stride(0), 1);
  check_tma_operand(op, b, "b", b.stride(0), 1);
  check_tma_operand(op, out, "out", out.stride(0), fp32 ? 4 : 2);
  // M < 2^31 - 4: the A-scale layout covers round_up(M, 4) rows in int.
  DEEPINFER_CHECK(M < (1ll << 31) - 4 && N < (1ll << 31) && K < (1ll << 31), op,
                  "sizes must be < 2^31 (M < 2^31 - 4)");
  auto [sfa, ld_sfa] = m_major_scales(a_scale, /*tma=*/true);
  const auto sfb = k_major_scales(b_scale);
  gemm::Fp8GemmParams p{};
  p.a = a.const_data_ptr();
  p.sfa = sfa.const_data_ptr<float>();
  p.b = b.const_data_ptr();
  p.sfb = sfb.const_data_ptr<float>();
  p.d = out.mutable_data_ptr();
  p.M = static_cast<int>(M);
  p.N = static_cast<int>(N);
  p.K = static_cast<int>(K);
  p.lda = a.stride(0);
  p.ldb = b.stride(0);
  p.ldd = out.stride(0);
  p.ld_sfa = static_cast<int>(ld_sfa);
  p.ld_sfb = static_cast<int>(sfb.size(0) <= 1 ? sfb.size(1) : sfb.stride(0));
  p.accumulate = accumulate;
  p.split_k = static_cast<int>(std::min<int64_t>(split_k, gemm_ceil_div(K, kGemmScaleBlock)));
  p.num_sms = num_sms();
  const bool use_split = p.split_k > 1;
  // Tile visiting order only (never the arithmetic): swizzling the persistent schedule by 8 tiles keeps the A and
  // B tiles of neighbouring CTAs in L2 at large M (H200: +3-6% at M = 4096, bench/results/h200/bench_fp8_gemm.json).
  p.swizzle = M >= 1024 ? 8 : 1;
  // Small M: 64x128 ping-pong tiles when M <= 64 (no MMA on the 64 empty rows of a 128-row tile) or when they all
  // fit in one wave (more SMs busy). H200: M = 64 / 128, N = 7168, K = 16384: 54 / 49 -> 42 / 41 us; at M = 512,
  // N = 4096 (256 such tiles) the 128x128 kernel stays faster, 10.2 vs 13.3 us. Same bits as the 128x128 kernel,
  // so the choice may depend on M.
  const bool pingpong =
      !fp32 && !use_split && (M <= 64 || gemm_ceil_div(M, 64) * gemm_ceil_div(N, 128) <= p.num_sms);
  const size_t ws = fp32        ? gemm::fp8_gemm_nt_fp32_workspace_size(p)
                    : use_split ? gemm::fp8_gemm_nt_bf16_splitk_workspace_size(p)
                    : pingpong  ? gemm::fp8_gemm_nt_bf16_pingpong_workspace_size(p)
                                : gemm::fp8_gemm_nt_bf16_workspace_size(p);
  at::Tensor workspace;
  if (ws > 0) {
    workspace = at::empty({static_cast<int64_t>(ws)}, out.options().dtype(at::kByte));
    p.workspace = workspace.mutable_data_ptr();
  }
  if (fp32) {
    gemm::launch_fp8_gemm_nt_fp32(p, current_stream());
  } else if (use_split) {
    gemm::launch_fp8_gemm_nt_bf16_splitk(p, current_stream());
  } else if (pingpong) {
    gemm::launch_fp8_gemm_nt_bf16_pingpong(p, current_stream());
  } else {
    gemm::launch_fp8_gemm_nt_bf16(p, current_stream());
  }
}

namespace {

// Groups of <= 64 rows on average (the row counts themselves stay on the device) run the 64x128 ping-pong
// configuration (H200, 256 groups x 64 rows, N = K = 4096: 1298 -> 1148 us; at 128 rows per group the 128x128
// cooperative one is faster, 339 vs 380 us). Both give the same bits.
void run_grouped(gemm::GroupedFp8GemmParams& p, const at::Tensor& out) {
  p.num_sms = num_sms();
  const bool contiguous = p.layout == gemm::GroupedLayout::kContiguous;
  const int64_t sfa_rows = contiguous ? p.M_total : static_cast<int64_t>(p.num_groups) * p.M_total;
  const int64_t rows_per_group = contiguous ? p.M_total / std::max(p.num_groups, 1) : p.M_total;
  const bool pingpong = rows_per_group <= 64;
  // Groups with more rows than columns visit their tiles along N, an M row of tiles at a time, so the group's B
  // stays in L2 (along M, the group's A would have to: 4 x 8192 rows, K = 7168 is 58 MB per group).
  p.raster_along_n = rows_per_group > p.N;
  const size_t ws = (pingpong ? gemm::grouped_fp8_gemm_nt_bf16_pingpong_workspace_size
                              : gemm::grouped_fp8_gemm_nt_bf16_workspace_size)(p.num_groups, sfa_rows, p.K, p.num_sms);
  auto workspace = at::empty({static_cast<int64_t>(ws)}, out.options().dtype(at::kByte));
  p.workspace = workspace.mutable_data_ptr();
  if (pingpong) {
    gemm::launch_grouped_fp8_gemm_nt_bf16_pingpong(p, current_stream());
  } else {
    gemm::launch_grouped_fp8_gemm_nt_bf16(p, current_stream());
  }
}

// [G, nb, kb] B scales, compact per group (nb stride == kb, kb stride == 1): CUTLASS 4.2's grouped mainloop derives
// the B scale layout from (N, K) and ignores any other stride. Copies when the given strides differ.
at::Tensor grouped_b_scales(const at::Tensor& s) {
  const int64_t nb = s.size(1), kb = s.size(2);
  const bool ok = (kb <= 1 || s.stride(2) == 1) && (nb <= 1 || s.stride(1) == kb);
  return ok ? s : s.contiguous();
}

void fill_grouped_b(const char* op, gemm::GroupedFp8GemmParams& p, const at::Tensor& b, const at::Tensor& sfb) {
  check_tma_operand(op, b, "b", b.stride(1), 1);
  DEEPINFER_CHECK(b.size(0) <= 1 || b.stride(0) % 16 == 0, op, "b group stride must be a multiple of 16 bytes");
  p.b = b.const_data_ptr();
  p.ldb = b.stride(1);
  p.b_group_stride = b.stride(0);
  p.sfb = sfb.const_data_ptr<float>();
  p.ld_sfb = static_cast<int>(sfb.size(2));
  p.sfb_group_stride = sfb.stride(0);
  p.N = static_cast<int>(b.size(1));
  p.K = static_cast<int>(b.size(2));
}

}  // namespace

void m_grouped_fp8_gemm_nt_contiguous_cuda(at::Tensor& out, const at::Tensor& a, const at::Tensor& a_scale,
                                           const at::Tensor& b, const at::Tensor& b_scale,
                                           const at::Tensor& m_indices) {
  const char* op = "m_grouped_fp8_gemm_nt_contiguous";
  check_m_grouped_contiguous(out, a, a_scale, b, b_scale, m_indices);
  const int64_t M = a.size(0), K = a.size(1), G = b.size(0), N = b.size(1);
  if (M == 0 || N == 0 || G == 0) return;
  DEEPINFER_CHECK(K > 0, op, "K must be > 0 on CUDA");
  DEEPINFER_CHECK(M < (1ll << 31) && G < (1 << 20), op, "M must be < 2^31 and G < 2^20");
  const c10::cuda::CUDAGuard guard(out.device());
  check_tma_operand(op, a, "a", a.stride(0), 1);
  check_tma_operand(op, out, "out", out.stride(0), 2);
  // A scales are read with their own strides by the packing kernel (see fp8_gemm.cuh): no host-side copy.
  const auto sfb = grouped_b_scales(b_scale);
  gemm::GroupedFp8GemmParams p{};
  p.layout = gemm::GroupedLayout::kContiguous;
  p.num_groups = static_cast<int>(G);
  fill_grouped_b(op, p, b, sfb);
  p.a = a.const_data_ptr();
  p.lda = a.stride(0);
  p.sfa = a_scale.const_data_ptr<float>();
  p.sfa_row_stride = a_scale.stride(0);
  p.sfa_k_stride = a_scale.stride(1);
  p.d = out.mutable_data_ptr();
  p.ldd = out.stride(0);
  p.m_indices = m_indices.const_data_ptr<int32_t>();
  p.M_total = static_cast<int>(M);
  run_grouped(p, out);
}

void m_grouped_fp8_gemm_nt_masked_cuda(at::Tensor& out, const at::Tensor& a, const at::Tensor& a_scale,
                                       const at::Tensor& b, const at::Tensor& b_scale, const at::Tensor& masked_m) {
  const char* op = "m_grouped_fp8_gemm_nt_masked";
  check_m_grouped_masked(out, a, a_scale, b, b_scale, masked_m);
  const int64_t G = a.size(0), max_m = a.size(1), K = a.size(2), N = b.size(1);
  if (G == 0 || max_m == 0 || N == 0) return;
  DEEPINFER_CHECK(K > 0, op, "K must be > 0 on CUDA");
  const c10::cuda::CUDAGuard guard(out.device());
  check_tma_operand(op, a, "a", a.stride(1), 1);
  check_tma_operand(op, out, "out", out.stride(1), 2);
  DEEPINFER_CHECK(G <= 1 || (a.stride(0) % 16 == 0 && out.stride(0) % 8 == 0), op,
                  "a / out group strides must be multiples of 16 bytes");
  // A scales are read with their own strides by the packing kernel (see fp8_gemm.cuh): no host-side copy.
  const auto sfb = grouped_b_scales(b_scale);
  gemm::GroupedFp8GemmParams p{};
  p.layout = gemm::GroupedLayout::kMasked;
  p.num_groups = static_cast<int>(G);
  fill_grouped_b(op, p, b, sfb);
  p.a = a.const_data_ptr();
  p.lda = a.stride(1);
  p.a_group_stride = a.stride(0);
  p.sfa = a_scale.const_data_ptr<float>();
  p.sfa_row_stride = a_scale.stride(1);
  p.sfa_k_stride = a_scale.stride(2);
  p.sfa_group_stride = a_scale.stride(0);
  p.d = out.mutable_data_ptr();
  p.ldd = out.stride(1);
  p.d_group_stride = out.stride(0);
  p.masked_m = masked_m.const_data_ptr<int32_t>();
  p.M_total = static_cast<int>(max_m);
  run_grouped(p, out);
}

void swiglu_clamp_quant_fp8_cuda(at::Tensor& out_q, at::Tensor& out_scale, const at::Tensor& gate_up, double limit,
                                 bool scale_ue8m0) {
  check_swiglu_clamp_quant_fp8(out_q, out_scale, gate_up, limit);
  const int64_t rows = gate_up.size(0), I = gate_up.size(1) / 2;
  if (rows == 0 || I == 0) return;
  const c10::cuda::CUDAGuard guard(gate_up.device());
  gemm::SwigluClampQuantParams p{};
  p.gate_up = gate_up.const_data_ptr();
  p.out_q = static_cast<uint8_t*>(out_q.mutable_data_ptr());
  p.out_scale = out_scale.mutable_data_ptr<float>();
  p.rows = rows;
  p.I = I;
  p.num_groups = gemm_ceil_div(I, kGemmScaleBlock);
  p.in_row_stride = gate_up.stride(0);
  p.q_row_stride = out_q.stride(0);
  p.scale_row_stride = out_scale.stride(0);
  p.scale_col_stride = out_scale.stride(1);
  p.limit = static_cast<float>(limit);
  p.dtype = to_dtype(gate_up.scalar_type());
  p.scale_ue8m0 = scale_ue8m0;
  gemm::launch_swiglu_clamp_quant_fp8(p, current_stream());
}

}  // namespace deepinfer

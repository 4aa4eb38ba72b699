// Launch code of the grouped (ptr-array) FP8 block-scaled GEMM, templated on its CUTLASS configuration
// (internal: included only by the grouped instantiation TUs under instantiations/, one configuration each).
// A setup kernel derives each group's problem size and pointers on the device (no host sync), a packing kernel
// copies each group's A scales into the compact block CUTLASS reads, then one persistent grouped kernel runs.
#pragma once

#include <algorithm>

#include "fp8_gemm_cutlass.cuh"

namespace deepinfer::gemm {
namespace cutlass_impl {
namespace {

// Fills group g's problem size, pointers, strides and scale layouts. Group g's A scales live at
// arr.sfa_packed + sfa_off as a compact M-major [kb, m] block (written by the packing kernels below).
template <class C>
__device__ void grouped_fill(const GroupedFp8GemmParams& p, const typename C::Arrays& arr, int g, int m,
                             int64_t a_off, int64_t d_off, int64_t sfa_off) {
  arr.problem[g] = typename C::Shape3{m, p.N, p.K};
  arr.ptr_a[g] = static_cast<const ElementAB*>(p.a) + a_off;
  arr.ptr_b[g] = static_cast<const ElementAB*>(p.b) + g * p.b_group_stride;
  arr.ptr_sfa[g] = arr.sfa_packed + sfa_off;
  arr.ptr_sfb[g] = p.sfb + g * p.sfb_group_stride;
  arr.ptr_d[g] = static_cast<typename C::ElementD*>(p.d) + d_off;
  typename C::StrideA sa{};
  get<0>(sa) = p.lda;
  arr.stride_a[g] = sa;
  typename C::StrideB sb{};
  get<0>(sb) = p.ldb;
  arr.stride_b[g] = sb;
  typename C::StrideD sd{};
  get<0>(sd) = p.ldd;
  arr.stride_d[g] = sd;
  // CUTLASS 4.2 does not read these (it rebuilds the same compact layouts from (m, N, K)); kept consistent.
  arr.layout_sfa[g] = make_layout_sfa(m, p.K, m);
  arr.layout_sfb[g] = make_layout_sfb(p.N, p.K, (p.K + kScaleBlock - 1) / kScaleBlock);
}

// Contiguous layout: one block finds each group's run [first, last] of rows from m_indices (shared-memory
// atomics), then writes the per-group arguments. Groups without rows get M = 0 (no tiles). Group g's packed
// A scales start at kb * first[g] (the runs are disjoint, so the blocks are too, within kb * M_total floats).
constexpr int kSetupThreads = 1024;
template <class C>
__global__ void __launch_bounds__(kSetupThreads) grouped_contiguous_setup_kernel(GroupedFp8GemmParams p,
                                                                                 typename C::Arrays arr) {
  extern __shared__ int smem[];
  int* first = smem;
  int* last = smem + p.num_groups;
  for (int g = threadIdx.x; g < p.num_groups; g += blockDim.x) {
    first[g] = INT_MAX;
    last[g] = -1;
  }
  __syncthreads();
  for (int r = threadIdx.x; r < p.M_total; r += blockDim.x) {
    const int e = p.m_indices[r];
    if (e >= 0 && e < p.num_groups) {
      atomicMin(&first[e], r);
      atomicMax(&last[e], r);
    }
  }
  __syncthreads();
  const int64_t kb = (p.K + kScaleBlock - 1) / kScaleBlock;
  for (int g = threadIdx.x; g < p.num_groups; g += blockDim.x) {
    const bool any = last[g] >= 0;
    const int r0 = any ? first[g] : 0;
    const int m = any ? last[g] - first[g] + 1 : 0;
    arr.row0[g] = r0;
    grouped_fill<C>(p, arr, g, m, r0 * p.lda, r0 * p.ldd, kb * r0);
  }
}

// Contiguous layout: packs sfa (row r, block k) into group g's block: sfa_packed[kb * r0 + k * m_g + (r - r0)].
// Runs after the setup kernel (same stream). Index order r fastest: coalesced stores (and loads when the caller's
// scales are M-major, DeepGEMM's layout).
template <class C>
__global__ void grouped_contiguous_pack_sfa_kernel(GroupedFp8GemmParams p, typename C::Arrays arr) {
  const int64_t kb = (p.K + kScaleBlock - 1) / kScaleBlock;
  const int64_t total = kb * p.M_total;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int r = static_cast<int>(i % p.M_total);
    const int64_t k = i / p.M_total;
    const int g = p.m_indices[r];
    if (g < 0 || g >= p.num_groups) continue;
    const int r0 = arr.row0[g];
    const int m = get<0>(arr.problem[g]);
    if (r < r0 || r >= r0 + m) continue;
    arr.sfa_packed[kb * r0 + k * m + (r - r0)] = p.sfa[r * p.sfa_row_stride + k * p.sfa_k_stride];
  }
}

// Masked layout: group g has m_g = min(max(masked_m[g], 0), max_m) rows at the start of A[g] / D[g]; its packed
// A scales start at g * kb * max_m.
template <class C>
__global__ void grouped_masked_setup_kernel(GroupedFp8GemmParams p, typename C::Arrays arr) {
  const int g = blockIdx.x * blockDim.x + threadIdx.x;
  if (g >= p.num_groups) return;
  const int m = min(max(p.masked_m[g], 0), p.M_total);
  const int64_t kb = (p.K + kScaleBlock - 1) / kScaleBlock;
  arr.row0[g] = 0;
  grouped_fill<C>(p, arr, g, m, g * p.a_group_stride, g * p.d_group_stride, g * kb * p.M_total);
}

// Masked layout: sfa_packed[g * kb * max_m + k * m_g + m] = sfa[g, m, k] for m < m_g.
template <class C>
__global__ void grouped_masked_pack_sfa_kernel(GroupedFp8GemmParams p, typename C::Arrays arr) {
  const int64_t kb = (p.K + kScaleBlock - 1) / kScaleBlock;
  const int64_t max_m = p.M_total;
  const int64_t total = static_cast<int64_t>(p.num_groups) * kb * max_m;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t m = i % max_m;
    const int64_t k = (i / max_m) % kb;
    const int64_t g = i / (max_m * kb);
    const int64_t mg = min(max(p.masked_m[g], 0), p.M_total);
    if (m >= mg) continue;
    arr.sfa_packed[g * kb * max_m + k * mg + m] =
        p.sfa[g * p.sfa_group_stride + m * p.sfa_row_stride + k * p.sfa_k_stride];
  }
}

int64_t sfa_floats(int64_t sfa_rows, int K) {
  return sfa_rows * ((K + kScaleBlock - 1) / kScaleBlock);
}

template <class C>
void run_grouped(const GroupedFp8GemmParams& p, cudaStream_t stream) {
  const int G = p.num_groups;
  const int64_t rows = p.layout == GroupedLayout::kContiguous ? p.M_total : static_cast<int64_t>(G) * p.M_total;
  const int64_t floats = sfa_floats(rows, p.K);
  typename C::Arrays arr = C::carve(p.workspace, G, static_cast<size_t>(floats));
  constexpr int kPackThreads = 256;
  const int pack_blocks =
      static_cast<int>(std::max<int64_t>(1, std::min<int64_t>((floats + kPackThreads - 1) / kPackThreads,
                                                              static_cast<int64_t>(p.num_sms) * 8)));
  if (p.layout == GroupedLayout::kContiguous) {
    const size_t smem = sizeof(int) * 2 * static_cast<size_t>(G);
    if (smem > 48 * 1024) {
      ensure_dynamic_smem(grouped_contiguous_setup_kernel<C>, smem);
    }
    grouped_contiguous_setup_kernel<C><<<1, kSetupThreads, smem, stream>>>(p, arr);
    DEEPINFER_CHECK_LAUNCH("m_grouped_fp8_gemm_nt setup");
    grouped_contiguous_pack_sfa_kernel<C><<<pack_blocks, kPackThreads, 0, stream>>>(p, arr);
  } else {
    grouped_masked_setup_kernel<C><<<(G + 255) / 256, 256, 0, stream>>>(p, arr);
    DEEPINFER_CHECK_LAUNCH("m_grouped_fp8_gemm_nt setup");
    grouped_masked_pack_sfa_kernel<C><<<pack_blocks, kPackThreads, 0, stream>>>(p, arr);
  }
  DEEPINFER_CHECK_LAUNCH("m_grouped_fp8_gemm_nt pack scales");
  auto args = C::make_args(arr, G, p.num_sms, p.raster_along_n);
  typename C::Gemm gemm;
  cutlass_check(gemm.can_implement(args), "m_grouped_fp8_gemm_nt can_implement");
  cutlass_check(gemm.initialize(args, arr.cutlass_workspace, stream), "m_grouped_fp8_gemm_nt initialize");
  cutlass_check(gemm.run(stream), "m_grouped_fp8_gemm_nt run");
  DEEPINFER_CHECK_LAUNCH("m_grouped_fp8_gemm_nt");
}

}  // namespace
}  // namespace cutlass_impl

}  // namespace deepinfer::gemm

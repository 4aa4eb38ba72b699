// Grouped (ptr-array) FP8 block-scaled GEMM, bf16 output, contiguous and masked layouts:
// tile 128x128x128, cooperative, persistent group scheduler, problem sizes on the device (written by a setup kernel).
#include "../fp8_gemm_cutlass.cuh"

namespace deepinfer::gemm {
namespace cutlass_impl {
namespace {

// Fills group g's problem size, pointers, strides and scale layouts.
__device__ void grouped_fill(const GroupedFp8GemmParams& p, const GroupedConfig::Arrays& arr, int g,
                                             int m, int64_t a_off, int64_t d_off, int64_t sfa_off) {
  using C = GroupedConfig;
  arr.problem[g] = C::Shape3{m, p.N, p.K};
  arr.ptr_a[g] = static_cast<const ElementAB*>(p.a) + a_off;
  arr.ptr_b[g] = static_cast<const ElementAB*>(p.b) + g * p.b_group_stride;
  arr.ptr_sfa[g] = p.sfa + sfa_off;
  arr.ptr_sfb[g] = p.sfb + g * p.sfb_group_stride;
  arr.ptr_d[g] = static_cast<C::ElementD*>(p.d) + d_off;
  C::StrideA sa{};
  get<0>(sa) = p.lda;
  arr.stride_a[g] = sa;
  C::StrideB sb{};
  get<0>(sb) = p.ldb;
  arr.stride_b[g] = sb;
  C::StrideD sd{};
  get<0>(sd) = p.ldd;
  arr.stride_d[g] = sd;
  arr.layout_sfa[g] = make_layout_sfa(m, p.K, p.ld_sfa);
  arr.layout_sfb[g] = make_layout_sfb(p.N, p.K, p.ld_sfb);
}

// Contiguous layout: one block finds each group's run [first, last] of rows from m_indices (shared-memory
// atomics), then writes the per-group arguments. Groups without rows get M = 0 (no tiles).
constexpr int kSetupThreads = 1024;
__global__ void __launch_bounds__(kSetupThreads) grouped_contiguous_setup_kernel(GroupedFp8GemmParams p,
                                                                                 GroupedConfig::Arrays arr) {
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
  for (int g = threadIdx.x; g < p.num_groups; g += blockDim.x) {
    const bool any = last[g] >= 0;
    const int r0 = any ? first[g] : 0;
    const int m = any ? last[g] - first[g] + 1 : 0;
    grouped_fill(p, arr, g, m, r0 * p.lda, r0 * p.ldd, r0);
  }
}

// Masked layout: group g has min(max(masked_m[g], 0), max_m) rows at the start of A[g] / D[g].
__global__ void grouped_masked_setup_kernel(GroupedFp8GemmParams p, GroupedConfig::Arrays arr) {
  const int g = blockIdx.x * blockDim.x + threadIdx.x;
  if (g >= p.num_groups) return;
  const int m = min(max(p.masked_m[g], 0), p.M_total);
  grouped_fill(p, arr, g, m, g * p.a_group_stride, g * p.d_group_stride, g * p.sfa_group_stride);
}

inline void run_grouped(const GroupedFp8GemmParams& p, cudaStream_t stream) {
  using C = GroupedConfig;
  const int G = p.num_groups;
  C::Arrays arr = C::carve(p.workspace, G);
  if (p.layout == GroupedLayout::kContiguous) {
    const size_t smem = sizeof(int) * 2 * static_cast<size_t>(G);
    if (smem > 48 * 1024) {
      DEEPINFER_CUDA_CHECK(cudaFuncSetAttribute(grouped_contiguous_setup_kernel,
                                                cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
    }
    grouped_contiguous_setup_kernel<<<1, kSetupThreads, smem, stream>>>(p, arr);
  } else {
    grouped_masked_setup_kernel<<<(G + 255) / 256, 256, 0, stream>>>(p, arr);
  }
  DEEPINFER_CHECK_LAUNCH("m_grouped_fp8_gemm_nt setup");
  auto args = C::make_args(arr, G, p.num_sms);
  C::Gemm gemm;
  cutlass_check(gemm.can_implement(args), "m_grouped_fp8_gemm_nt can_implement");
  cutlass_check(gemm.initialize(args, arr.cutlass_workspace, stream), "m_grouped_fp8_gemm_nt initialize");
  cutlass_check(gemm.run(stream), "m_grouped_fp8_gemm_nt run");
  DEEPINFER_CHECK_LAUNCH("m_grouped_fp8_gemm_nt");
}

}  // namespace
}  // namespace cutlass_impl

size_t grouped_fp8_gemm_nt_bf16_workspace_size(int num_groups, int num_sms) {
  return cutlass_impl::GroupedConfig::workspace_size(num_groups, num_sms);
}
void launch_grouped_fp8_gemm_nt_bf16(const GroupedFp8GemmParams& p, cudaStream_t stream) {
  cutlass_impl::run_grouped(p, stream);
}
}  // namespace deepinfer::gemm

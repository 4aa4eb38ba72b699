// Grouped (ptr-array) FP8 block-scaled GEMM, bf16 output, contiguous and masked layouts:
// tile 128x128x128, cooperative, persistent group scheduler, problem sizes on the device (written by a setup kernel).
#include "../grouped_fp8_gemm_launch.cuh"

namespace deepinfer::gemm {
using Grouped = cutlass_impl::GroupedConfig<>;
size_t grouped_fp8_gemm_nt_bf16_workspace_size(int num_groups, int64_t sfa_rows, int K, int num_sms) {
  return Grouped::workspace_size(num_groups, static_cast<size_t>(cutlass_impl::sfa_floats(sfa_rows, K)), num_sms);
}
void launch_grouped_fp8_gemm_nt_bf16(const GroupedFp8GemmParams& p, cudaStream_t stream) {
  cutlass_impl::run_grouped<Grouped>(p, stream);
}
}  // namespace deepinfer::gemm

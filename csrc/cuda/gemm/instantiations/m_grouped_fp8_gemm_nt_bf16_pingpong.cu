// Grouped (ptr-array) FP8 block-scaled GEMM, bf16 output, for groups of few rows (<= 64 on average: decode, many
// experts): tile 64x128x128, ping-pong (each consumer warpgroup on its own 64-row tile), persistent group scheduler.
// Same per-element arithmetic, hence the same bits, as the cooperative 128x128 grouped kernel.
#include "../grouped_fp8_gemm_launch.cuh"

namespace deepinfer::gemm {
using Grouped =
    cutlass_impl::GroupedConfig<cutlass_impl::TileShapeSmallM, cutlass_impl::ClusterShape, cutlass_impl::Pingpong>;
size_t grouped_fp8_gemm_nt_bf16_pingpong_workspace_size(int num_groups, int64_t sfa_rows, int K, int num_sms) {
  return Grouped::workspace_size(num_groups, static_cast<size_t>(cutlass_impl::sfa_floats(sfa_rows, K)), num_sms);
}
void launch_grouped_fp8_gemm_nt_bf16_pingpong(const GroupedFp8GemmParams& p, cudaStream_t stream) {
  cutlass_impl::run_grouped<Grouped>(p, stream);
}
}  // namespace deepinfer::gemm

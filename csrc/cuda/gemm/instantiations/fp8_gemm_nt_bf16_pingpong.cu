// Dense FP8 block-scaled GEMM, bf16 output (no source), for few output tiles (small M): tile 64x128x128,
// ping-pong (each consumer warpgroup on its own 64-row tile), persistent. Twice the CTAs of the 128x128 tile at
// M <= 64, and one warpgroup's scale promotion / epilogue overlaps the other's wgmma. Same arithmetic per output
// element as the cooperative 128x128 kernel (each 128-deep K block accumulated by wgmma in the same k order, then
// promoted), so the same bits: the choice between the two may depend on M without breaking batch invariance.
#include "../fp8_gemm_cutlass.cuh"

namespace deepinfer::gemm {
using Cfg = cutlass_impl::DenseConfig<cutlass::bfloat16_t, false, cutlass::gemm::PersistentScheduler,
                                      cutlass_impl::TileShapeSmallM, cutlass_impl::ClusterShape, cutlass_impl::Pingpong>;
size_t fp8_gemm_nt_bf16_pingpong_workspace_size(const Fp8GemmParams& p) { return Cfg::workspace_size(p); }
void launch_fp8_gemm_nt_bf16_pingpong(const Fp8GemmParams& p, cudaStream_t stream) { Cfg::run(p, stream); }
}  // namespace deepinfer::gemm

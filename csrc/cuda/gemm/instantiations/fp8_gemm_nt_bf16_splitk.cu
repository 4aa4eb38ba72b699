// Dense FP8 block-scaled GEMM, bf16 output, split-K (for small M, where N / 128 tiles leave SMs idle):
// tile 128x128x128, cooperative, StreamKScheduler forced to SplitK with the deterministic reduction.
#include "../fp8_gemm_cutlass.cuh"

namespace deepinfer::gemm {
using Cfg = cutlass_impl::DenseConfig<cutlass::bfloat16_t, false, cutlass::gemm::StreamKScheduler>;
size_t fp8_gemm_nt_bf16_splitk_workspace_size(const Fp8GemmParams& p) { return Cfg::workspace_size(p); }
void launch_fp8_gemm_nt_bf16_splitk(const Fp8GemmParams& p, cudaStream_t stream) { Cfg::run(p, stream); }
}  // namespace deepinfer::gemm

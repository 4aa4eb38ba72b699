// Torch-facing CUDA entry points of the mHC domain: checks, then launch on the current stream.
#include "cuda/torch_utils.h"
#include "common/mhc_checks.h"
#include "deepinfer/mhc/mhc.cuh"
#include "ops.h"

namespace deepinfer {

void hc_mix_cuda(at::Tensor& out, const at::Tensor& x, const at::Tensor& fn, double eps) {
  check_hc_mix(out, x, fn, eps);
  if (out.numel() == 0) return;
  // one CTA row per kHcMixPartK-wide part of K: gridDim.y <= 65535
  DEEPINFER_CHECK(x.size(1) <= mhc::kHcMixMaxK, "hc_mix", "x has K = ", x.size(1),
                  " columns; the CUDA kernel takes at most ", mhc::kHcMixMaxK);
  const c10::cuda::CUDAGuard guard(x.device());
  mhc::HcMixParams p{};
  p.x = x.const_data_ptr();
  p.fn = fn.const_data_ptr<float>();
  p.out = out.mutable_data_ptr<float>();
  p.tokens = x.size(0);
  p.k = x.size(1);
  p.x_row_stride = x.stride(0);
  p.m = static_cast<int>(fn.size(0));
  p.eps = static_cast<float>(eps);
  p.dtype = to_dtype(x.scalar_type());
  const at::Tensor workspace =
      at::empty({mhc::hc_mix_workspace_floats(p)}, x.options().dtype(at::kFloat));
  mhc::launch_hc_mix(p, workspace.mutable_data_ptr<float>(), current_stream());
}

void hc_weights_cuda(at::Tensor& pre, at::Tensor& post, at::Tensor& comb, const at::Tensor& mix, const at::Tensor& base,
                     const at::Tensor& scale, double eps, int64_t sinkhorn_iters) {
  check_hc_weights_op(pre, post, comb, mix, base, scale, eps, sinkhorn_iters);
  if (pre.size(0) == 0) return;
  const c10::cuda::CUDAGuard guard(mix.device());
  mhc::HcWeightsParams p{};
  p.mix = mix.const_data_ptr<float>();
  p.base = base.const_data_ptr<float>();
  p.scale = scale.const_data_ptr<float>();
  p.pre = pre.mutable_data_ptr<float>();
  p.post = post.mutable_data_ptr<float>();
  p.comb = comb.mutable_data_ptr<float>();
  p.tokens = pre.size(0);
  p.hc = static_cast<int>(pre.size(1));
  p.sinkhorn_iters = static_cast<int>(sinkhorn_iters);
  p.eps = static_cast<float>(eps);
  mhc::launch_hc_weights(p, current_stream());
}

namespace {
mhc::HcStreamParams stream_params(const at::Tensor& out, const at::Tensor& streams) {
  mhc::HcStreamParams p{};
  p.streams = streams.const_data_ptr();
  p.out = out.data_ptr();
  p.tokens = streams.size(0);
  p.hc = static_cast<int>(streams.size(1));
  p.hidden = streams.size(2);
  p.dtype = to_dtype(streams.scalar_type());
  return p;
}
}  // namespace

void hc_collapse_cuda(at::Tensor& out, const at::Tensor& streams, const at::Tensor& pre) {
  check_hc_collapse(out, streams, pre);
  if (out.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(streams.device());
  mhc::HcStreamParams p = stream_params(out, streams);
  p.pre = pre.const_data_ptr<float>();
  mhc::launch_hc_collapse(p, current_stream());
}

void hc_post_cuda(at::Tensor& out, const at::Tensor& streams, const at::Tensor& x, const at::Tensor& post,
                  const at::Tensor& comb) {
  check_hc_post(out, streams, x, post, comb);
  if (out.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(streams.device());
  mhc::HcStreamParams p = stream_params(out, streams);
  p.x = x.const_data_ptr();
  p.pre = post.const_data_ptr<float>();
  p.comb = comb.const_data_ptr<float>();
  mhc::launch_hc_post(p, current_stream());
}

}  // namespace deepinfer

"""Fake (meta) implementations of every deepinfer op, so torch.compile and other engines can trace them.

All current ops write preallocated outputs and return nothing, so their fake implementations only
check what the real ones would and return None.
"""

from __future__ import annotations

import torch


@torch.library.register_fake("deepinfer_ops::rms_norm")
def _rms_norm_fake(out, input, weight, eps):
    torch._check(out.shape == input.shape, lambda: "rms_norm: out shape != input shape")
    return None


@torch.library.register_fake("deepinfer_ops::per_token_group_quant_fp8")
def _per_token_group_quant_fp8_fake(out_q, out_scale, input, group_size, scale_ue8m0):
    torch._check(out_q.shape == input.shape, lambda: "per_token_group_quant_fp8: out_q shape != input shape")
    return None


@torch.library.register_fake("deepinfer_ops::rotary_embedding")
def _rotary_embedding_fake(x, positions, cos_sin_cache, inverse):
    return None

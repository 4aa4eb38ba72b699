"""Normalisation ops."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """Root-mean-square norm over the last dim: ``y = x / sqrt(mean(x^2) + eps) * weight``.

    Args:
        x: ``[..., hidden]`` float32, bfloat16 or float16; last dim contiguous (a 2-D ``[rows, hidden]`` view
            with any row stride is fine; higher ranks must be contiguous).
        weight: ``[hidden]`` in x's dtype or float32, or None for the unweighted norm (V4's per-head q norm).
        eps: added to the mean square (V4: 1e-6).
        out: optional preallocated output, same shape and dtype as x; written in place.
    Returns:
        ``[..., hidden]`` in x's dtype. Accumulation is float32; the product ``x * rsqrt(.) * weight`` is
        rounded once. Batch-invariant: each row is reduced in a fixed order that does not depend on the
        number of rows (CPU: 8 interleaved partial sums; CUDA: one CTA of 256 threads per row).
    Raises:
        RuntimeError naming the tensor at fault (dtype, shape, device, stride).
    Source: Zhang & Sennrich 2019, "Root Mean Square Layer Normalization"; DeepSeek-V4 reference model.
    """
    if out is None:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    torch.ops.deepinfer_ops.rms_norm(out, x, weight, float(eps))
    return out

"""Batch-invariant building blocks of the model: elementwise ops whose result for one element never depends on where
it sits in the batch (on the CPU torch picks how it vectorises an elementwise loop by the tensor's shape). Fixed-order
reductions are native ops (``deepinfer_ops.logsumexp_rows``, ``compressor_pool``, ``rms_norm``, the mHC ops)."""

from __future__ import annotations

import torch


def pointwise(fn, x: torch.Tensor, rows: int = 0) -> torch.Tensor:
    """``fn(x)`` for a transcendental elementwise op (sigmoid, silu, softplus, ...).

    Batch-invariant mode (``rows > 0``) on the CPU: torch's vectorised CPU loops compute the tail of each contiguous
    run (and of each thread's range) with the scalar libm function, whose last bit can differ from the SIMD one,
    so an element's value would depend on where it sits, i.e. on the batch. The op then runs on a stride-2 copy,
    which torch always processes with the scalar function, every element the same way. CUDA elementwise kernels
    apply the same device function to every element, so they run as is.
    """
    if rows <= 0 or x.device.type != "cpu":
        return fn(x)
    spread = torch.empty(*x.shape, 2, dtype=x.dtype)[..., 0]
    spread.copy_(x)
    return fn(spread)

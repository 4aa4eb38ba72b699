"""Batch-invariant building blocks shared by the model and the sampler: elementwise ops and reductions whose result
for one row never depends on the other rows or on how many there are (torch picks how it splits a reduction, and on
the CPU how it vectorises an elementwise loop, by the tensor's shape)."""

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


def tree_sum_dim1(x: torch.Tensor) -> torch.Tensor:
    """``x [n, s, ...]`` summed over dim 1 by pairwise halving (dim 1 zero-padded to a power of two; ``+ 0`` is
    exact): ``ceil(log2 s)`` elementwise adds whose order is fixed by ``s`` alone, so every row gets the same bits
    whatever ``n`` (batch-invariant mode; a torch reduction may split the sum by the number of rows). Returns
    ``[n, ...]`` in ``x.dtype``."""
    s = x.shape[1]
    p = 1 << max(s - 1, 0).bit_length()
    if p != s:
        x = torch.cat([x, x.new_zeros(x.shape[0], p - s, *x.shape[2:])], dim=1)
    while x.shape[1] > 1:
        h = x.shape[1] // 2
        x = x[:, :h] + x[:, h:]
    return x[:, 0]


def logsumexp_rows(x: torch.Tensor) -> torch.Tensor:
    """``log(sum_v exp(x[:, v]))`` of ``x [n, V]`` float32 per row, computed the same way for a row whatever ``n``:
    the row max (exact in any order), :func:`pointwise` ``exp`` of the shifted row, a :func:`tree_sum_dim1` over
    ``V``. A row holding NaN gives NaN, one holding +inf gives +inf, an all -inf row -inf. Returns ``[n]`` float32."""
    if x.shape[1] == 0:
        return x.new_full((x.shape[0],), float("-inf"))
    m = x.amax(dim=1, keepdim=True)
    shift = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # an all -inf row: exp(-inf) = 0, lse = -inf
    total = tree_sum_dim1(pointwise(torch.exp, x - shift, 1))
    return torch.log(total) + shift.squeeze(1)

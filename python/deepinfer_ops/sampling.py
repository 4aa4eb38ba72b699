"""Sampling ops: per-row reductions over the vocabulary whose result for a row never depends on the other rows."""

from __future__ import annotations

import torch


def logsumexp_rows(x: torch.Tensor) -> torch.Tensor:
    """``log(sum_v exp(x[r, v]))`` of every row, each row reduced on its own in a fixed order (batch-invariant: a
    row gives the same bits alone or among any other rows; the log-probability normaliser of the sampler).

    Order: the row max ``m`` (exact in any order), then the sum of ``exp(x - m)`` -- CUDA: one CTA of 512 threads per
    row, element ``v`` to thread ``(v // 4) % 512`` in increasing ``v``, thread totals added by a fixed shuffle tree;
    CPU: 8 interleaved partial sums (``v % 8``) added in lane order, scalar libm ``exp`` -- plus ``m``.

    Args:
        x: ``[rows, V]`` float32 logits, last dim contiguous (any row stride).
    Returns:
        ``[rows]`` float32. A row holding NaN gives NaN; one holding +inf (and no NaN) +inf; an all -inf row (or
        ``V == 0``) -inf.
    Raises:
        RuntimeError naming the tensor at fault (dtype, shape, layout, device).
    Source: ``torch.logsumexp`` semantics; the fixed-order reduction of batch-invariant inference (Thinking
    Machines, "Defeating nondeterminism in LLM inference", 2025; SGLang's batch-invariant ops).
    """
    if x.dim() != 2:
        raise ValueError(f"logsumexp_rows: x must be [rows, V], got shape {tuple(x.shape)}")
    out = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    torch.ops.deepinfer_ops.logsumexp_rows(out, x)
    return out

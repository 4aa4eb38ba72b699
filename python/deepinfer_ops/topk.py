"""Top-k selection with the project's one tie rule."""

from __future__ import annotations

import torch


def topk(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``k`` of each row of ``scores`` with the tie rule used everywhere in deepinfer (indexer and router):
    higher score first, then lower index. Deterministic for any batch size.

    Args:
        scores: ``[rows, n]`` float (any float dtype; compared as given). ``-inf`` entries sort last; NaN sorts
            as larger than every number (torch.sort's convention).
        k: ``0 <= k <= n``.
    Returns:
        ``(values [rows, k], indices [rows, k] int64)``, sorted by the rule.
    Raises:
        ValueError if k is out of range.
    """
    n = scores.shape[-1]
    if not 0 <= k <= n:
        raise ValueError(f"topk: k={k} is outside [0, {n}]")
    values, indices = torch.sort(scores, dim=-1, descending=True, stable=True)
    return values[..., :k], indices[..., :k]

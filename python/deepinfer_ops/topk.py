"""Top-k selection with the project's one tie rule, dispatched to the native ``topk_rows`` op."""

from __future__ import annotations

import math

import torch

# The native op's largest k on CUDA (it sorts the selected set in shared memory) and its row length limit (int32
# positions); larger k or n fall back to a sort.
NATIVE_TOPK_MAX_K_CUDA = 2048
NATIVE_TOPK_MAX_N_CUDA = 2**30 - 1
_NATIVE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def topk(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``k`` of each row of ``scores`` with the tie rule used everywhere in deepinfer (indexer and router):
    higher score first, then lower index. Deterministic for any batch size.

    fp32/bf16/fp16 scores on CPU (any k) or CUDA (k <= 2048, n < 2^30) run the native ``topk_rows`` op (radix
    select on an order-preserving 32-bit key, bf16/fp16 upcast exactly to fp32; on CUDA one warp per row with the
    scores in registers where n <= 1024 and k <= 32 (the router), else the keys of a row, or of its chunks, in
    shared memory, then one select per row where the chunks' candidates fit, else radix select over
    several CTAs per row, see csrc/cuda/attention/topk.cu);
    other cases use a stable descending sort. Both give the same result.

    Args:
        scores: ``[..., n]`` float (any float dtype; compared as given). ``-inf`` entries sort last; NaN sorts
            as larger than every number (torch.sort's convention); -0.0 ties with +0.0. A row with fewer than k
            entries above ``-inf`` still returns k indices (the ``-inf`` ones, lowest index first): filter masked
            candidates by value (the engine's ``indexer_topk`` does) before using the indices.
        k: ``0 <= k <= n``.
    Returns:
        ``(values [..., k] scores.dtype, indices [..., k] int64)``, sorted by the rule.
    Raises:
        ValueError if k is out of range.
    Source: the project's tie rule (the indexer's ReLU makes many scores exactly 0, so ties are common: the lowest
    position wins, as in a stable descending sort).
    """
    if scores.dim() == 0:
        raise ValueError("topk: scores must have at least 1 dim (candidates last)")
    if isinstance(k, bool) or not isinstance(k, int):
        raise TypeError(f"topk: k must be an int, got {type(k).__name__}")
    n = scores.shape[-1]
    if not 0 <= k <= n:
        raise ValueError(f"topk: k={k} is outside [0, {n}]")
    native = scores.dtype in _NATIVE_DTYPES and scores.device.type in ("cpu", "cuda") and (
        scores.device.type == "cpu" or (k <= NATIVE_TOPK_MAX_K_CUDA and n <= NATIVE_TOPK_MAX_N_CUDA))
    if not native:
        values, indices = torch.sort(scores, dim=-1, descending=True, stable=True)
        return values[..., :k], indices[..., :k]
    lead = scores.shape[:-1]
    rows = math.prod(lead)
    s2 = scores.reshape(rows, n).float()
    if n > 0 and s2.stride(-1) != 1:
        s2 = s2.contiguous()
    values = torch.empty((rows, k), dtype=torch.float32, device=scores.device)
    indices = torch.empty((rows, k), dtype=torch.int64, device=scores.device)
    torch.ops.deepinfer_ops.topk_rows(values, indices, s2)
    return values.to(scores.dtype).view(*lead, k), indices.view(*lead, k)

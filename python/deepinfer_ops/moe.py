"""The routed-expert (MoE) path of DeepSeek-V4 on one device, built from the FP8 grouped GEMMs.

Expert weight format. The V4-Flash checkpoint stores routed experts as FP4 e2m1 with UE8M0 per-32 scales. Hopper
has no FP4 tensor cores; here they run as FP8 e4m3 with 128x128 block scales, converted once at load by
``gemm.fp4_to_fp8_blockscaled``. Decision: convert at load (not a mixed-input kernel), because
  * the conversion is exact whenever the per-32 exponents of a 128x128 block lie within 14 binades of the block's
    largest (every e2m1 value times 2^(e - emax + 6) is then an e4m3 normal or subnormal); measured on synthetic
    weights (1024 x 2048, random codes, exponents uniform over a spread S within each block):
        S <= 14: error 0 (bit-exact, also tested);  S = 16: calc_diff 5.9e-12, 4.5% of elements rounded;
        S = 32: calc_diff 1.4e-11, 44% rounded; worst |error| 2.5e-6 of the block's largest |w| in every case
    (only groups 2^15 or more below the block maximum lose bits, i.e. values that barely contribute);
  * it reuses the mature CUTLASS FP8 blockwise kernels (same kernels as the dense FP8 layers);
  * a mixed-input FP4 x FP8 mainloop with per-32 scales on Hopper (dequantise in registers before wgmma) has no
    tested CUTLASS sm90 collective and would be new, unverified kernel code.
The cost is memory and bandwidth: FP8 experts take 2x the bytes of FP4 (V4-Flash: 43 layers x 256 experts x
3 x 2048 x 4096 ~ 277 G parameters -> ~277 GB in FP8 vs ~139 GB in FP4). The V4-Flash experts therefore do not fit
on one 141 GB H200 in FP8 (they barely would not in FP4 either, with KV cache and dense weights): expert
parallelism over >= 4 H200 is needed for the full model, and memory-bound decode reads 2x the expert bytes a
mixed-input kernel would. A mixed-input kernel is the follow-up if single-GPU decode bandwidth matters.
"""

from __future__ import annotations

import torch

from ._fake import check_same_device
from .gemm import m_grouped_fp8_gemm_nt_contiguous, swiglu_clamp_quant_fp8
from .quant import per_token_group_quant_fp8


def fused_moe_fp8(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    swiglu_limit: float = 10.0,
    scale_ue8m0: bool = False,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Routed experts: ``out[t] = sum_j topk_weights[t, j] * down_e(swiglu(gate_up_e(x[t])))``, ``e = topk_idx[t, j]``.

    Steps (no host synchronisation): sort the T*k (token, slot) pairs by expert, stably (:func:`moe_permute`;
    slots with an index outside ``[0, E)``, e.g. -1, sort first and are padding rows); quantise x per 1x128
    (``per_token_group_quant_fp8``); gather the quantised rows; grouped gate/up GEMM (``m_grouped_fp8_gemm_nt_contiguous``,
    bf16 out); ``swiglu_clamp_quant_fp8``; grouped down GEMM (bf16 out); :func:`moe_combine`: each token's k
    slots added in slot order j = 0..k-1 in float32 (a fixed order: the result for a token does not depend on the
    batch).

    Args:
        x: ``[T, hidden]`` bfloat16/float32 activations.
        topk_idx: ``[T, k]`` integer expert ids, any integer dtype (-1 = no expert for that slot; any id outside
            ``[0, E)``, e.g. an int64 ``2**32 + e``, is also padding: ids are compared in int64, never wrapped).
        topk_weights: ``[T, k]`` float routing weights (already normalised/scaled by the caller).
        w13: ``[E, 2I, hidden]`` float8_e4m3fn: gate (w1) rows ``[:I]`` then up (w3) rows ``[I:]``.
        w13_scale: ``[E, ceil(2I/128), ceil(hidden/128)]`` float32.
        w2: ``[E, hidden, I]`` float8_e4m3fn (down); w2_scale ``[E, ceil(hidden/128), ceil(I/128)]`` float32.
        swiglu_limit: the clamp of the SwiGLU (10 for V4-Flash).
        scale_ue8m0: power-of-two activation scales.
        out_dtype: result dtype (default ``x.dtype``).
    Returns:
        ``[T, hidden]`` tensor of ``out_dtype`` (accumulated in float32).
    Raises:
        ValueError / RuntimeError on shape or dtype mismatch; TypeError for a non-integer ``topk_idx``;
        RuntimeError naming the tensor when the tensors are not all on one device (``meta`` included).
    """
    check_same_device("fused_moe_fp8", {"x": x, "topk_idx": topk_idx, "topk_weights": topk_weights, "w13": w13,
                                        "w13_scale": w13_scale, "w2": w2, "w2_scale": w2_scale})
    if topk_idx.dtype.is_floating_point or topk_idx.dtype.is_complex or topk_idx.dtype == torch.bool:
        raise TypeError(f"deepinfer_ops.fused_moe_fp8: topk_idx must be an integer tensor, got {topk_idx.dtype}")
    if x.dim() != 2 or topk_idx.dim() != 2 or topk_idx.shape != topk_weights.shape or topk_idx.shape[0] != x.shape[0]:
        raise ValueError(f"x must be [T, hidden] and topk_idx/topk_weights [T, k]; got {tuple(x.shape)}, "
                         f"{tuple(topk_idx.shape)}, {tuple(topk_weights.shape)}")
    num_tokens = topk_idx.shape[0]
    num_experts, two_i, hidden = w13.shape
    if x.shape[1] != hidden or w2.shape[0] != num_experts or w2.shape[1] != hidden or 2 * w2.shape[2] != two_i:
        raise ValueError(f"weight shapes do not match: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, "
                         f"w2 {tuple(w2.shape)}")
    out_dtype = out_dtype or x.dtype
    if num_tokens == 0:
        return torch.zeros((0, hidden), dtype=out_dtype, device=x.device)

    m_indices, token_of_row, slot_rows = moe_permute(topk_idx, num_experts)
    xq, xs = per_token_group_quant_fp8(x, 128, scale_ue8m0)
    a = xq[token_of_row]
    a_scale = xs[token_of_row]
    h = m_grouped_fp8_gemm_nt_contiguous(a, a_scale, w13, w13_scale, m_indices)  # [R, 2I] bf16
    hq, hs = swiglu_clamp_quant_fp8(h, swiglu_limit, scale_ue8m0, column_major_scales=h.is_cuda)
    y = m_grouped_fp8_gemm_nt_contiguous(hq, hs, w2, w2_scale, m_indices)  # [R, hidden] bf16
    return moe_combine(y, slot_rows, topk_weights.float().contiguous(), out_dtype)


def moe_permute(topk_idx: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The row order of the grouped expert GEMMs: the ``T * k`` (token, slot) pairs stably sorted by expert.

    Row ``r`` of the sorted order is slot ``i = t * k + j``; slots whose id is outside ``[0, num_experts)`` (e.g. -1)
    are padding and come first, then expert 0's slots, expert 1's, ... each in slot order (the stable sort of the
    ids, so the layout -- hence every result -- depends only on ``topk_idx``). One native op (CPU: a counting sort;
    CUDA: one CTA, a counting sort with per-warp segments), no host synchronisation.

    Args:
        topk_idx: ``[T, k]`` integer expert ids (int32 / int64 are read as they are; other integer dtypes are
            widened to int64 first; compared in int64, never wrapped).
        num_experts: E, in ``[0, 2^31)`` (CUDA: at most 25000).
    Returns:
        ``(m_indices, token_of_row, slot_rows)``: ``m_indices`` ``[T*k]`` int32, the expert of each sorted row (-1 for
        padding: the grouped GEMMs' contiguous layout); ``token_of_row`` ``[T*k]`` int64, the token each sorted row
        comes from; ``slot_rows`` ``[T, k]`` int64, the sorted row of each slot, -1 for padding slots
        (:func:`moe_combine`'s input).
    Raises:
        TypeError for a non-integer ``topk_idx``; RuntimeError naming the tensor or argument at fault.
    Source: the token permutation of MoE expert parallelism (DeepEP's dispatch layout, vLLM's moe_align_block_size),
    with DeepGEMM's contiguous grouped layout (-1 = padding row).
    """
    if topk_idx.dtype.is_floating_point or topk_idx.dtype.is_complex or topk_idx.dtype == torch.bool:
        raise TypeError(f"deepinfer_ops.moe_permute: topk_idx must be an integer tensor, got {topk_idx.dtype}")
    if topk_idx.dtype not in (torch.int32, torch.int64):
        topk_idx = topk_idx.to(torch.int64)
    topk_idx = topk_idx.contiguous()
    rows = topk_idx.numel()
    m_indices = torch.empty(rows, dtype=torch.int32, device=topk_idx.device)
    token_of_row = torch.empty(rows, dtype=torch.int64, device=topk_idx.device)
    slot_rows = torch.empty(topk_idx.shape, dtype=torch.int64, device=topk_idx.device)
    torch.ops.deepinfer_ops.moe_permute(m_indices, token_of_row, slot_rows, topk_idx, num_experts)
    return m_indices, token_of_row, slot_rows


def moe_combine(y: torch.Tensor, slot_rows: torch.Tensor, weights: torch.Tensor,
                out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The MoE combine: ``out[t] = sum_j weights[t, j] * y[slot_rows[t, j]]`` over the slots ``j = 0 .. k-1`` in
    that order, float32 accumulation, rounded once (a token's result does not depend on the batch).

    Args:
        y: ``[rows, hidden]`` float32 / bfloat16 / float16 expert outputs (last dim contiguous, any row stride).
        slot_rows: ``[tokens, k]`` int64: the row of ``y`` holding each slot's expert output; -1 (or any value
            outside ``[0, rows)``) = no expert for that slot: it adds nothing (its ``y`` row is never read, so NaN in
            padding rows cannot leak).
        weights: ``[tokens, k]`` float32 routing weights.
        out_dtype: result dtype, float32 / bfloat16 / float16 (default ``y.dtype``).
    Returns:
        ``[tokens, hidden]`` of ``out_dtype``.
    Raises:
        RuntimeError naming the tensor at fault (dtype, shape, device, layout).
    Source: the weighted combine of DeepSeek-V3/V4's MoE (``sum_j w_j * expert_j(x)``), as in DeepEP's combine.
    """
    out = torch.empty(slot_rows.shape[0], y.shape[-1], dtype=out_dtype or y.dtype, device=y.device)
    torch.ops.deepinfer_ops.moe_combine(out, y, slot_rows, weights)
    return out

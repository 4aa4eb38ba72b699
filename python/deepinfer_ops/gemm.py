"""FP8 block-scaled GEMMs (the DeepSeek-V3/V4 recipe) and the FP4-expert-weight conversion.

Recipe: activations are float8_e4m3fn with one float32 scale per 1x128 group of a row (as produced by
``per_token_group_quant_fp8``), weights float8_e4m3fn with one float32 scale per 128x128 block. For each 128-deep
K block kb the block's products are summed in float32 and added to a float32 accumulator after multiplying by
``a_scale[m, kb] * b_scale[n // 128, kb]``; the result is rounded once to the output dtype. K and N need not be
multiples of 128 (the last blocks are partial and use their own scale). Scales may be any positive float32,
including UE8M0 (power-of-two) values.

CUDA (sm90a): CUTLASS 3.x warp-specialized TMA + wgmma kernels with blockwise scaling (tile 128x128x128,
persistent, no split-K: deterministic and independent of M). CUDA alignment limits: K % 16 == 0, N % 8 == 0
(bf16 out; N % 4 for fp32 out), 16-byte-aligned base pointers (true for fresh tensors and row slices with such K).
CPU: the same contract with ATen matmuls per K block (for tests and CPU fallback; not fast).
Source: DeepSeek-V3 technical report (fine-grained FP8), DeepGEMM's API (fp8_gemm_nt, m_grouped_*), CUTLASS
example 67/68 (blockwise-scaled FP8 GEMM on Hopper).
"""

from __future__ import annotations

import torch

from ._fake import check_same_device
from .quant import scale_buffer
from .testing import refs as _refs

SCALE_BLOCK = 128
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


def index_to_int32(op: str, name: str, t: torch.Tensor) -> torch.Tensor:
    """``t`` (any integer dtype) as a contiguous int32 tensor on its device, without wrapping: values outside the
    int32 range saturate to ``-2**31`` / ``2**31 - 1``, so an out-of-range index stays out of range and meets the op's
    own range rule (the CPU ops raise naming the tensor; the CUDA ops, which cannot check without a host sync, apply
    their documented padding/clamping rule) instead of wrapping onto a valid index (``2**32 + 3`` -> 3).

    Raises: TypeError naming ``op`` and ``name`` for a non-integer (float, bool, complex) or uint64 tensor.
    """
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype in (torch.bool, torch.uint64):
        raise TypeError(f"deepinfer_ops.{op}: {name} must be an integer tensor (int8..int64, uint8..uint32), "
                        f"got {t.dtype}")
    if t.dtype == torch.uint32:
        t = t.to(torch.int64)  # lossless; then saturated below
    if t.dtype == torch.int64:
        t = t.clamp(_INT32_MIN, _INT32_MAX)
    return t.to(torch.int32).contiguous()


def fp8_gemm_nt(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    accumulate: bool = False,
    split_k: int = 1,
) -> torch.Tensor:
    """``out[M, N] = A[M, K] @ B[N, K]^T`` with FP8 block scaling ("NT": both operands K-contiguous).

    Args:
        a: ``[M, K]`` float8_e4m3fn activations, K contiguous (row stride may be larger than K).
        a_scale: ``[M, ceil(K/128)]`` float32 per-token-group scales, row-major or column-major (strides
            ``(1, ld)`` with ``ld >= M`` a multiple of 4, what ``per_token_group_quant_fp8(...,
            column_major_scales=True)`` returns; the CUDA kernel reads this layout directly -- also strides
            ``(1, M)`` when M % 4 == 0 --, other layouts are copied into it first).
        b: ``[N, K]`` float8_e4m3fn weight, K contiguous.
        b_scale: ``[ceil(N/128), ceil(K/128)]`` float32 block scales (row-major is read directly).
        out: optional preallocated ``[M, N]`` bfloat16 or float32 output (N contiguous); mutated.
        out_dtype: dtype of a newly allocated ``out`` (bfloat16 or float32).
        accumulate: float32 ``out`` only: ``out += A @ B^T`` instead of overwriting (one rounding).
        split_k: 1 (default): every output tile is computed by one CTA over all of K -- deterministic and
            batch-invariant (a row's bits do not depend on M). > 1 (bfloat16 out, no accumulate; clamped to
            ceil(K/128)): CUDA splits K into that many parts and reduces the fp32 partial tiles in a fixed order
            (still deterministic for a given split_k, but not bit-equal to split_k = 1). Meant for small M, where
            few output tiles leave SMs idle, although on the H200 the default (which takes 64x128 ping-pong tiles
            at small M) is faster at every benchmarked shape (bench/NOTES-fp8-gemm.md). The CPU op ignores it.
    Returns:
        ``out``. M = 0 or N = 0 returns the empty result; K = 0 gives zeros (or leaves ``out`` with accumulate).
    Raises:
        RuntimeError naming the tensor at fault (dtype, shape, device -- ``meta`` mixed with real devices included --,
        CUDA alignment, an ``out`` whose elements share memory such as an ``expand``ed view).
    """
    if out is None:
        if accumulate:
            raise ValueError("accumulate=True needs a preallocated float32 out")
        out = torch.empty((a.shape[0], b.shape[0]), dtype=out_dtype, device=a.device)
    torch.ops.deepinfer_ops.fp8_gemm_nt(out, a, a_scale, b, b_scale, accumulate, split_k)
    return out


def m_grouped_fp8_gemm_nt_contiguous(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    m_indices: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Grouped GEMM, rows grouped by expert: ``out[r] = A[r] @ B[m_indices[r]]^T`` (block-scaled, bf16 out).

    The rows of each group must form one contiguous run of ``a`` (groups may appear in any order, may be empty,
    and need no alignment); ``m_indices[r] == -1`` marks a padding row: it is not read and ``out[r]`` is left
    untouched (not zeroed). The CPU op raises when a group's rows are not contiguous or an index is outside
    ``[-1, G)``; the CUDA op cannot check without a host sync: there, a group spans the rows from its first to its
    last occurrence, and indices outside ``[-1, G)`` are treated as padding.

    Args:
        a: ``[M, K]`` float8_e4m3fn, K contiguous.
        a_scale: ``[M, ceil(K/128)]`` float32, any strides (the CUDA op packs each group's scales into the compact
            per-group layout CUTLASS's grouped kernel reads, in a device workspace, without a host sync).
        b: ``[G, N, K]`` float8_e4m3fn expert weights, K contiguous.
        b_scale: ``[G, ceil(N/128), ceil(K/128)]`` float32; the CUDA op reads it in place when each group is compact
            (strides ``(any, ceil(K/128), 1)``), otherwise copies it first.
        m_indices: ``[M]`` group index per row (any integer dtype; converted to int32 by ``index_to_int32``:
            values outside the int32 range saturate instead of wrapping), -1 = padding.
        out: optional ``[M, N]`` bfloat16 output (mutated in the group rows only).
    Returns:
        ``out`` (a new ``torch.empty`` tensor when not given: padding rows then hold garbage).
    Raises:
        RuntimeError naming the tensor at fault (also for tensors on different devices, ``meta`` included, and an
        ``out`` whose elements share memory); TypeError for a non-integer ``m_indices``.
    """
    if out is None:
        out = torch.empty((a.shape[0], b.shape[1]), dtype=torch.bfloat16, device=a.device)
    m_indices = index_to_int32("m_grouped_fp8_gemm_nt_contiguous", "m_indices", m_indices)
    torch.ops.deepinfer_ops.m_grouped_fp8_gemm_nt_contiguous(out, a, a_scale, b, b_scale, m_indices)
    return out


def m_grouped_fp8_gemm_nt_masked(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    masked_m: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Grouped GEMM, masked (decode) layout: ``out[g, :masked_m[g]] = A[g, :masked_m[g]] @ B[g]^T``.

    Rows ``>= masked_m[g]`` of ``out[g]`` are left untouched. The CPU op raises when ``masked_m[g]`` is outside
    ``[0, max_m]``; the CUDA op (no host sync) clamps it into that range.

    Args:
        a: ``[G, max_m, K]`` float8_e4m3fn, K contiguous.
        a_scale: ``[G, max_m, ceil(K/128)]`` float32, any strides (the CUDA op packs the first ``masked_m[g]`` rows
            of each group into the compact layout CUTLASS's grouped kernel reads, in a device workspace).
        b: ``[G, N, K]`` float8_e4m3fn; b_scale ``[G, ceil(N/128), ceil(K/128)]`` float32 (copied first unless each
            group is compact, strides ``(any, ceil(K/128), 1)``).
        masked_m: ``[G]`` valid rows per group (any integer dtype; converted to int32 by ``index_to_int32``, values
            outside the int32 range saturate instead of wrapping; stays on the device: no sync).
        out: optional ``[G, max_m, N]`` bfloat16 output.
    Returns:
        ``out``.
    Raises:
        RuntimeError naming the tensor at fault (also for tensors on different devices, ``meta`` included, and an
        ``out`` whose elements share memory); TypeError for a non-integer ``masked_m``.
    """
    if out is None:
        out = torch.empty((a.shape[0], a.shape[1], b.shape[1]), dtype=torch.bfloat16, device=a.device)
    masked_m = index_to_int32("m_grouped_fp8_gemm_nt_masked", "masked_m", masked_m)
    torch.ops.deepinfer_ops.m_grouped_fp8_gemm_nt_masked(out, a, a_scale, b, b_scale, masked_m)
    return out


def fp4_to_fp8_blockscaled(w: torch.Tensor, w_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Convert an FP4 e2m1 expert weight (the V4-Flash checkpoint format) to FP8 e4m3 with 128x128 block scales.

    Per 128x128 block: ``emax`` = the largest finite UE8M0 exponent among the block's per-32 scales; the block
    scale is ``2^(emax - 127 - 6)`` (UE8M0-valued float32) and each element becomes
    ``e4m3(v * 2^(e - emax + 6))`` (v the e2m1 value, e its group's exponent), so ``|q| <= 6 * 64 = 384``.
    The conversion is exact (dequantised FP8 == dequantised FP4, bit for bit) whenever every group exponent of a
    block is within 14 of the block's largest; groups further below lose precision (RNE into e4m3 subnormals,
    flushing to 0 below 2^-10 relative). A scale byte of 255 (NaN) gives NaN elements.

    Args:
        w: ``[N, K/2]`` int8 or uint8, contiguous; element 2i in the low nibble, 2i+1 in the high nibble.
        w_scale: ``[N, ceil(K/32)]`` uint8 or float8_e8m0fnu exponents (value ``2^(e - 127)``), contiguous.
    Returns:
        (q ``[N, K]`` float8_e4m3fn, scale ``[ceil(N/128), ceil(K/128)]`` float32), on ``w``'s device.
    Raises:
        RuntimeError naming the tensor at fault (also when ``w`` and ``w_scale`` are on different devices).
    Notes:
        Runs the CPU op for CPU tensors and the identical vectorised torch formula (``testing.refs``) elsewhere;
        both are bit-identical (tested). FP8 doubles the expert memory relative to FP4 (see moe.py).
    """
    check_same_device("fp4_to_fp8_blockscaled", {"w": w, "w_scale": w_scale})
    if w.dim() != 2 or w_scale.dim() != 2:
        raise ValueError(f"fp4_to_fp8_blockscaled: w must be [N, K/2] and w_scale [N, ceil(K/32)], got "
                         f"{tuple(w.shape)} and {tuple(w_scale.shape)}")
    n, k = w.shape[0], 2 * w.shape[1]
    if w.device.type != "cpu":
        return _refs.fp4_to_fp8_blockscaled_ref(w, w_scale)
    q = torch.empty((n, k), dtype=torch.float8_e4m3fn, device=w.device)
    s = torch.empty((-(-n // SCALE_BLOCK), -(-k // SCALE_BLOCK)), dtype=torch.float32, device=w.device)
    torch.ops.deepinfer_ops.fp4_to_fp8_blockscaled(q, s, w, w_scale)
    return q, s


def swiglu_clamp_quant_fp8(
    gate_up: torch.Tensor,
    limit: float = 10.0,
    scale_ue8m0: bool = False,
    column_major_scales: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V4's clamped SwiGLU fused with FP8 re-quantisation for the down projection.

    ``h = silu(min(gate, limit)) * clamp(up, -limit, limit)`` in float32 (not rounded), then per 128 columns:
    ``scale = max(amax|h|, 1e-10) / 448`` (UE8M0: rounded up to a power of two), ``q = e4m3(clamp(h / scale))``
    (RNE) -- the ``per_token_group_quant_fp8`` recipe. NaN propagates.

    Args:
        gate_up: ``[rows, 2I]`` float32/bfloat16/float16, gate = ``[:, :I]``, up = ``[:, I:]``, last dim contiguous.
        limit: the SwiGLU clamp (``swiglu_limit``, 10 for V4-Flash), > 0.
        scale_ue8m0: power-of-two scales.
        column_major_scales: return scales M-major, strides ``(1, ld)`` (``quant.scale_buffer``: the layout the
            CUDA GEMMs read).
    Returns:
        (q ``[rows, I]`` float8_e4m3fn, scale ``[rows, ceil(I/128)]`` float32).
    Raises:
        RuntimeError naming the tensor at fault.
    Source: DeepSeek-V4 inference code (experts: ``w2(silu(min(w1 x, limit)) * clamp(w3 x, +-limit))``).
    """
    rows, i = gate_up.shape[0], gate_up.shape[-1] // 2
    groups = -(-i // SCALE_BLOCK)
    q = torch.empty((rows, i), dtype=torch.float8_e4m3fn, device=gate_up.device)
    s = scale_buffer(rows, groups, gate_up.device, column_major_scales)
    torch.ops.deepinfer_ops.swiglu_clamp_quant_fp8(q, s, gate_up, float(limit), scale_ue8m0)
    return q, s

"""DeepSeek-V4 building blocks: RoPE frequencies, linears (dequantised or FP8 block-scaled), norms, embedding, mHC.

Design notes (GEMM paths, batch-invariant mode): ``docs/deepseek_v4.md``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

import deepinfer_ops
from deepinfer.batch_invariant import pointwise

from .config import DeepseekV4Config


# ----------------------------------------------------------------------------------------------------------------
# RoPE frequencies
# ----------------------------------------------------------------------------------------------------------------
def rope_inv_freq(config: DeepseekV4Config, kind: str) -> torch.Tensor:
    """``[qk_rope_head_dim / 2]`` float32 inverse frequencies. ``kind`` = ``"main"`` (sliding layers: plain,
    ``rope_theta``) or ``"compress"`` (CSA/HCA layers, compressors, indexer: ``compress_rope_theta``, YaRN if
    ``config.rope_scaling``; the YaRN attention factor is 1, cos/sin are not rescaled).
    Source: transformers 5.23 ``_compute_yarn_parameters`` (truncate=True), same float32 arithmetic."""
    dim = config.qk_rope_head_dim
    if kind == "main":
        base = config.rope_theta
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    if kind != "compress":
        raise ValueError(f"rope kind: expected 'main' or 'compress', got {kind!r}")
    base = config.compress_rope_theta
    ys = config.rope_scaling
    if ys is None:
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    factor, orig = ys["factor"], ys["original_max_position_embeddings"]
    beta_fast, beta_slow = ys["beta_fast"], ys["beta_slow"]

    def correction_dim(num_rot: float) -> float:
        return (dim * math.log(orig / (num_rot * 2 * math.pi))) / (2 * math.log(base))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extra_factor = 1 - ramp
    return interpolation * (1 - extra_factor) + extrapolation * extra_factor


# ----------------------------------------------------------------------------------------------------------------
# parameter holders (names = native checkpoint names)
# ----------------------------------------------------------------------------------------------------------------
def _param(*shape: int, dtype=torch.float32) -> nn.Parameter:
    return nn.Parameter(torch.zeros(shape, dtype=dtype), requires_grad=False)


def linear_rows(x: torch.Tensor, weight: torch.Tensor, rows: int = 0) -> torch.Tensor:
    """``y = x @ weight.T``; with ``rows > 0`` every GEMM call has exactly ``rows`` rows (batch-invariant mode).

    Args:
        x: ``[..., in]`` activations (any leading dims, flattened to ``[M, in]``).
        weight: ``[out, in]``, same dtype as ``x``.
        rows: 0 = one ``F.linear`` call (the library picks tiles / split-K by M, so a row's bits may depend on M);
            ``rows > 0`` = the rows are cut into chunks of exactly ``rows`` (the last one zero-padded) and each chunk
            is one ``torch.mm`` of the fixed shape ``[rows, in'] x [in', out']`` (``in``, ``out`` zero-padded to
            multiples of 16 -- MKL treats narrow / odd shapes position-dependently; the model's large weights need
            no padding). Every call has the same shape, strides and (>= 256-byte) operand alignment, so cuBLAS /
            MKL choose the same kernel for every chunk and a row's reduction order is the same wherever it sits and
            whoever shares its chunk.
    Returns:
        ``[..., out]`` in ``x.dtype``.
    Cost: ``ceil(M / rows)`` GEMM launches instead of one and up to ``rows - 1`` padded rows (copied: a copy of the
    last partial chunk, or of all of ``x`` when it is not contiguous / aligned / 16-wide); with ``rows`` = 128 on
    CUDA a decode batch of <= 128 tokens is still one launch (bandwidth-bound on the weight, the padding is free).
    """
    if rows <= 0:
        return F.linear(x, weight)
    k, n = x.shape[-1], weight.shape[0]
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    if m == 0:
        return x2.new_empty(*lead, n)
    kp, np_ = -(-k // 16) * 16, -(-n // 16) * 16
    if (kp, np_) != (k, n):
        w = weight.new_zeros(np_, kp)
        w[:n, :k] = weight
        weight = w
    chunks = -(-m // rows)
    align = 256 if x2.is_cuda else 64  # what fresh allocations guarantee (CUDA caching allocator / c10 CPU)
    # whole chunks are read in place when x is laid out like a fresh allocation (every chunk start then keeps the
    # base alignment, as rows * kp * itemsize is a multiple of 256 for rows >= 8, and of 64 for any rows); the last
    # partial chunk (or everything, for another layout) goes through a fresh zero-padded copy of the same shape
    in_place = kp == k and x2.is_contiguous() and x2.data_ptr() % align == 0
    full = m // rows if in_place else 0
    if not in_place:
        xp = x2.new_zeros(chunks * rows, kp)
        xp[:m, :k] = x2
        x2 = xp
        full = chunks
    out = x2.new_empty(chunks * rows, np_)
    wt = weight.t()
    for c in range(full):
        torch.mm(x2[c * rows:(c + 1) * rows], wt, out=out[c * rows:(c + 1) * rows])
    if full < chunks:  # padding rows: uninitialised on CUDA (a GEMM row depends on its own row only; dropped),
        #                zeros on the CPU (no slow denormal arithmetic), as in pad_rows_buffer
        tail = x2.new_empty(rows, kp) if x2.is_cuda else x2.new_zeros(rows, kp)
        tail[:m - full * rows] = x2[full * rows:]
        torch.mm(tail, wt, out=out[full * rows:])
    return out[:m, :n].reshape(*lead, n)


def pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """``x [M, ...]`` zero-padded along dim 0 to a multiple of ``rows`` (``x`` itself when it already is one, is
    contiguous and aligned like a fresh allocation): batch-invariant mode keeps the token dimension padded so that
    every :func:`linear_rows` call takes whole chunks without copying."""
    m = x.shape[0]
    align = 256 if x.is_cuda else 64
    if rows <= 0 or (m % rows == 0 and x.is_contiguous() and x.data_ptr() % align == 0):
        return x
    out = x.new_zeros(-(-m // rows) * rows, *x.shape[1:])
    out[:m] = x
    return out


def pad_rows_buffer(like: torch.Tensor, m: int, rows: int) -> torch.Tensor:
    """A fresh ``[ceil(m / rows) * rows, *like.shape[1:]]`` buffer for ``m`` rows of ``like``'s dtype and device.
    Its padding rows are zero on the CPU and left uninitialised on CUDA: a GEMM row (and every row-wise op) depends
    on its own row only, and padding rows are dropped, so their content never matters -- zeros on the CPU only
    avoid slow denormal arithmetic."""
    shape = (-(-m // rows) * rows, *like.shape[1:])
    return like.new_empty(shape) if like.is_cuda else like.new_zeros(shape)


FP8_BLOCK = 128  # block of the FP8 weight scales (128 x 128) and group of the activation scales (1 x 128)
GEMM_PATHS = ("auto", "fp8", "dequant")


def resolve_gemm(gemm: str, device: torch.device | str | None) -> str:
    """The GEMM path ``"fp8"`` or ``"dequant"`` for the requested ``gemm`` (``"auto"``: ``"fp8"`` on a CUDA
    ``device``, ``"dequant"`` elsewhere). Raises ValueError naming ``gemm`` for another value."""
    if gemm not in GEMM_PATHS:
        raise ValueError(f"gemm: expected one of {GEMM_PATHS}, got {gemm!r}")
    if gemm != "auto":
        return gemm
    return "fp8" if device is not None and torch.device(device).type == "cuda" else "dequant"


def _fp8_out_dtype(x: torch.Tensor) -> torch.dtype:
    return x.dtype if x.dtype in (torch.bfloat16, torch.float32) else torch.bfloat16


def quant_act_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` -> (float8_e4m3fn ``[M, K]``, float32 ``[M, ceil(K/128)]`` 1x128 scales) in the layout the FP8
    GEMMs read on ``x``'s device (column-major scales on CUDA)."""
    return deepinfer_ops.per_token_group_quant_fp8(x.contiguous(), FP8_BLOCK, column_major_scales=x.is_cuda)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``y = x @ (weight * scale).T`` the DeepSeek-V3/V4 way: the activations quantised per 1x128 group
    (:func:`deepinfer_ops.per_token_group_quant_fp8`), then the FP8 block-scaled GEMM
    (:func:`deepinfer_ops.fp8_gemm_nt`, float32 accumulation, ``split_k=1``: batch-invariant).

    Args:
        x: ``[..., in]`` float32 / bfloat16 activations.
        weight: ``[out, in]`` float8_e4m3fn.
        scale: ``[ceil(out/128), ceil(in/128)]`` float32 block scales.
    Returns:
        ``[..., out]`` in ``x.dtype`` (bfloat16 for other input dtypes).
    Raises:
        RuntimeError from the ops naming the tensor at fault (dtype, shape, CUDA alignment: in % 16, out % 8).
    """
    k, n = x.shape[-1], weight.shape[0]
    lead = x.shape[:-1]
    xq, xs = quant_act_fp8(x.reshape(-1, k))
    return deepinfer_ops.fp8_gemm_nt(xq, xs, weight, scale, out_dtype=_fp8_out_dtype(x)).view(*lead, n)


def fp8_block_weight(t, device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One linear weight as FP8 e4m3 with float32 128x128 block scales, on ``device`` (default: where it is).

    Args:
        t: a ``deepinfer.quantization.QuantizedWeight`` (``"fp8"`` with 128x128 blocks: kept as stored, UE8M0 scales
            converted to float32 exactly; ``"fp4"`` with UE8M0 scales: :func:`deepinfer_ops.fp4_to_fp8_blockscaled`;
            other block sizes / float32 FP4 scales: dequantised, then quantised as below) or a float ``[out, in]``
            tensor (quantised: scale ``amax / 448`` per block, round to nearest even, see
            ``deepinfer.quantization.quantize_fp8_block``).
    Returns:
        (``[out, in]`` float8_e4m3fn contiguous, ``[ceil(out/128), ceil(in/128)]`` float32 contiguous).
    Raises:
        ValueError for non-finite float weights.
    """
    from deepinfer import quantization as Q
    from deepinfer.quantization import QuantizedWeight

    if isinstance(t, QuantizedWeight):
        dev = device if device is not None else t.data.device
        if t.fmt == "fp8" and tuple(t.block) == (FP8_BLOCK, FP8_BLOCK):  # UE8M0 -> float32 where the scale is
            return t.data.to(dev).contiguous(), Q.scale_to_float(t.scale).to(dev).contiguous()
        if t.fmt == "fp4" and t.scale.dtype != torch.float32:
            return deepinfer_ops.fp4_to_fp8_blockscaled(t.data.to(dev).contiguous(),
                                                        t.scale.view(torch.uint8).to(dev).contiguous())
        t = t.dequantize()
    w = t.detach().to(device=device if device is not None else t.device)
    with torch.device(w.device):
        q, s = Q.quantize_fp8_block(w, (FP8_BLOCK, FP8_BLOCK), scale_fmt="float")
    return q.contiguous(), s.contiguous()


class Linear(nn.Module):
    """``y = x @ weight.T``. Two weight formats (chosen at load, see the module docstring's GEMM paths):

    * dequantised: ``weight [out, in]`` in the model dtype, ``scale`` None; ``forward(x, rows)`` =
      :func:`linear_rows` (``rows > 0``: fixed-shape, batch-invariant GEMM chunks);
    * FP8: ``weight [out, in]`` float8_e4m3fn and ``scale [ceil(out/128), ceil(in/128)]`` float32 block scales;
      ``forward`` = :func:`fp8_linear` (batch-invariant by construction: ``rows`` is ignored).
    """

    def __init__(self, out_features: int, in_features: int, dtype: torch.dtype):
        super().__init__()
        self.weight = _param(out_features, in_features, dtype=dtype)
        self.register_parameter("scale", None)

    @property
    def is_fp8(self) -> bool:
        return self.scale is not None

    def set_fp8(self, weight: torch.Tensor, scale: torch.Tensor) -> None:
        """Hold ``weight`` (float8_e4m3fn ``[out, in]``) and its float32 block ``scale`` (taken over, not copied)."""
        out, inp = self.weight.shape
        want = (-(-out // FP8_BLOCK), -(-inp // FP8_BLOCK))
        if weight.dtype != torch.float8_e4m3fn or tuple(weight.shape) != (out, inp):
            raise ValueError(f"Linear.set_fp8: weight must be float8_e4m3fn {[out, inp]}, got {weight.dtype} "
                             f"{list(weight.shape)}")
        if scale.dtype != torch.float32 or tuple(scale.shape) != want:
            raise ValueError(f"Linear.set_fp8: scale must be float32 {list(want)}, got {scale.dtype} "
                             f"{list(scale.shape)}")
        self._parameters["weight"] = nn.Parameter(weight, requires_grad=False)
        self._parameters["scale"] = nn.Parameter(scale, requires_grad=False)

    def fp8_rows(self, r0: int, r1: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Output rows ``[r0, r1)`` of an FP8 weight as a block-scaled weight of its own: (``weight[r0:r1]``, its
        ``[ceil((r1-r0)/128), ceil(in/128)]`` scales). Needs ``r0 % 128 == 0`` or the rows inside one 128-row block
        (else ValueError: their blocks straddle the stored ones)."""
        b0 = r0 // FP8_BLOCK
        if r0 % FP8_BLOCK and b0 != (r1 - 1) // FP8_BLOCK:
            raise ValueError(f"Linear.fp8_rows: rows [{r0}, {r1}) straddle the 128-row scale blocks")
        return self.weight[r0:r1], self.scale[b0:b0 + -(-(r1 - r0) // FP8_BLOCK)]

    def fp8_groups(self, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
        """An FP8 weight as ``groups`` equal row blocks, the B operand of a grouped GEMM: (``[groups, out / groups,
        in]`` view of the weight, ``[groups, ceil(out / groups / 128), ceil(in/128)]`` scales: a view when a block
        is whole 128-row scale blocks, else each block's scale rows gathered, see :meth:`fp8_rows`)."""
        r = self.weight.shape[0] // groups
        w = self.weight.view(groups, r, -1)
        if r % FP8_BLOCK == 0:
            return w, self.scale.reshape(groups, r // FP8_BLOCK, -1)
        return w, torch.stack([self.fp8_rows(g * r, (g + 1) * r)[1] for g in range(groups)])

    def forward(self, x: torch.Tensor, rows: int = 0) -> torch.Tensor:
        if self.scale is not None:
            return fp8_linear(x, self.weight, self.scale)
        return linear_rows(x, self.weight, rows)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.weight = _param(dim, dtype=dtype)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return deepinfer_ops.rms_norm(x.contiguous(), self.weight, self.eps)


class Embedding(nn.Module):
    def __init__(self, vocab: int, dim: int, dtype: torch.dtype):
        super().__init__()
        self.weight = _param(vocab, dim, dtype=dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)



# ----------------------------------------------------------------------------------------------------------------
# mHC (hyper-connections): each per token in a fixed order, in either mode
# ----------------------------------------------------------------------------------------------------------------
def hc_pre(cfg: DeepseekV4Config, streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor):
    """streams ``[T, hc, D]`` -> (post ``[T, hc]``, comb ``[T, hc, hc]`` float32, collapsed ``[T, D]``): the mixing
    coefficients from :func:`deepinfer_ops.hc_mix` (RMS norm of the concatenated streams fused with the projection
    on ``fn``), the gates and the Sinkhorn-normalised mix from :func:`deepinfer_ops.hc_weights`, the sublayer input
    from :func:`deepinfer_ops.hc_collapse`."""
    hc = cfg.hc_mult
    T = streams.shape[0]
    mix = deepinfer_ops.hc_mix(streams.view(T, hc * streams.shape[2]), fn.float().contiguous(), cfg.rms_norm_eps)
    pre, post, comb = deepinfer_ops.hc_weights(mix, base.float().contiguous(), scale.float().contiguous(), hc,
                                               cfg.hc_eps, cfg.hc_sinkhorn_iters)
    return post, comb, deepinfer_ops.hc_collapse(streams, pre)


def hc_post(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """``new[:, j] = post[:, j] * out + sum_i comb[:, i, j] * streams[:, i]`` (:func:`deepinfer_ops.hc_post`)."""
    return deepinfer_ops.hc_post(streams, out.contiguous(), post, comb)


def hc_head(cfg: DeepseekV4Config, streams: torch.Tensor, fn, base, scale, rows: int = 0) -> torch.Tensor:
    """The final streams ``[T, hc, D]`` collapsed to ``[T, D]`` with the head's mHC parameters."""
    T = streams.shape[0]
    mixes = deepinfer_ops.hc_mix(streams.reshape(T, streams.shape[1] * streams.shape[2]), fn.float().contiguous(),
                                 cfg.rms_norm_eps)
    pre = pointwise(torch.sigmoid, mixes * scale.float() + base.float(), rows) + cfg.hc_eps
    return deepinfer_ops.hc_collapse(streams.contiguous(), pre.contiguous())

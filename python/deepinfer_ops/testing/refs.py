"""Pure-torch float32 references, one per op, documented like the kernels they check.

Each reference computes in float32 (or exactly, for integer/bit-level recipes) and returns new tensors; it
is slow and simple on purpose. Kernels are tested against these on random inputs and edge cases.
"""

from __future__ import annotations

import torch

FP8_E4M3_MAX = 448.0
QUANT_AMAX_EPS = 1e-10


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x^2, -1) + eps) * weight`` in float32, rounded once to x's dtype. x ``[..., hidden]``."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    return y.to(x.dtype)


def round_up_pow2_ref(s: torch.Tensor) -> torch.Tensor:
    """Smallest power of two >= s for positive normal float32 s, exactly (exponent bits; UE8M0 scales)."""
    bits = s.float().contiguous().view(torch.int32)
    exp = (bits >> 23) & 0xFF
    exp = exp + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return (exp << 23).view(torch.float32)


def per_token_group_quant_fp8_ref(
    x: torch.Tensor, group_size: int = 128, scale_ue8m0: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of ``per_token_group_quant_fp8``: returns ``(q [..., K] e4m3, scale [rows, groups] fp32 row-major)``.

    scale = max(amax, 1e-10) / 448 per group (NaN if the group holds NaN), optionally rounded up to a power of
    two; q = e4m3(clamp(x / scale, -448, 448)), round-to-nearest-even. The last group may be partial.
    """
    k = x.shape[-1]
    x2 = x.reshape(-1, k).float()
    rows = x2.shape[0]
    groups = -(-k // group_size)
    pad = groups * group_size - k
    xp = torch.nn.functional.pad(x2, (0, pad)).view(rows, groups, group_size)
    amax = xp.abs().amax(dim=-1)  # NaN propagates
    scale = torch.clamp(amax, min=QUANT_AMAX_EPS) / FP8_E4M3_MAX
    scale = torch.where(torch.isnan(amax), amax, scale)
    if scale_ue8m0:
        finite = torch.isfinite(scale)
        scale = torch.where(finite, round_up_pow2_ref(torch.where(finite, scale, torch.ones_like(scale))), scale)
    q = (xp / scale.unsqueeze(-1)).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    q = q.view(rows, groups * group_size)[:, :k].to(torch.float8_e4m3fn)
    return q.view(x.shape), scale


def dequant_per_token_group_fp8_ref(q: torch.Tensor, scale: torch.Tensor, group_size: int = 128) -> torch.Tensor:
    """float32 ``q * scale`` with each scale broadcast over its group. q ``[rows, K]``, scale ``[rows, groups]``."""
    k = q.shape[-1]
    s = scale.float().repeat_interleave(group_size, dim=-1)[..., :k]
    return q.float() * s


def rotary_embedding_ref(
    x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, inverse: bool = False
) -> torch.Tensor:
    """Reference of ``rotary_embedding`` (returns a new tensor). Interleaved pairs on the trailing rope_dim
    channels; positions outside ``[0, max_position)`` give NaN in the rope slice."""
    rope_dim = cos_sin_cache.shape[1]
    half = rope_dim // 2
    max_pos = cos_sin_cache.shape[0]
    pos = positions.long()
    valid = (pos >= 0) & (pos < max_pos)
    cs = cos_sin_cache[pos.clamp(0, max_pos - 1)].float()
    cos, sin = cs[:, :half], cs[:, half:]
    if inverse:
        sin = -sin
    y = x.clone()
    xr = x[..., x.shape[-1] - rope_dim:].float()
    shape = xr.shape
    xr = xr.reshape(*shape[:-1], half, 2)
    x0, x1 = xr[..., 0], xr[..., 1]
    if x.dim() == 3:
        cos, sin = cos[:, None, :], sin[:, None, :]
    y0 = x0 * cos - x1 * sin
    y1 = x0 * sin + x1 * cos
    rot = torch.stack([y0, y1], dim=-1).reshape(shape)
    bad = ~valid.view(-1, *([1] * (rot.dim() - 1)))
    rot = torch.where(bad, torch.full_like(rot, float("nan")), rot)
    y[..., x.shape[-1] - rope_dim:] = rot.to(x.dtype)
    return y


# ---- gemm ----
GEMM_SCALE_BLOCK = 128
FP4_SCALE_GROUP = 32
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequant_block_fp8_ref(q: torch.Tensor, scale: torch.Tensor, block: int = GEMM_SCALE_BLOCK) -> torch.Tensor:
    """float32 ``q * scale`` with one scale per ``block x block`` tile. q ``[..., N, K]``, scale
    ``[..., ceil(N/block), ceil(K/block)]`` (partial last tiles use their own scale)."""
    n, k = q.shape[-2], q.shape[-1]
    s = scale.float().repeat_interleave(block, dim=-2)[..., :n, :].repeat_interleave(block, dim=-1)[..., :k]
    return q.float() * s


def fp8_gemm_nt_ref(
    a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16, c: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference of ``fp8_gemm_nt``: dequantise A (``[M, K]`` e4m3, 1x128 scales ``[M, ceil(K/128)]``) and B
    (``[N, K]`` e4m3, 128x128 scales ``[ceil(N/128), ceil(K/128)]``) to float32, ``A @ B^T`` in float32 (plus
    ``c`` when given: the accumulate mode), rounded once to ``out_dtype``. Returns ``[M, N]``."""
    d = dequant_per_token_group_fp8_ref(a, a_scale) @ dequant_block_fp8_ref(b, b_scale).t()
    if c is not None:
        d = d + c.float()
    return d.to(out_dtype)


def m_grouped_fp8_gemm_nt_contiguous_ref(
    a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor, m_indices: torch.Tensor,
    out_init: torch.Tensor,
) -> torch.Tensor:
    """Reference of ``m_grouped_fp8_gemm_nt_contiguous``: row r of the result is ``A[r] @ B[m_indices[r]]^T``
    (block-scaled, float32, rounded to bf16) for ``m_indices[r] >= 0``; rows with ``m_indices[r] == -1`` keep
    ``out_init``'s values (the op leaves them untouched). a ``[M, K]``, b ``[G, N, K]``, out_init ``[M, N]``."""
    out = out_init.clone()
    af = dequant_per_token_group_fp8_ref(a, a_scale)
    for g in range(b.shape[0]):
        rows = (m_indices == g).nonzero().flatten()
        if rows.numel():
            out[rows] = (af[rows] @ dequant_block_fp8_ref(b[g], b_scale[g]).t()).to(out.dtype)
    return out


def m_grouped_fp8_gemm_nt_masked_ref(
    a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor, masked_m: torch.Tensor,
    out_init: torch.Tensor,
) -> torch.Tensor:
    """Reference of ``m_grouped_fp8_gemm_nt_masked``: ``out[g, :masked_m[g]] = A[g, :masked_m[g]] @ B[g]^T``
    (block-scaled, float32, rounded to bf16); rows ``>= masked_m[g]`` keep ``out_init``. a ``[G, max_m, K]``."""
    out = out_init.clone()
    for g in range(a.shape[0]):
        m = int(masked_m[g])
        if m:
            af = dequant_per_token_group_fp8_ref(a[g, :m], a_scale[g, :m])
            out[g, :m] = (af @ dequant_block_fp8_ref(b[g], b_scale[g]).t()).to(out.dtype)
    return out


def e8m0_to_exponent_ref(s: torch.Tensor) -> torch.Tensor:
    """UE8M0 scale bytes (uint8 or float8_e8m0fnu) as int32 biased exponents (value = 2^(e - 127), 255 = NaN)."""
    return s.view(torch.uint8).to(torch.int32)


def dequant_fp4_ref(w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """float32 values of an FP4 e2m1 weight: w ``[N, K/2]`` int8/uint8 with element 2i in the low nibble and
    2i+1 in the high nibble; w_scale ``[N, ceil(K/32)]`` UE8M0, one per 32 elements along K. Returns ``[N, K]``."""
    b = w.view(torch.uint8).to(torch.int64)
    codes = torch.stack([b & 0xF, b >> 4], dim=-1).flatten(-2)  # [N, K]
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=w.device)
    v = lut[codes]
    e = e8m0_to_exponent_ref(w_scale).repeat_interleave(FP4_SCALE_GROUP, dim=-1)[:, : v.shape[1]]
    s = torch.where(e == 255, torch.full_like(v, float("nan")), torch.ldexp(torch.ones_like(v), (e - 127).float()))
    return v * s


def fp4_to_fp8_blockscaled_ref(w: torch.Tensor, w_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of ``fp4_to_fp8_blockscaled``: per 128x128 block, emax = largest finite UE8M0 exponent of the
    block's scales; block scale = 2^(emax - 127 - 6); q = e4m3(v * 2^(e - emax + 6)) (RNE). Returns
    (q ``[N, K]`` e4m3, scale ``[ceil(N/128), ceil(K/128)]`` fp32). Exact when every group exponent e in a
    block satisfies emax - e <= 14."""
    n, k = w.shape[0], 2 * w.shape[1]
    blk = GEMM_SCALE_BLOCK
    e = e8m0_to_exponent_ref(w_scale).repeat_interleave(FP4_SCALE_GROUP, dim=-1)[:, :k]  # [N, K]
    nb, kb = -(-n // blk), -(-k // blk)
    e_fin = torch.where(e == 255, torch.zeros_like(e), e)
    pad = torch.nn.functional.pad(e_fin, (0, kb * blk - k, 0, nb * blk - n))
    emax = pad.view(nb, blk, kb, blk).amax(dim=(1, 3))  # [nb, kb]
    scale = torch.ldexp(torch.ones(nb, kb, device=w.device), (emax - 133).float())
    emax_full = emax.repeat_interleave(blk, 0)[:n].repeat_interleave(blk, 1)[:, :k]
    b = w.view(torch.uint8).to(torch.int64)
    codes = torch.stack([b & 0xF, b >> 4], dim=-1).flatten(-2)
    v = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=w.device)[codes]
    q = torch.ldexp(v, (e - emax_full + 6).float())
    q = torch.where(e == 255, torch.full_like(q, float("nan")), q)
    return q.to(torch.float8_e4m3fn), scale


def swiglu_clamp_ref(gate_up: torch.Tensor, limit: float) -> torch.Tensor:
    """float32 clamped SwiGLU of DeepSeek-V4's experts: gate_up ``[rows, 2I]`` (gate | up) ->
    ``silu(min(gate, limit)) * clamp(up, -limit, limit)`` ``[rows, I]``. NaN propagates."""
    i = gate_up.shape[-1] // 2
    g = gate_up[..., :i].float()
    u = gate_up[..., i:].float()
    g = torch.minimum(g, torch.tensor(limit))
    u = torch.clamp(u, -limit, limit)
    return g / (1.0 + torch.exp(-g)) * u


def swiglu_clamp_quant_fp8_ref(
    gate_up: torch.Tensor, limit: float, scale_ue8m0: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of ``swiglu_clamp_quant_fp8``: ``per_token_group_quant_fp8_ref(swiglu_clamp_ref(gate_up), 128)``
    (the activation is not rounded before quantisation). Returns (q ``[rows, I]`` e4m3, scale fp32 row-major)."""
    return per_token_group_quant_fp8_ref(swiglu_clamp_ref(gate_up, limit), GEMM_SCALE_BLOCK, scale_ue8m0)


def fused_moe_fp8_ref(
    x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
    w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor,
    limit: float = 10.0, scale_ue8m0: bool = False,
) -> torch.Tensor:
    """Reference of ``deepinfer_ops.moe.fused_moe_fp8`` (float32, token by token, the same quantisation points:
    x quantised per 1x128, gate/up output rounded to bf16, activation re-quantised per 1x128, down output
    rounded to bf16, weighted sum over the top-k slots in slot order in float32). Returns ``[T, hidden]`` fp32."""
    xq, xs = per_token_group_quant_fp8_ref(x, GEMM_SCALE_BLOCK, scale_ue8m0)
    xd = dequant_per_token_group_fp8_ref(xq, xs)
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32)
    for t in range(x.shape[0]):
        for j in range(topk_idx.shape[1]):
            e = int(topk_idx[t, j])
            if e < 0:
                continue
            h = (xd[t : t + 1] @ dequant_block_fp8_ref(w13[e], w13_scale[e]).t()).to(torch.bfloat16)
            hq, hs = swiglu_clamp_quant_fp8_ref(h, limit, scale_ue8m0)
            y = (dequant_per_token_group_fp8_ref(hq, hs) @ dequant_block_fp8_ref(w2[e], w2_scale[e]).t())
            out[t] += topk_weights[t, j].float() * y[0].to(torch.bfloat16).float()
    return out

"""Pure-torch float32 references, one per op, documented like the kernels they check.

Each reference computes in float32 (or exactly, for integer/bit-level recipes) and returns new tensors; it
is slow and simple on purpose. Kernels are tested against these on random inputs and edge cases.
"""

from __future__ import annotations

import torch

from .. import formats
from ..formats import FP8_E4M3_MAX, E2M1_VALUES  # noqa: F401  (re-exported)

QUANT_AMAX_EPS = 1e-10


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x^2, -1) + eps) * weight`` in float32, rounded once to x's dtype. x ``[..., hidden]``."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    return y.to(x.dtype)


def hc_mix_ref(x: torch.Tensor, fn: torch.Tensor, eps: float) -> torch.Tensor:
    """``rms_norm(x) @ fn.T`` in float32 (unweighted norm over the last dim): ``[tokens, K]`` -> ``[tokens, M]``."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)) @ fn.float().T


def logsumexp_rows_ref(x: torch.Tensor) -> torch.Tensor:
    """``torch.logsumexp`` of each row of ``x [rows, V]`` in float64, returned as float32 (``V == 0``: -inf)."""
    return torch.logsumexp(x.double(), dim=-1).float()


def compressor_pool_ref(kv: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """``sum_s kv[:, s] * softmax_s(gate)`` in float32 over dim 1, rounded once to ``kv``'s dtype; NaN where a window
    has no slots (``S == 0``: an empty softmax, as the op's 0 / 0; a plain sum over no slots would give 0)."""
    if kv.shape[1] == 0:
        return torch.full((kv.shape[0], kv.shape[2]), float("nan"), dtype=kv.dtype, device=kv.device)
    return (kv.float() * torch.softmax(gate.float(), dim=1)).sum(dim=1).to(kv.dtype)


def _all_rows(ring: torch.Tensor, new: torch.Tensor, ring_src: torch.Tensor) -> torch.Tensor:
    return torch.cat([ring[ring_src], new])


def compressor_pool_rows_ref(ring_kv, ring_gate, new_kv, new_gate, ape, ring_src, cur, prev, prev_ok, dst):
    """:func:`compressor_pool_ref` on the gathered slots (float32), rounded once; rows with ``dst < 0`` are 0."""
    all_kv = _all_rows(ring_kv.float(), new_kv.float(), ring_src)
    all_gate = _all_rows(ring_gate.float(), new_gate.float(), ring_src)
    ape = ape.float()
    kv, gate = all_kv[cur], all_gate[cur] + ape
    if prev is not None:
        hd = ring_kv.shape[-1] // 2
        ok = (prev_ok != 0).view(-1, 1, 1)
        kv = torch.cat([torch.where(ok, all_kv[prev][..., :hd], 0), kv[..., hd:]], dim=1)
        gate = torch.cat([torch.where(ok, (all_gate[prev] + ape)[..., :hd], float("-inf")), gate[..., hd:]], dim=1)
    out = (kv * torch.softmax(gate, dim=1)).sum(dim=1)
    return torch.where((dst >= 0).view(-1, 1), out, 0).to(ring_kv.dtype)


def compressor_state_write_ref(ring_kv, ring_gate, new_kv, new_gate, ring_src, st_src, st_dst):
    """The rings after :func:`deepinfer_ops.compressor_state_write` (new tensors; the inputs are not changed)."""
    out_kv, out_gate = ring_kv.clone(), ring_gate.clone()
    keep = (st_dst >= 0) & (st_dst < ring_kv.shape[0])
    for out, ring, new in ((out_kv, ring_kv, new_kv), (out_gate, ring_gate, new_gate)):
        out[st_dst[keep]] = _all_rows(ring, new, ring_src)[st_src[keep]]
    return out_kv, out_gate


def moe_combine_ref(y: torch.Tensor, slot_rows: torch.Tensor, weights: torch.Tensor,
                    out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``sum_j weights[t, j] * y[slot_rows[t, j]]`` in float32 over the slots whose row is in ``[0, rows)``."""
    valid = (slot_rows >= 0) & (slot_rows < y.shape[0])
    rows = y.float()[slot_rows.clamp(0, max(y.shape[0] - 1, 0))] if y.shape[0] else \
        torch.zeros(*slot_rows.shape, y.shape[-1], device=y.device)
    contrib = torch.where(valid.unsqueeze(-1), weights.float().unsqueeze(-1) * rows, torch.zeros((), device=y.device))
    return contrib.sum(dim=1).to(out_dtype or y.dtype)


def moe_permute_ref(topk_idx: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(m_indices int32, token_of_row int64, slot_rows int64) from a stable sort of the flattened slots by expert,
    ids outside ``[0, num_experts)`` mapped to -1 (sorted first)."""
    flat = topk_idx.reshape(-1).to(torch.int64)
    key = torch.where((flat >= 0) & (flat < num_experts), flat, torch.full_like(flat, -1))
    order = torch.sort(key, stable=True).indices
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel(), device=order.device)
    slot_rows = torch.where(key >= 0, inv, torch.full_like(inv, -1)).view(topk_idx.shape)
    return key[order].to(torch.int32), order // max(topk_idx.shape[-1], 1), slot_rows


def hc_weights_ref(mix: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc: int, eps: float,
                   sinkhorn_iters: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pre, post, comb) as the V4 reference computes them from the mixing coefficients, in float32 torch ops."""
    mix, base, scale = mix.float(), base.float(), scale.float()
    t = mix.shape[0]
    pre = torch.sigmoid(mix[:, :hc] * scale[0] + base[:hc]) + eps
    post = 2 * torch.sigmoid(mix[:, hc:2 * hc] * scale[1] + base[hc:2 * hc])
    comb = torch.softmax(mix[:, 2 * hc:].view(t, hc, hc) * scale[2] + base[2 * hc:].view(hc, hc), dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return pre, post, comb


def hc_collapse_ref(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """``sum_i pre[:, i] * streams[:, i]`` in float32, rounded once to the streams' dtype."""
    return (pre.float().unsqueeze(-1) * streams.float()).sum(dim=1).to(streams.dtype)


def hc_post_ref(streams: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """``post[:, j] * x + sum_i comb[:, i, j] * streams[:, i]`` in float32, rounded once to the streams' dtype."""
    mixed = torch.einsum("tij,tid->tjd", comb.float(), streams.float())
    return (post.float().unsqueeze(-1) * x.float().unsqueeze(1) + mixed).to(streams.dtype)


#: Smallest power of two >= s (UE8M0 scales), exactly: ``formats.round_up_pow2``.
round_up_pow2_ref = formats.round_up_pow2


def per_token_group_quant_fp8_ref(
    x: torch.Tensor, group_size: int = 128, scale_ue8m0: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of ``per_token_group_quant_fp8``: returns ``(q [..., K] e4m3, scale [rows, groups] fp32 row-major)``.

    scale = max(amax, 1e-10) / 448 per group (NaN if the group holds NaN), optionally rounded up to a power of
    two; q = e4m3(clamp(x * (1 / scale), -448, 448)), round-to-nearest-even. The last group may be partial.
    """
    # Computed on the CPU whatever x's device: torch's CUDA division by a Python scalar multiplies by the rounded
    # reciprocal ("may lose one bit"), which would make this bit-exact reference device-dependent.
    device = x.device
    k = x.shape[-1]
    x2 = x.reshape(-1, k).float().cpu()
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
    q = (xp * (1.0 / scale).unsqueeze(-1)).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    q = q.view(rows, groups * group_size)[:, :k].to(torch.float8_e4m3fn)
    return q.view(x.shape).to(device), scale.to(device)


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
FP4_SCALE_GROUP = formats.FP4_GROUP


def dequant_block_fp8_ref(q: torch.Tensor, scale: torch.Tensor, block: int = GEMM_SCALE_BLOCK) -> torch.Tensor:
    """float32 ``q * scale`` with one scale per ``block x block`` tile (``formats.dequant_fp8_block``). q ``[..., N, K]``
    e4m3, scale ``[..., ceil(N/block), ceil(K/block)]`` fp32 or UE8M0 (partial last tiles use their own scale)."""
    return formats.dequant_fp8_block(q, scale, block)


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


#: UE8M0 scale bytes (uint8 or float8_e8m0fnu) as int32 biased exponents: ``formats.ue8m0_to_exponent``.
e8m0_to_exponent_ref = formats.ue8m0_to_exponent


def dequant_fp4_ref(w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """float32 values of an FP4 e2m1 weight (``formats.dequant_fp4``): w ``[..., N, K/2]`` int8/uint8 with element 2i
    in the low nibble and 2i+1 in the high nibble; w_scale ``[..., N, ceil(K/32)]`` UE8M0, one per 32 elements along
    K (byte 255 gives NaN). Returns ``[..., N, K]``."""
    return formats.dequant_fp4(w, w_scale)


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
    v = formats.unpack_fp4(w)
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
# ---- attention -------------------------------------------------------------------------------------------------


def _gather_kv_list_ref(
    cache: torch.Tensor, indices: torch.Tensor, topk_length: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather one index list: returns ``(kv [b, s_q, topk, d] fp32 (zeros where invalid), valid [b, s_q, topk])``.

    Entry j of row (b, s) is valid iff ``j < topk_length[b]`` (when given) and ``0 <= idx < num_blocks * block_size``;
    ``idx`` addresses ``cache[idx // block_size, idx % block_size]``.
    """
    if cache.dtype == torch.uint8:  # a MODEL1 FP8 cache: decode (exactly) to bf16 first
        cache = fp8_entry_decode_ref(fp8_cache_entries(cache))
    num_blocks, block_size, _ = cache.shape
    idx = indices.long()
    valid = (idx >= 0) & (idx < num_blocks * block_size)
    if topk_length is not None:
        pos = torch.arange(idx.shape[-1], device=idx.device)
        valid &= pos.view(1, 1, -1) < topk_length.long().view(-1, 1, 1)
    slot = torch.where(valid, idx, torch.zeros_like(idx))
    if num_blocks * block_size == 0:
        kv = torch.zeros(*idx.shape, cache.shape[-1], dtype=torch.float32, device=cache.device)
    else:
        kv = cache[slot // block_size, slot % block_size].float()
    kv = torch.where(valid.unsqueeze(-1), kv, torch.zeros_like(kv))
    return kv, valid


def sparse_mqa_decode_ref(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    softmax_scale: float,
    topk_length: torch.Tensor | None = None,
    extra_kv_cache: torch.Tensor | None = None,
    extra_indices: torch.Tensor | None = None,
    extra_topk_length: torch.Tensor | None = None,
    attn_sink: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of ``sparse_mqa_decode`` in fp32: returns ``(out [b, s_q, h, d] q.dtype, lse [b, s_q, h] fp32)``.

    ``s_j = softmax_scale * q . k_j`` over the valid entries of both lists (K = V = the gathered cache row);
    ``lse = logsumexp_j s_j`` (-inf when no entry is valid; the sink is not included);
    ``out = sum_j exp(s_j) k_j / (sum_j exp(s_j) + exp(attn_sink[h]))`` (no sink term without attn_sink);
    ``out = 0`` when no entry is valid, with or without a sink; every score -inf counts as no valid entry; a +inf or
    NaN score gives NaN ``out`` and ``lse``.
    """
    kv, valid = _gather_kv_list_ref(kv_cache, indices, topk_length)
    if extra_kv_cache is not None:
        kv2, valid2 = _gather_kv_list_ref(extra_kv_cache, extra_indices, extra_topk_length)
        kv, valid = torch.cat([kv, kv2], dim=2), torch.cat([valid, valid2], dim=2)
    scores = torch.einsum("bshd,bskd->bshk", q.float(), kv) * softmax_scale
    scores = scores.masked_fill(~valid.unsqueeze(2), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    lse = torch.where(torch.isposinf(lse), torch.full_like(lse, float("nan")), lse)  # +inf score: NaN, as the kernels
    total = lse if attn_sink is None else torch.logaddexp(lse, attn_sink.float().view(1, 1, -1))
    p = torch.exp(scores - total.unsqueeze(-1))
    # no valid score: out 0 whatever the sink (a NaN sink included: logaddexp(-inf, nan) is NaN)
    p = torch.where(torch.isneginf(lse).unsqueeze(-1), torch.zeros_like(p), p)
    out = torch.einsum("bshk,bskd->bshd", p, kv)
    return out.to(q.dtype), lse


def sparse_mqa_prefill_ref(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    softmax_scale: float,
    topk_length: torch.Tensor | None = None,
    extra_kv_cache: torch.Tensor | None = None,
    extra_indices: torch.Tensor | None = None,
    extra_topk_length: torch.Tensor | None = None,
    attn_sink: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of ``sparse_mqa_prefill``: q ``[t, h, d]``, indices ``[t, topk]``, topk_length ``[t]``; returns
    ``(out [t, h, d], lse [t, h])``. Each query token is one decode row with s_q = 1."""
    out, lse = sparse_mqa_decode_ref(
        q.unsqueeze(1), kv_cache, indices.unsqueeze(1), softmax_scale, topk_length, extra_kv_cache,
        None if extra_indices is None else extra_indices.unsqueeze(1), extra_topk_length, attn_sink)
    return out.squeeze(1), lse.squeeze(1)


def mqa_logits_ref(
    q: torch.Tensor,
    weights: torch.Tensor,
    k_cache: torch.Tensor,
    num_candidates: int,
    block_table: torch.Tensor | None = None,
    k_start: torch.Tensor | None = None,
    k_end: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference of ``mqa_logits``: ``logits[t, c] = sum_h weights[t, h] * relu(q[t, h] . k_c)`` in fp32, ``-inf`` for
    candidates outside ``[k_start[t], k_end[t])`` or whose block is invalid. Candidate c is
    ``k_cache[blk, c % block_size]`` with ``blk = c // block_size`` (or ``block_table[t, c // block_size]``; entries
    past the table or outside ``[0, num_blocks)`` are invalid). A uint8 ``k_cache`` holds FP8 keys
    (:func:`indexer_k_cache_decode_ref`)."""
    if k_cache.dtype == torch.uint8:
        k_cache = indexer_k_cache_decode_ref(k_cache)
    t = q.shape[0]
    num_blocks, block_size, _ = k_cache.shape
    c = torch.arange(num_candidates, device=q.device)
    blk = (c // block_size).view(1, -1).expand(t, -1)
    if block_table is not None:
        max_blocks = block_table.shape[1]
        missing = torch.full_like(blk, -1)
        looked_up = block_table.long().gather(1, blk.clamp(max=max_blocks - 1)) if max_blocks > 0 else missing
        blk = torch.where(blk < max_blocks, looked_up, missing)
    valid = (blk >= 0) & (blk < num_blocks)
    if k_start is not None:
        valid &= c.view(1, -1) >= k_start.long().view(-1, 1)
    if k_end is not None:
        valid &= c.view(1, -1) < k_end.long().view(-1, 1)
    if num_blocks == 0:
        return torch.full((t, num_candidates), float("-inf"), device=q.device)
    k = k_cache[blk.clamp(0, num_blocks - 1), (c % block_size).view(1, -1).expand(t, -1)].float()  # [t, n, d]
    s = torch.einsum("thd,tnd->thn", q.float(), k).clamp_min(0)
    logits = (s * weights.float().unsqueeze(-1)).sum(dim=1)
    return logits.masked_fill(~valid, float("-inf"))


def topk_ref(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference top-k with the project's tie rule (higher score first, then lower index; NaN above every number,
    -0.0 == +0.0): a stable descending sort of each row. Returns ``(values [..., k], indices [..., k] int64)``."""
    values, indices = torch.sort(scores, dim=-1, descending=True, stable=True)
    return values[..., :k], indices[..., :k]


def kv_cache_write_ref(kv_cache: torch.Tensor, kv: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    """Reference of ``kv_cache_write`` (returns a new cache): row i of kv goes to
    ``cache[s // block_size, s % block_size]`` with ``s = slot_mapping[i]``; slots outside ``[0, num_slots)`` are
    skipped. Two rows naming one slot is not supported (the kernels do not order such writes)."""
    out = kv_cache.clone()
    num_blocks, block_size, _ = kv_cache.shape
    for i, s in enumerate(slot_mapping.tolist()):
        if 0 <= s < num_blocks * block_size:
            out[s // block_size, s % block_size] = kv[i]
    return out


FP8_ENTRY_BYTES, FP8_ROW_BYTES, FP8_NOPE_DIMS, FP8_ROPE_DIMS, FP8_TILE_DIMS = 584, 576, 448, 64, 64
FP8_NUM_TILES, FP8_SCALE_FLOOR = 7, 1e-4


def fp8_entry_encode_ref(kv: torch.Tensor) -> torch.Tensor:
    """Encode bf16 rows ``[t, 512]`` as FlashMLA "MODEL1" FP8 entries ``[t, 584]`` uint8, token by token:
    ``[0, 448)`` e4m3 codes of the no-RoPE dims, ``[448, 576)`` the 64 RoPE dims as raw bf16 bytes, ``[576, 583)``
    the 7 scale exponent bytes, ``[583]`` zero. A cache stores them in FlashMLA's block layout
    (:func:`fp8_cache_from_entries`). Per tile of 64 dims, FlashMLA's recipe: ``scale = 2 ** ceil(log2(max(amax /
    448, 1e-4)))``, byte ``log2(scale) + 127``, codes ``e4m3(x / scale)`` (round to nearest even, saturated). A
    tile holding NaN gets the byte 0xFF and codes 0x7F (e4m3 NaN, whatever the sign); one holding +-inf the byte
    0xFF and codes ``e4m3(x / inf)``: +-0 for finite x, 0x7F for +-inf."""
    t = kv.shape[0]
    x = kv[:, :FP8_NOPE_DIMS].float().reshape(t, FP8_NUM_TILES, FP8_TILE_DIMS)
    s = torch.clamp_min(x.abs().amax(dim=-1) / 448.0, FP8_SCALE_FLOOR)  # NaN stays NaN
    bits = s.view(torch.int32)
    exp = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).int()
    exp = torch.where(torch.isfinite(s), exp, torch.full_like(exp, 0xFF))
    scale = torch.where(torch.isfinite(s), (exp << 23).view(torch.float32), s)  # inf / NaN kept for the codes
    y = x / scale.unsqueeze(-1)
    codes = y.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)
    codes = torch.where(torch.isnan(y), torch.full_like(codes, 0x7F), codes)
    out = torch.zeros(t, FP8_ENTRY_BYTES, dtype=torch.uint8, device=kv.device)
    out[:, :FP8_NOPE_DIMS] = codes.view(t, FP8_NOPE_DIMS)
    out[:, FP8_NOPE_DIMS:FP8_ROW_BYTES] = kv[:, FP8_NOPE_DIMS:].contiguous().view(torch.uint8)
    out[:, FP8_ROW_BYTES:FP8_ROW_BYTES + FP8_NUM_TILES] = exp.to(torch.uint8)
    return out


def fp8_entry_decode_ref(entries: torch.Tensor) -> torch.Tensor:
    """Decode MODEL1 FP8 entries ``[..., 584]`` uint8 (token by token, as :func:`fp8_entry_encode_ref` gives them)
    to bf16 ``[..., 512]`` (exact: e4m3 x 2^k fits bf16; the byte 0xFF decodes to NaN)."""
    lead = entries.shape[:-1]
    e = entries.reshape(-1, FP8_ENTRY_BYTES)
    codes = e[:, :FP8_NOPE_DIMS].contiguous().view(torch.float8_e4m3fn).float()
    exp = e[:, FP8_ROW_BYTES:FP8_ROW_BYTES + FP8_NUM_TILES].int()
    scale = torch.where(exp == 0xFF, torch.full_like(exp, 0x7FC00000), exp << 23).view(torch.float32)
    nope = codes * scale.repeat_interleave(FP8_TILE_DIMS, dim=-1)
    rope = e[:, FP8_NOPE_DIMS:FP8_ROW_BYTES].contiguous().view(torch.bfloat16).float()
    return torch.cat([nope, rope], dim=-1).to(torch.bfloat16).view(*lead, FP8_NOPE_DIMS + FP8_ROPE_DIMS)


def fp8_cache_from_entries(entries: torch.Tensor) -> torch.Tensor:
    """Token-by-token MODEL1 entries ``[num_blocks, block_size, 584]`` -> the cache in FlashMLA's block layout (a new
    dense ``[num_blocks, block_size, 584]`` uint8 tensor): per block, the tokens' 576-byte rows, then their 8-byte
    scales (7 exponents and the pad byte)."""
    nb, bs, _ = entries.shape
    rows = entries[:, :, :FP8_ROW_BYTES].reshape(nb, bs * FP8_ROW_BYTES)
    scales = entries[:, :, FP8_ROW_BYTES:].reshape(nb, bs * (FP8_ENTRY_BYTES - FP8_ROW_BYTES))
    return torch.cat([rows, scales], dim=1).view(nb, bs, FP8_ENTRY_BYTES)


def fp8_cache_entries(cache: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`fp8_cache_from_entries`: a MODEL1 cache (any block stride) as token-by-token entries
    ``[num_blocks, block_size, 584]``."""
    nb, bs, _ = cache.shape
    if nb * bs == 0:
        return cache.new_zeros(cache.shape)
    flat = cache.as_strided((nb, bs * FP8_ENTRY_BYTES), (cache.stride(0), 1))
    rows = flat[:, :bs * FP8_ROW_BYTES].reshape(nb, bs, FP8_ROW_BYTES)
    scales = flat[:, bs * FP8_ROW_BYTES:].reshape(nb, bs, FP8_ENTRY_BYTES - FP8_ROW_BYTES)
    return torch.cat([rows, scales], dim=2)


def kv_cache_write_fp8_ref(kv_cache: torch.Tensor, kv: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    """Reference of ``kv_cache_write_fp8`` (returns a new dense uint8 cache ``[num_blocks, block_size, 584]`` in
    FlashMLA's block layout)."""
    return fp8_cache_from_entries(kv_cache_write_ref(fp8_cache_entries(kv_cache), fp8_entry_encode_ref(kv),
                                                     slot_mapping))


def kv_cache_dequant_fp8_ref(kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    """Reference of ``kv_cache_dequant_fp8``: bf16 ``[t, 512]``, zero rows for slots outside the cache."""
    num_blocks, block_size, _ = kv_cache.shape
    s = slot_mapping.long()
    valid = (s >= 0) & (s < num_blocks * block_size)
    s = torch.where(valid, s, torch.zeros_like(s))
    if num_blocks * block_size == 0:
        return torch.zeros(s.shape[0], FP8_NOPE_DIMS + FP8_ROPE_DIMS, dtype=torch.bfloat16, device=kv_cache.device)
    rows = fp8_entry_decode_ref(fp8_cache_entries(kv_cache)[s // block_size, s % block_size])
    return torch.where(valid.unsqueeze(-1), rows, torch.zeros_like(rows))


def indexer_k_encode_ref(k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 indexer keys: bf16 ``[t, d]`` -> (e4m3 codes ``[t, d]`` uint8, fp32 scales ``[t]``): one group of d dims per
    key, ``scale = 2 ** ceil(log2(max(amax, 1e-10) / 448))`` (``per_token_group_quant_fp8_ref`` with UE8M0 scales;
    NaN or inf in the key gives a NaN scale)."""
    q, scale = per_token_group_quant_fp8_ref(k, k.shape[1], scale_ue8m0=True)
    q, scale = q.view(torch.uint8), scale.reshape(-1)
    bad = ~torch.isfinite(scale)  # the kernels store a NaN scale (E8M0 0xFF) and NaN codes (x / NaN)
    q = torch.where(bad.unsqueeze(-1), torch.full_like(q, 0x7F), q)
    return q, torch.where(bad, torch.full_like(scale, float("nan")), scale)


def indexer_k_cache_write_fp8_ref(k_cache: torch.Tensor, k: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    """Reference of ``indexer_k_cache_write_fp8`` (returns a new uint8 cache ``[num_blocks, block_size, d + 4]``): key
    ``slot_mapping[i]`` = (block b, j) gets its codes at bytes ``[j d, (j + 1) d)`` of block b and its fp32 scale at
    ``block_size * d + 4 j``; slots outside the cache are skipped."""
    out = k_cache.clone()
    num_blocks, block_size, width = k_cache.shape
    d = width - 4
    codes, scale = indexer_k_encode_ref(k)
    flat = out.view(num_blocks, block_size * width)
    for i, s in enumerate(slot_mapping.tolist()):
        if 0 <= s < num_blocks * block_size:
            b, j = divmod(s, block_size)
            flat[b, j * d:(j + 1) * d] = codes[i]
            flat[b, block_size * d + 4 * j:block_size * d + 4 * j + 4] = scale[i:i + 1].view(torch.uint8)
    return out


def indexer_k_cache_decode_ref(k_cache: torch.Tensor) -> torch.Tensor:
    """Every key of an FP8 indexer-key cache ``[num_blocks, block_size, d + 4]`` uint8 decoded to bf16
    ``[num_blocks, block_size, d]``: ``bf16(float(e4m3) * scale)`` (exact)."""
    num_blocks, block_size, width = k_cache.shape
    d = width - 4
    flat = k_cache.reshape(num_blocks, block_size * width)
    codes = flat[:, :block_size * d].reshape(num_blocks, block_size, d).contiguous().view(torch.float8_e4m3fn)
    scale = flat[:, block_size * d:].contiguous().view(torch.float32).view(num_blocks, block_size, 1)
    return (codes.float() * scale).to(torch.bfloat16)


def indexer_k_cache_dequant_fp8_ref(k_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    """Reference of ``indexer_k_cache_dequant_fp8``: bf16 ``[t, d]``, zero rows for slots outside the cache."""
    num_blocks, block_size, width = k_cache.shape
    s = slot_mapping.long()
    valid = (s >= 0) & (s < num_blocks * block_size)
    if num_blocks * block_size == 0:
        return torch.zeros(s.shape[0], width - 4, dtype=torch.bfloat16, device=k_cache.device)
    s = torch.where(valid, s, torch.zeros_like(s))
    rows = indexer_k_cache_decode_ref(k_cache)[s // block_size, s % block_size]
    return torch.where(valid.unsqueeze(-1), rows, torch.zeros_like(rows))

"""DeepSeek-V4.1 building blocks in the reference's numerics (``docs/deepseek_v41.md``).

Activations are bf16 between ops; the mHC mixes, routing, pooling and softmax statistics are float32.
Every function takes one sequence's rows (``[S, ...]``, no batch dimension) unless it says otherwise.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .quant import DequantWeight, QWeight, dq_linear, qlinear

BF16 = torch.bfloat16
ATTN_BLOCK = 64  # keys per online-softmax block in sparse attention


def exact_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``F.linear`` of ``x [M, K]`` and ``w [N, K]`` as float32 whose rows do not depend on M or on the CPU.

    On the CPU the product runs in float64 and is rounded to float32 once: BLAS kernels sum a float32 or bf16
    product in an order that depends on the row count and the CPU (MKL on AMX machines differs at every M, oneDNN's
    bf16 path too), while a float64 sum of these short dot products rounds to the same float32 in any order.
    Elsewhere a float32 ``F.linear``. Source: ``docs/deepseek_v41.md``, "Parity"."""
    if x.device.type == "cpu":
        return F.linear(x.double(), w.double()).float()
    return F.linear(x.float(), w.float())


def linear(x: torch.Tensor, w) -> torch.Tensor:
    """A quantised weight through :func:`qlinear` (CPU) or :func:`dq_linear` (GPU), bf16 out; a plain one through
    ``F.linear`` in x's dtype (:func:`exact_linear` rounded to it on the CPU)."""
    if isinstance(w, QWeight):
        return qlinear(x, w)
    if isinstance(w, DequantWeight):
        return dq_linear(x, w)
    if x.device.type == "cpu":
        return exact_linear(x, w).to(x.dtype)
    return F.linear(x, w)


def linear_f32(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Float32 ``F.linear`` of ``x [M, K]`` and ``w [N, K]`` whose rows do not depend on M (:func:`exact_linear`)."""
    return exact_linear(x, w)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Weighted RMSNorm over the last dim in float32, returned in x's dtype."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    return (w * y).to(x.dtype)


def topk_stable(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k along the last dim, higher first and, among equal scores, lower index first (the golden ``stable``
    tie rule). Returns (values, indices)."""
    v, i = torch.sort(scores, dim=-1, descending=True, stable=True)
    return v[..., :k], i[..., :k]


# ---- rotary ---------------------------------------------------------------------------------------------------
def rope_table(rd: int, seqlen: int, original_seq_len: int, base: float, factor: float, beta_fast: float,
               beta_slow: float) -> torch.Tensor:
    """complex64 ``[seqlen, rd/2]`` rotations; YaRN-corrected when ``original_seq_len > 0`` (frequencies whose
    wavelength exceeds the training context are divided by ``factor``, a linear ramp between ``beta_fast`` and
    ``beta_slow`` rotations)."""
    freqs = 1.0 / (base ** (torch.arange(0, rd, 2, dtype=torch.float32) / rd))
    if original_seq_len > 0:
        def dim_of(rot: float) -> float:
            return rd * math.log(original_seq_len / (rot * 2 * math.pi)) / (2 * math.log(base))

        lo = max(math.floor(dim_of(beta_fast)), 0)
        hi = min(math.ceil(dim_of(beta_slow)), rd - 1)
        keep = 1 - ((torch.arange(rd // 2, dtype=torch.float32) - lo) / max(hi - lo, 1e-3)).clamp(0, 1)
        freqs = freqs / factor * (1 - keep) + freqs * keep
    ang = torch.outer(torch.arange(seqlen), freqs)
    return torch.polar(torch.ones_like(ang), ang)


def rope_(x: torch.Tensor, rot: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate adjacent pairs of ``x [S, ..., rd]`` (a view into a bf16 tensor, written in place) by ``rot [S, rd/2]``
    (conjugated when ``inverse``)."""
    c = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))
    if inverse:
        rot = rot.conj()
    rot = rot.view(rot.shape[0], *([1] * (c.dim() - 2)), rot.shape[-1])
    x.copy_(torch.view_as_real(c * rot).flatten(-2))
    return x


# ---- hyper-connections (mHC) ------------------------------------------------------------------------------------
def hc_mixes(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc: int, iters: int,
             norm_eps: float, hc_eps: float):
    """Coefficients from the streams ``x [S, hc, D]``: (pre [S, hc], post [S, hc], comb [S, hc, hc]), float32.

    ``mixes = (flat(x) @ fn^T) * rsqrt(mean(flat(x)^2) + norm_eps)``; ``pre = sigmoid(.) + hc_eps``,
    ``post = 2 sigmoid(.)``, ``comb`` = row softmax + hc_eps, then column / row normalisation (``iters`` passes in
    all, each dividing by the sum + hc_eps), column first.
    """
    xf = x.flatten(-2).float()
    m = linear_f32(xf, fn) * torch.rsqrt(xf.square().mean(-1, keepdim=True) + norm_eps)
    pre = torch.sigmoid(m[..., :hc] * scale[0] + base[:hc]) + hc_eps
    post = 2 * torch.sigmoid(m[..., hc:2 * hc] * scale[1] + base[hc:2 * hc])
    comb = (m[..., 2 * hc:] * scale[2] + base[2 * hc:]).unflatten(-1, (hc, hc))
    comb = torch.exp(comb - comb.amax(-1, keepdim=True))
    comb = comb / comb.sum(-1, keepdim=True) + hc_eps
    comb = comb / (comb.sum(-2, keepdim=True) + hc_eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(-2, keepdim=True) + hc_eps)
    return pre, post, comb


def hc_collapse(x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """``sum_i pre_i x_i`` in float32: ``[S, hc, D] x [S, hc] -> [S, D]`` in x's dtype."""
    return torch.sum(pre.unsqueeze(-1) * x.float(), dim=-2).to(x.dtype)


def hc_expand(out: torch.Tensor, res: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """New streams ``j = post_j out + sum_i comb_ij res_i`` (float32, returned in out's dtype)."""
    y = post.unsqueeze(-1) * out.unsqueeze(-2) + torch.sum(comb.unsqueeze(-1) * res.unsqueeze(-2), dim=-3)
    return y.to(out.dtype)


# ---- attention ------------------------------------------------------------------------------------------------
def sparse_attention(q: torch.Tensor, kv: torch.Tensor, valid: torch.Tensor, sink: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """One shared K=V head over gathered keys with a per-head sink logit.

    ``q [S, H, D]`` bf16, ``kv [S, N, D]`` bf16 (each query's own keys, invalid rows zero), ``valid [S, N]`` bool,
    ``sink [H]`` float32. Online softmax over blocks of :data:`ATTN_BLOCK` keys in float32; the probabilities are
    rounded to bf16 before the value product (the reference kernel). A query with no valid key returns zeros.
    Returns bf16 ``[S, H, D]``.
    """
    s_, h, d = q.shape
    qf, kf = q.float().unsqueeze(0), kv.float().unsqueeze(0)
    vm = valid.unsqueeze(0)
    sc = torch.tensor(scale, dtype=torch.float32)
    acc = torch.zeros(1, s_, h, d)
    tot = torch.zeros(1, s_, h)
    mx = torch.full((1, s_, h), -1e30)
    for t in range(0, kv.shape[1], ATTN_BLOCK):
        kb, vb = kf[:, :, t:t + ATTN_BLOCK], vm[:, :, t:t + ATTN_BLOCK]
        sco = torch.where(vb.unsqueeze(2), torch.einsum("bmhd,bmkd->bmhk", qf, kb), -torch.inf) * sc
        prev = mx
        mx = torch.maximum(prev, sco.amax(-1))
        corr = torch.exp(prev - mx)
        p = torch.exp(sco - mx.unsqueeze(-1))
        tot = tot * corr + p.sum(-1)
        acc = acc * corr.unsqueeze(-1) + torch.einsum("bmhk,bmkd->bmhd", p.to(BF16).float(), kb)
    tot = tot + torch.exp(sink.float() - mx)
    return (acc / tot.unsqueeze(-1)).to(BF16)[0]


def gather_rows(cache: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``cache[idx]`` for ``idx [S, N]`` (-1 = none, gathered as zeros); returns (rows [S, N, D], valid)."""
    valid = idx >= 0
    rows = cache[idx.clamp_min(0)] * valid.unsqueeze(-1)
    return rows, valid


def window_positions(start: int, end: int, win: int) -> torch.Tensor:
    """int64 ``[end - start, W]``: the raw positions each query attends to in its sliding window, -1 = none.

    A chunk at position 0 (prefill) lists positions ``max(0, t - win + 1) ..`` left-aligned with -1 after
    (``W = min(end, win)``); a later chunk lists the ``win`` window slots oldest first, -1 before the first token
    (``W = win``), as the reference's decode ring does.
    """
    t = torch.arange(start, end).unsqueeze(1)
    if start == 0:
        idx = (t - win + 1).clamp_min(0) + torch.arange(min(end, win))
        return torch.where(idx > t, -1, idx)
    idx = t - win + 1 + torch.arange(win)
    return torch.where(idx < 0, -1, idx)


def select_candidate_blocks(scores: torch.Tensor, lens: torch.Tensor, topk_blocks: int, block: int) -> torch.Tensor:
    """Level one of the two-level selection: bool ``[S, T]`` mask of the positions in each query's best
    ``topk_blocks`` blocks of ``block`` compressed positions (block score = its best position's score; the block
    holding the query's newest reachable position always kept; unreachable blocks (-inf) dropped).
    ``scores [S, T]`` with unreachable positions at -inf, ``lens [S, 1]`` reachable counts."""
    width = scores.shape[-1]
    bs = F.pad(scores, (0, -width % block), value=-torch.inf).unflatten(-1, (-1, block)).amax(-1)
    nb = bs.shape[-1]
    last = torch.div(lens - 1, block, rounding_mode="floor")
    bs = bs.masked_fill(torch.arange(nb) == last, torch.inf)
    val, ind = topk_stable(bs, min(topk_blocks, nb))
    keep = torch.zeros_like(bs, dtype=torch.bool).scatter_(-1, ind, val > -torch.inf)
    return keep.repeat_interleave(block, dim=-1)[..., :width]


# ---- MoE ------------------------------------------------------------------------------------------------------
def route(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor, k: int, score_func: str, temp: float,
          norm_topk: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Router: float32 scores of ``x [T, D]`` divided by ``temp``; experts chosen by top-k of score + bias (stable
    rule), weighted by the unbiased scores, renormalised (sum + 1e-20) and scaled. Returns (weights [T, k] float32,
    ids [T, k] int64)."""
    s = linear_f32(x.float(), w.float()) / temp
    if score_func == "softmax":
        s = s.softmax(-1)
    elif score_func == "sigmoid":
        s = s.sigmoid()
    else:
        s = F.softplus(s).sqrt()
    ids = topk_stable(s + bias, k)[1]
    wts = s.gather(1, ids)
    if norm_topk and k > 1:
        wts = wts / (wts.sum(-1, keepdim=True) + 1e-20)
    return wts * scale, ids


def swiglu_expert(x: torch.Tensor, w1, w2, w3, limit: float, weight: torch.Tensor | None = None) -> torch.Tensor:
    """``w2(silu(min(w1 x, L)) * clamp(w3 x, -L, L) [* weight])`` with the product in float32; bf16 out."""
    g = linear(x, w1).float()
    u = linear(x, w3).float()
    if limit > 0:
        u = u.clamp(-limit, limit)
        g = g.clamp(max=limit)
    h = F.silu(g) * u
    if weight is not None:
        h = weight * h
    return linear(h.to(x.dtype), w2)

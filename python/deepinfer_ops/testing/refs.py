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
    two; q = e4m3(clamp(x * (1 / scale), -448, 448)), round-to-nearest-even. The last group may be partial.
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
    q = (xp * (1.0 / scale).unsqueeze(-1)).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
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

"""Rotary position embedding ops (DeepSeek-V4's interleaved partial RoPE)."""

from __future__ import annotations

import torch


def rotary_embedding(
    x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, inverse: bool = False
) -> torch.Tensor:
    """Rotate, in place, the trailing ``rope_dim`` channels of every head of ``x`` by its token's position.

    Channel pairs are interleaved (GPT-J style): pair i is ``(x[..., off + 2i], x[..., off + 2i + 1])`` with
    ``off = head_dim - rope_dim``; ``y0 = x0 cos - x1 sin``, ``y1 = x0 sin + x1 cos`` computed in float32 and
    rounded once. ``inverse=True`` rotates by ``-theta`` (V4 rotates the attention output's rope slice back).
    The leading ``head_dim - rope_dim`` channels are untouched.

    Args:
        x: ``[num_tokens, head_dim]`` or ``[num_tokens, num_heads, head_dim]``, float32/bfloat16/float16, last
            dim contiguous; mutated.
        positions: ``[num_tokens]`` int64 or int32 absolute positions in ``[0, max_position)``; a position outside
            that range writes NaN into that token's rope slice (never silently wrong).
        cos_sin_cache: float32 ``[max_position, rope_dim]``: ``[:, :rope_dim/2]`` cos and ``[:, rope_dim/2:]`` sin
            of each pair's angle (plain or YaRN-scaled frequencies: the cache decides).
        inverse: rotate by the conjugate.
    Returns:
        ``x`` (the same tensor).
    Raises:
        RuntimeError naming the tensor at fault.
    Source: Su et al. 2021 (RoFormer); DeepSeek-V4 reference model (interleaved pairs, rope on the last 64 dims).
    """
    torch.ops.deepinfer_ops.rotary_embedding(x, positions, cos_sin_cache, bool(inverse))
    return x


def rope_cos_sin_cache(inv_freq: torch.Tensor, max_position: int, attention_scaling: float = 1.0) -> torch.Tensor:
    """Build the float32 ``[max_position, rope_dim]`` cache for :func:`rotary_embedding`.

    Args:
        inv_freq: ``[rope_dim / 2]`` inverse frequencies (``theta ** (-2i / rope_dim)``, or YaRN-corrected).
        max_position: number of positions.
        attention_scaling: multiplier on cos and sin (YaRN's mscale; 1.0 for plain RoPE).
    """
    t = torch.arange(max_position, dtype=torch.float32, device=inv_freq.device)
    freqs = torch.outer(t, inv_freq.to(torch.float32))
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).mul_(attention_scaling).contiguous()

"""mHC (manifold-constrained hyper-connection) ops of DeepSeek-V4.

V4 keeps ``hc`` (``hc_mult`` = 4) residual streams per token. Around every sublayer the model mixes them: the
streams' RMS-normalised concatenation is projected to a few mixing coefficients (:func:`hc_mix`), their weighted sum
is the sublayer input (:func:`hc_collapse`, weighted by :func:`hc_weights`' ``pre``), and the sublayer output is written back into every stream together with
a ``hc x hc`` mix of the old streams (:func:`hc_post`). Every op computes each token on its own in a fixed order
(batch-invariant by construction) with float32 arithmetic.

Source: DeepSeek-V4 technical report (mHC) and the reference model (transformers ``DeepseekV4ForCausalLM``:
``hc_pre`` / ``hc_post``).
"""

from __future__ import annotations

import torch


def _size(t: torch.Tensor, dim: int) -> int:
    """``t.shape[dim]``, or 0 for a 0-dim ``t``: the default output is then empty and the op's own check names the
    tensor (instead of an IndexError here)."""
    return t.shape[dim] if t.dim() > 0 else 0


def hc_mix(x: torch.Tensor, fn: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """Mixing coefficients: ``out[t, m] = (x[t] . fn[m]) / sqrt(mean(x[t]^2) + eps)`` -- the RMS norm of a token's
    concatenated streams fused with the projection onto ``fn`` (V4: ``rms_norm(streams.flatten(1)) @ fn.T``).

    Args:
        x: ``[tokens, K]`` float32, bfloat16 or float16 (V4: the streams ``[tokens, hc, hidden]`` viewed as
            ``[tokens, hc * hidden]``); last dim contiguous, any row stride.
        fn: ``[M, K]`` float32, 1 <= M <= 32 (V4: ``2 hc + hc^2`` = 24 for a sublayer, ``hc`` for the head).
        eps: added to the mean square (V4: ``rms_norm_eps``).
        out: optional preallocated ``[tokens, M]`` float32 output.
    Returns:
        ``[tokens, M]`` float32. The products, dot products and the mean square accumulate in float32; the norm is
        applied to the dot product (``dot * rsqrt``), not to the inputs.
    Raises:
        RuntimeError naming the tensor at fault (dtype, shape, M out of range, device, layout).
    """
    if out is None:
        out = torch.empty(_size(x, 0), _size(fn, 0), dtype=torch.float32, device=x.device)
    torch.ops.deepinfer_ops.hc_mix(out, x, fn, float(eps))
    return out


def hc_weights(mix: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc: int, eps: float,
               sinkhorn_iters: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A sublayer's mHC weights from its mixing coefficients (:func:`hc_mix`), one token per thread / loop step:

    * ``pre = sigmoid(mix[:, :hc] * scale[0] + base[:hc]) + eps`` (the :func:`hc_collapse` weights);
    * ``post = 2 sigmoid(mix[:, hc:2hc] * scale[1] + base[hc:2hc])`` (the sublayer output's weight per stream);
    * ``comb``: ``softmax`` over the last dim of ``mix[:, 2hc:] * scale[2] + base[2hc:]`` viewed ``[hc, hc]``,
      ``+ eps``, divided by its column sums ``+ eps``, then ``sinkhorn_iters - 1`` times by its row sums ``+ eps``
      and its column sums ``+ eps`` (Sinkhorn-Knopp towards a doubly stochastic matrix).

    float32 throughout, sums in index order (batch-invariant); CPU and CUDA share one implementation of the
    per-token math. Replaces ~40 small torch ops per Sinkhorn iteration pair.

    Args:
        mix: ``[tokens, 2 hc + hc^2]`` float32 contiguous.
        base: ``[2 hc + hc^2]`` float32; scale: ``[3]`` float32.
        hc: streams per token, 1 to 8 (V4: 4).
        eps: V4's ``hc_eps`` (>= 0); sinkhorn_iters: V4's ``hc_sinkhorn_iters`` (>= 0; 0 and 1 both mean the
            single column normalisation).
    Returns:
        ``(pre [tokens, hc], post [tokens, hc], comb [tokens, hc, hc])`` float32, ``comb[t, i, j]`` = weight of old
        stream ``i`` in new stream ``j`` (as :func:`hc_post` takes it).
    Raises:
        RuntimeError naming the tensor or argument at fault.
    Source: DeepSeek-V4 reference model (``hc_pre``: sigmoid gates and Sinkhorn-normalised ``comb``).
    """
    t = mix.shape[0]
    pre = torch.empty(t, hc, dtype=torch.float32, device=mix.device)
    post = torch.empty(t, hc, dtype=torch.float32, device=mix.device)
    comb = torch.empty(t, hc, hc, dtype=torch.float32, device=mix.device)
    torch.ops.deepinfer_ops.hc_weights(pre, post, comb, mix, base, scale, float(eps), int(sinkhorn_iters))
    return pre, post, comb


def hc_collapse(streams: torch.Tensor, pre: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The sublayer input: ``out[t] = sum_i pre[t, i] * streams[t, i]`` (float32, added in stream order).

    Args:
        streams: ``[tokens, hc, hidden]`` float32, bfloat16 or float16, contiguous; 1 <= hc <= 8.
        pre: ``[tokens, hc]`` float32 contiguous (V4: ``sigmoid(mix * scale + base) + hc_eps``).
        out: optional preallocated ``[tokens, hidden]`` output of the streams' dtype.
    Returns:
        ``[tokens, hidden]`` in the streams' dtype, rounded once.
    Raises:
        RuntimeError naming the tensor at fault.
    """
    if out is None:
        out = torch.empty(_size(streams, 0), _size(streams, -1), dtype=streams.dtype, device=streams.device)
    torch.ops.deepinfer_ops.hc_collapse(out, streams, pre)
    return out


def hc_post(streams: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
            out: torch.Tensor | None = None) -> torch.Tensor:
    """New streams after a sublayer: ``out[t, j] = post[t, j] * x[t] + sum_i comb[t, i, j] * streams[t, i]``
    (float32, the ``post`` term first, then the streams in order; rounded once).

    Args:
        streams: ``[tokens, hc, hidden]`` float32, bfloat16 or float16, contiguous; 1 <= hc <= 8.
        x: ``[tokens, hidden]`` sublayer output, the streams' dtype, contiguous.
        post: ``[tokens, hc]`` float32 contiguous (V4: ``2 sigmoid(...)``).
        comb: ``[tokens, hc, hc]`` float32 contiguous, ``comb[t, i, j]`` = weight of old stream ``i`` in new stream
            ``j`` (V4: the Sinkhorn-normalised mix).
        out: optional preallocated output like ``streams``; may be ``streams`` itself (updated in place).
    Returns:
        ``[tokens, hc, hidden]`` in the streams' dtype.
    Raises:
        RuntimeError naming the tensor at fault.
    """
    if out is None:
        out = torch.empty_like(streams, memory_format=torch.contiguous_format)
    torch.ops.deepinfer_ops.hc_post(out, streams, x, post, comb)
    return out

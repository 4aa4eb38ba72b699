"""Speculative decoding: the draft draws and the acceptance rules (design: ``docs/speculative.md``).

Every random draw is counter-based (:mod:`deepinfer.sampler`): keyed by the request's seed, a stream number and the
output position of the token it decides, so a request draws the same values alone, in any batch and after
preemption. The target distribution is the one the sampler draws from: temperature, then top-k / top-p
(:func:`filtered_probs`); a greedy row's is the one-hot of its argmax.
"""

from __future__ import annotations

import torch

from deepinfer.sampler import (MIN_SAMPLING_TEMPERATURE, gumbel_noise, keep_mask, mix64, uniform_from_hash)

# stream numbers: the sampler's own draws are stream 0 (seeds used as they are)
ACCEPT_STREAM = 1  # the uniform that accepts or rejects a draft
RESIDUAL_STREAM = 2  # the Gumbel noise of a resample from the residual
DRAFT_STREAM = 3  # the drafter's Gumbel noise

_SEED_MASK = (1 << 63) - 1
_STREAM_MUL = 0x2545F4914F6CDD1D  # odd 63-bit constant (Marsaglia's xorshift* multiplier)


def stream_seeds(seeds: torch.Tensor, stream: int) -> torch.Tensor:
    """``[n]`` int64 seeds of ``stream`` (in ``[0, 2**63)``) derived from the requests' ``seeds`` ``[n]`` int64:
    ``mix64(seed + stream * c)`` with its top bit cleared. Different streams give unrelated draws for one key."""
    return mix64(seeds.to(torch.int64) + stream * _STREAM_MUL) & _SEED_MASK


def _resolve_top_k(top_k: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.where((top_k > 0) & (top_k < vocab), top_k, torch.full_like(top_k, vocab))


def filtered_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                   batch_invariant: bool = False) -> torch.Tensor:
    """The distribution the sampler draws each row from.

    Args:
        logits: ``[n, V]`` float (upcast to float32), already penalised / biased / masked as the sampler sees them.
        temperature: ``[n]`` float32 (below ``MIN_SAMPLING_TEMPERATURE``: greedy).
        top_k: ``[n]`` int64 (<= 0 keeps all); top_p: ``[n]`` float32 in (0, 1].
        batch_invariant: one row per call for the sort / cumsum / softmax (a row's values do not depend on the
            others).
    Returns:
        ``[n, V]`` float32: ``softmax(logits / T)`` over the tokens top-k / top-p keep (the sampler's kept set),
        zero elsewhere; a greedy row is the one-hot of ``argmax(logits)`` (ties to the lower id).
    """
    logits = logits.float()
    if batch_invariant and logits.shape[0] > 1:
        return torch.cat([filtered_probs(logits[i:i + 1], temperature[i:i + 1], top_k[i:i + 1], top_p[i:i + 1])
                          for i in range(logits.shape[0])])
    n, vocab = logits.shape
    greedy = temperature < MIN_SAMPLING_TEMPERATURE
    temp = torch.where(greedy, torch.ones_like(temperature), temperature)
    scaled = logits / temp[:, None]
    k = _resolve_top_k(top_k, vocab)
    filtered = (k < vocab) | (top_p < 1.0)
    if bool(filtered.any()):
        keep = torch.ones_like(scaled, dtype=torch.bool)
        rows = filtered.nonzero().squeeze(1)
        keep[rows] = keep_mask(scaled[rows], k[rows], top_p[rows])
        scaled = scaled.masked_fill(~keep, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if bool(greedy.any()):
        one_hot = torch.zeros_like(probs).scatter_(1, torch.argmax(logits, dim=-1, keepdim=True), 1.0)
        probs = torch.where(greedy[:, None], one_hot, probs)
    return probs


def draw_drafts(probs: torch.Tensor, greedy: torch.Tensor, seeds: torch.Tensor,
                counters: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The drafter's tokens and confidences.

    Args:
        probs: ``[n, V]`` float32, the drafter's distribution per row (:func:`filtered_probs` of its logits with
            the request's sampling parameters).
        greedy: ``[n]`` bool, rows that take the drafter's argmax (greedy requests).
        seeds / counters: ``[n]`` int64, the request seed and the output position of the drafted token.
    Returns:
        ``(tokens [n] int64, confidence [n] float32)``: sampled rows draw from ``probs`` (Gumbel-max on stream
        ``DRAFT_STREAM``), greedy rows take the argmax; the confidence is ``probs[token]``.
    """
    score = torch.log(probs)
    if not bool(greedy.all()):
        noise = gumbel_noise(stream_seeds(seeds, DRAFT_STREAM), counters, probs.shape[-1])
        score = torch.where(greedy[:, None], score, score + noise)
    tokens = torch.argmax(score, dim=-1)
    return tokens, probs.gather(1, tokens[:, None]).squeeze(1)


def acceptance_mask(p_draft: torch.Tensor, q_draft: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Speculative sampling's test (Leviathan et al. 2023; Chen et al. 2023): accept a draft with probability
    ``min(1, p / q)``, i.e. when ``u * q < p`` for a uniform ``u`` in (0, 1). All ``[m]`` float32; returns bool."""
    return u * q_draft < p_draft


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Unnormalised distribution a rejected position resamples from: ``max(0, p - q)``, or ``p`` where that is
    zero everywhere (``p == q``: no rejection is then possible, kept finite). ``[m, V]`` float32."""
    r = (p - q).clamp(min=0.0)
    return torch.where(r.sum(-1, keepdim=True) > 0, r, p)


def accept_drafts(base_tokens: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor, sampled: torch.Tensor,
                  target_probs: torch.Tensor | None = None, draft_probs: torch.Tensor | None = None,
                  seeds: torch.Tensor | None = None, counters: torch.Tensor | None = None,
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify each row's drafts against the target.

    Row ``i`` verifies ``num_drafts[i]`` drafts; position ``j`` of a row is the token after the row's first ``j``
    drafts, whose output index is ``counters[i] + j``.

    Args:
        base_tokens: ``[n, k + 1]`` int64, the sampler's own draw at each position (greedy: the argmax).
        drafts: ``[n, k]`` int64 draft tokens (entries at ``j >= num_drafts[i]`` are ignored).
        num_drafts: ``[n]`` int64 in ``[0, k]``.
        sampled: ``[n]`` bool, rows verified by speculative sampling; the others are greedy (accept while the
            draft equals the target's argmax).
        target_probs / draft_probs: ``[m, k, V]`` float32 for the ``m`` sampled rows, in row order: the target's
            (:func:`filtered_probs`) and the drafter's distribution at each draft position.
        seeds / counters: ``[m]`` int64 for the sampled rows: request seed, output index of position 0.
    Returns:
        ``(tokens [n, k + 1] int64, num_emitted [n] int64)``: a row emits its accepted drafts, then one more token:
        at the first rejected position a draw from the normalised residual ``max(0, p - q)`` (Gumbel-max on stream
        ``RESIDUAL_STREAM``), else (every draft accepted, or a greedy row) ``base_tokens`` there. Entries after a
        row's ``num_emitted`` are ``-1``.
    Raises:
        ValueError: inconsistent shapes.
    """
    n, k = drafts.shape
    if base_tokens.shape != (n, k + 1) or num_drafts.shape != (n,) or sampled.shape != (n,):
        raise ValueError(f"accept_drafts: base_tokens must be [{n}, {k + 1}], num_drafts and sampled [{n}]; got "
                         f"{tuple(base_tokens.shape)}, {tuple(num_drafts.shape)}, {tuple(sampled.shape)}")
    dev = drafts.device
    j = torch.arange(k, device=dev)
    ok = drafts == base_tokens[:, :k]
    rows = sampled.nonzero().squeeze(1)
    m = rows.numel()
    if m:
        if target_probs is None or draft_probs is None or seeds is None or counters is None:
            raise ValueError("accept_drafts: sampled rows need target_probs, draft_probs, seeds and counters")
        vocab = target_probs.shape[-1]
        if target_probs.shape != (m, k, vocab) or draft_probs.shape != (m, k, vocab) or seeds.shape != (m,) \
                or counters.shape != (m,):
            raise ValueError(f"accept_drafts: target_probs / draft_probs must be [{m}, {k}, V], seeds / counters "
                             f"[{m}]; got {tuple(target_probs.shape)}, {tuple(draft_probs.shape)}, "
                             f"{tuple(seeds.shape)}, {tuple(counters.shape)}")
        d = drafts[rows]
        if k:
            p_d = target_probs.gather(2, d[:, :, None]).squeeze(2)
            q_d = draft_probs.gather(2, d[:, :, None]).squeeze(2)
            acc_seeds = stream_seeds(seeds, ACCEPT_STREAM).repeat_interleave(k)
            u = uniform_from_hash(acc_seeds, (counters[:, None] + j[None, :]).reshape(-1), 1).view(m, k)
            ok[rows] = acceptance_mask(p_d, q_d, u)
    ok &= j[None, :] < num_drafts[:, None]
    n_acc = torch.cumprod(ok.to(torch.int64), dim=1).sum(1) if k else torch.zeros(n, dtype=torch.int64, device=dev)
    last = base_tokens.gather(1, n_acc[:, None]).squeeze(1)
    if m:
        a = n_acc[rows]
        rejected = a < num_drafts[rows]
        if bool(rejected.any()):
            r = rejected.nonzero().squeeze(1)
            ar = a[r]
            p = target_probs[r, ar]
            q = draft_probs[r, ar]
            noise = gumbel_noise(stream_seeds(seeds[r], RESIDUAL_STREAM), counters[r] + ar, p.shape[-1])
            resampled = torch.argmax(torch.log(residual(p, q)) + noise, dim=-1)
            last[rows[r]] = resampled
    cols = torch.arange(k + 1, device=dev)[None, :]
    padded = torch.cat([drafts, torch.full((n, 1), -1, dtype=drafts.dtype, device=dev)], dim=1)
    tokens = torch.where(cols < n_acc[:, None], padded, torch.full_like(padded, -1))
    tokens = torch.where(cols == n_acc[:, None], last[:, None], tokens)
    return tokens, n_acc + 1

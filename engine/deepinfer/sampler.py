"""Sampling: greedy, temperature, top-k, top-p, with counter-based Gumbel-max draws.

A draw is ``argmax_v(logits[v] / T + g(seed, counter, v))`` over the tokens top-k / top-p keep, where
``g = -log(-log(u))`` and ``u`` is a uniform in (0, 1) made from a SplitMix64-style integer hash of
(seed, counter, token id). ``counter`` is the index of the output token within its request (0 for the first).
Nothing depends on the other rows of the batch or on any generator state, so a request with a fixed seed draws the
same tokens alone, in any batch, after preemption, on any device (Gumbel-max: Gumbel 1958; the hash: Steele et al.,
"Fast splittable pseudorandom number generators", OOPSLA 2014).
"""

from __future__ import annotations

import torch

_MASK64 = (1 << 64) - 1


def _i64(c: int) -> int:
    """Two's-complement int64 value of the 64-bit constant ``c``."""
    c &= _MASK64
    return c - (1 << 64) if c >= 1 << 63 else c


_GOLDEN = _i64(0x9E3779B97F4A7C15)
_TOKEN_MUL = _i64(0xD1B54A32D192ED03)
_M1 = _i64(0xBF58476D1CE4E5B9)
_M2 = _i64(0x94D049BB133111EB)


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bits."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def mix64(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64 finaliser on int64 tensors (wrapping arithmetic), elementwise."""
    x = (x ^ _shr(x, 30)) * _M1
    x = (x ^ _shr(x, 27)) * _M2
    return x ^ _shr(x, 31)


def uniform_from_hash(seeds: torch.Tensor, counters: torch.Tensor, token_ids: torch.Tensor | int) -> torch.Tensor:
    """Counter-based uniforms.

    Args:
        seeds: ``[n]`` int64, each in ``[0, 2**63)``.
        counters: ``[n]`` int64, the draw index within the request (output position).
        token_ids: ``[n, m]`` int64 token ids to draw for, or an int V meaning all ids ``0..V-1`` for every row.

    Returns:
        ``[n, m]`` (or ``[n, V]``) float32 in (0, 1):
        ``(top 23 bits of mix64(mix64(seed + (counter + 1) * golden) + token_id * c) + 0.5) / 2**23``.
        A value depends only on its (seed, counter, token id).
    """
    key = mix64(seeds.to(torch.int64) + (counters.to(torch.int64) + 1) * _GOLDEN)
    if isinstance(token_ids, int):
        token_ids = torch.arange(token_ids, dtype=torch.int64, device=seeds.device)[None, :]
    bits = _shr(mix64(key[:, None] + token_ids.to(torch.int64) * _TOKEN_MUL), 64 - UNIFORM_BITS)
    return bits_to_uniform(bits)


# 23 bits: (bits + 0.5) / 2**23 is exact in float32 and at most 1 - 2**-24 < 1, so log(u) < 0 and the Gumbel noise is
# finite (with 24 bits the top value would round to 1.0 and give +inf).
UNIFORM_BITS = 23


def bits_to_uniform(bits: torch.Tensor) -> torch.Tensor:
    """int64 values in ``[0, 2**23)`` -> float32 ``(bits + 0.5) / 2**23``, strictly inside (0, 1)."""
    return (bits.to(torch.float32) + 0.5) * (1.0 / (1 << UNIFORM_BITS))


def gumbel_noise(seeds: torch.Tensor, counters: torch.Tensor, token_ids: torch.Tensor | int) -> torch.Tensor:
    """Standard Gumbel noise ``-log(-log(u))`` from ``uniform_from_hash`` (same arguments and shape)."""
    u = uniform_from_hash(seeds, counters, token_ids)
    return -torch.log(-torch.log(u))


# Rows whose top-k is at most this (or that use top-p) first look at their NUM_CANDIDATES best tokens only; the full
# sort runs only when the kept set might reach beyond them. The choice depends on the row alone.
NUM_CANDIDATES = 1024


def _rank_sorted(vals: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Order candidates by value descending, then token id ascending (the tie rule)."""
    s_idx, perm = torch.sort(idx, dim=-1)
    s_vals = vals.gather(1, perm)
    out_vals, perm2 = torch.sort(s_vals, dim=-1, descending=True, stable=True)
    return out_vals, s_idx.gather(1, perm2)


def _keep_sorted(sorted_vals: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                 lse: torch.Tensor) -> torch.Tensor:
    """Keep mask over ranked tokens: rank < k, then the shortest prefix whose probability reaches top_p.

    ``lse`` ``[n]`` is the log-sum-exp of the top-k survivors of the whole row (the top-p normaliser).
    """
    m = sorted_vals.shape[-1]
    rank = torch.arange(m, device=sorted_vals.device)[None, :]
    keep = rank < top_k[:, None]
    probs = torch.exp(sorted_vals - lse[:, None]).masked_fill(~keep, 0.0)
    before = torch.cumsum(probs, dim=-1) - probs  # mass ranked strictly before each token
    return keep & ((before < top_p[:, None]) | (rank == 0))


def _draw_filtered_full(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, seeds: torch.Tensor,
                        counters: torch.Tensor) -> torch.Tensor:
    vocab = scaled.shape[-1]
    sorted_vals, order = torch.sort(scaled, dim=-1, descending=True, stable=True)
    rank = torch.arange(vocab, device=scaled.device)[None, :]
    masked = sorted_vals.masked_fill(rank >= top_k[:, None], float("-inf"))
    keep = _keep_sorted(sorted_vals, top_k, top_p, torch.logsumexp(masked, dim=-1))
    score = torch.where(keep, sorted_vals + gumbel_noise(seeds, counters, order), float("-inf"))
    return order.gather(1, torch.argmax(score, dim=-1, keepdim=True)).squeeze(1)


def _draw_filtered(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, seeds: torch.Tensor,
                   counters: torch.Tensor) -> torch.Tensor:
    """Gumbel-max over the tokens top-k / top-p keep (``top_k`` already resolved to [1, V])."""
    n, vocab = scaled.shape
    c = min(NUM_CANDIDATES, vocab)
    if c >= vocab:
        return _draw_filtered_full(scaled, top_k, top_p, seeds, counters)
    out = torch.empty(n, dtype=torch.int64, device=scaled.device)
    small = top_k <= c
    if bool(small.any()):
        rows = small.nonzero().squeeze(1)
        x = scaled[rows]
        vals, idx = torch.topk(x, c, dim=-1)
        vals, idx = _rank_sorted(vals, idx)
        k = top_k[rows]
        lse_cand = torch.logsumexp(vals.masked_fill(torch.arange(c, device=x.device)[None, :] >= k[:, None],
                                                    float("-inf")), dim=-1)
        lse = torch.where(k < vocab, lse_cand, torch.logsumexp(x, dim=-1))
        keep = _keep_sorted(vals, k, top_p[rows], lse)
        # exact only if the kept set ends inside the candidates and no outside token ties a kept one
        last = vals[:, -1:]
        ties_outside = (x == last).sum(-1) > (vals == last).sum(-1)
        ok = ~keep[:, -1] & ~(ties_outside & (keep & (vals == last)).any(-1))
        score = torch.where(keep, vals + gumbel_noise(seeds[rows], counters[rows], idx), float("-inf"))
        choice = idx.gather(1, torch.argmax(score, dim=-1, keepdim=True)).squeeze(1)
        out[rows[ok]] = choice[ok]
        small[rows[~ok]] = False
    rest = (~small).nonzero().squeeze(1)
    if rest.numel():
        out[rest] = _draw_filtered_full(scaled[rest], top_k[rest], top_p[rest], seeds[rest], counters[rest])
    return out


def _sample_rows(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                 seeds: torch.Tensor, counters: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logits = logits.float()
    vocab = logits.shape[-1]
    logprobs_all = torch.log_softmax(logits, dim=-1)
    sampled = torch.argmax(logits, dim=-1)  # greedy rows keep this
    do_sample = temperature > 0
    if bool(do_sample.any()):
        k = torch.where((top_k > 0) & (top_k < vocab), top_k, torch.full_like(top_k, vocab))
        filtered = do_sample & ((k < vocab) | (top_p < 1.0))
        plain = do_sample & ~filtered
        temp = torch.where(do_sample, temperature, torch.ones_like(temperature))
        if bool(plain.any()):
            rows = plain.nonzero().squeeze(1)
            score = logits[rows] / temp[rows, None] + gumbel_noise(seeds[rows], counters[rows], vocab)
            sampled[rows] = torch.argmax(score, dim=-1)
        if bool(filtered.any()):
            rows = filtered.nonzero().squeeze(1)
            sampled[rows] = _draw_filtered(logits[rows] / temp[rows, None], k[rows], top_p[rows], seeds[rows],
                                           counters[rows])
    chosen_logprob = logprobs_all.gather(1, sampled[:, None]).squeeze(1)
    return sampled, chosen_logprob


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           seeds: torch.Tensor, counters: torch.Tensor, batch_invariant: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row.

    Args:
        logits: ``[n, V]`` float32 (other float dtypes are upcast), the model's next-token logits.
        temperature: ``[n]`` float32; 0 = greedy (argmax, ties to the lower id).
        top_k: ``[n]`` int64; <= 0 keeps all tokens.
        top_p: ``[n]`` float32 in (0, 1]; 1 keeps all tokens.
        seeds: ``[n]`` int64 in ``[0, 2**63)``.
        counters: ``[n]`` int64, the index of the token being drawn within its request.
        batch_invariant: compute row by row, so even the reductions (softmax, cumsum, sort) see one row at a time
            whatever the batch; the vectorised path already uses only per-row reductions.

    Returns:
        ``(token_ids [n] int64, logprobs [n] float32)`` where ``logprobs`` is the log-probability of the chosen
        token under the unmodified model distribution ``log_softmax(logits)`` (before temperature and filtering).

    Raises:
        ValueError: mismatched shapes.
    """
    if logits.dim() != 2:
        raise ValueError(f"sample: logits must be [n, V], got shape {tuple(logits.shape)}")
    n = logits.shape[0]
    for name, t in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p), ("seeds", seeds),
                    ("counters", counters)):
        if t.shape != (n,):
            raise ValueError(f"sample: {name} must have shape [{n}], got {tuple(t.shape)}")
    if n == 0:
        return torch.empty(0, dtype=torch.int64, device=logits.device), torch.empty(0, device=logits.device)
    if not batch_invariant:
        return _sample_rows(logits, temperature, top_k, top_p, seeds, counters)
    toks, lps = [], []
    for i in range(n):
        s = slice(i, i + 1)
        t, lp = _sample_rows(logits[s], temperature[s], top_k[s], top_p[s], seeds[s], counters[s])
        toks.append(t)
        lps.append(lp)
    return torch.cat(toks), torch.cat(lps)


def top_logprobs(logits_row: torch.Tensor, n: int) -> list[tuple[int, float]]:
    """The ``n`` most likely tokens of one ``[V]`` logits row under ``log_softmax`` (unmodified distribution), ranked
    by log-probability then lower token id: ``[(token_id, logprob), ...]``."""
    lp = torch.log_softmax(logits_row.float()[None, :], dim=-1)
    n = min(n, lp.shape[-1])
    vals, idx = torch.topk(lp, n, dim=-1)
    vals, idx = _rank_sorted(vals, idx)
    return list(zip(idx[0].tolist(), vals[0].tolist()))


class Sampler:
    """Holds the batch-invariant switch and turns per-sequence parameters into the tensors ``sample`` takes."""

    def __init__(self, batch_invariant: bool = False) -> None:
        self.batch_invariant = batch_invariant

    def __call__(self, logits: torch.Tensor, seqs: list) -> tuple[list[int], list[float], list[list[tuple[int, float]]]]:
        """Sample one token for each sequence in ``seqs`` (row i of ``logits`` belongs to ``seqs[i]``).

        The draw counter of a sequence is its number of output tokens so far. Returns token ids, their
        log-probabilities, and per row the ``params.top_logprobs`` most likely ``(token_id, logprob)`` (see
        ``top_logprobs``; empty when not asked).
        """
        dev = logits.device
        temperature = torch.tensor([s.params.temperature for s in seqs], dtype=torch.float32, device=dev)
        top_k = torch.tensor([s.params.top_k for s in seqs], dtype=torch.int64, device=dev)
        top_p = torch.tensor([s.params.top_p for s in seqs], dtype=torch.float32, device=dev)
        seeds = torch.tensor([s.seed for s in seqs], dtype=torch.int64, device=dev)
        counters = torch.tensor([s.num_output_tokens for s in seqs], dtype=torch.int64, device=dev)
        tokens, logprobs = sample(logits, temperature, top_k, top_p, seeds, counters, self.batch_invariant)
        tops: list[list[tuple[int, float]]] = [[] for _ in seqs]
        for i, s in enumerate(seqs):
            if s.params.top_logprobs > 0:
                tops[i] = top_logprobs(logits[i], s.params.top_logprobs)
        return tokens.tolist(), logprobs.tolist(), tops

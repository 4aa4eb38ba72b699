"""Sampling: greedy, temperature, top-k, top-p, with counter-based Gumbel-max draws.

A draw is ``argmax_v(logits[v] / T + g(seed, counter, v))`` over the tokens top-k / top-p keep, where
``g = -log(-log(u))`` and ``u`` is a uniform in (0, 1) made from a SplitMix64-style integer hash of
(seed, counter, token id). ``counter`` is the index of the output token within its request (0 for the first).
Nothing depends on the other rows of the batch or on any generator state, so a request with a fixed seed draws the
same tokens alone, in any batch, after preemption, on any device (Gumbel-max: Gumbel 1958; the hash: Steele et al.,
"Fast splittable pseudorandom number generators", OOPSLA 2014).

Before the draw, ``adjust_logits`` applies OpenAI's frequency / presence penalties and ``logit_bias`` per element
(one row's adjusted logits do not depend on the other rows); reported log-probabilities stay those of the unmodified
logits.
"""

from __future__ import annotations

import numpy as np
import torch

import deepinfer_ops
from deepinfer.forward_batch import float_tensors, index_tensors
from deepinfer.sequence import NO_TOP_LOGPROBS


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


def _keep_full(scaled: torch.Tensor, top_k: torch.Tensor,
               top_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The whole row ranked (value descending, then lower token id) and the top-k / top-p keep mask over the ranks:
    ``(sorted_vals [n, V], order [n, V] token ids, keep [n, V] bool)``."""
    vocab = scaled.shape[-1]
    sorted_vals, order = torch.sort(scaled, dim=-1, descending=True, stable=True)
    rank = torch.arange(vocab, device=scaled.device)[None, :]
    masked = sorted_vals.masked_fill(rank >= top_k[:, None], float("-inf"))
    return sorted_vals, order, _keep_sorted(sorted_vals, top_k, top_p, torch.logsumexp(masked, dim=-1))


def keep_mask(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The tokens top-k / top-p keep, in vocabulary order: ``[n, V]`` bool, the set the sampler's full-sort path
    draws from (``scaled`` ``[n, V]`` float32 = logits / temperature; ``top_k`` ``[n]`` int64 already resolved to
    ``[1, V]``; ``top_p`` ``[n]`` float32). Device ops only. Like the draw it serves, the sort, cumsum and logsumexp
    it runs may round differently for a row alone and in a batch: batch-invariant callers pass one row at a time."""
    _, order, keep = _keep_full(scaled, top_k, top_p)
    return torch.zeros_like(keep).scatter_(1, order, keep)


def _draw_filtered_full(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, seeds: torch.Tensor,
                        counters: torch.Tensor) -> torch.Tensor:
    sorted_vals, order, keep = _keep_full(scaled, top_k, top_p)
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


def adjust_logits(logits: torch.Tensor, rows: torch.Tensor, token_ids: torch.Tensor, counts: torch.Tensor,
                  presence: torch.Tensor, frequency: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Penalised and biased logits (a new float32 tensor; ``logits`` is not modified).

    For each listed element ``(rows[j], token_ids[j])`` (pairs must be distinct):
    ``out = (logits - (presence[j] + frequency[j] * counts[j])) + bias[j]`` in float32, every other element unchanged.
    With ``counts[j]`` the token's occurrences in the request's output (0 for a token only biased), this is OpenAI's
    ``logits[t] -= presence_penalty * (count[t] > 0) + frequency_penalty * count[t]``, then ``+= logit_bias[t]``.
    Elementwise, in a fixed order of float32 operations: a row's result does not depend on the batch.

    Args:
        logits: ``[n, V]`` float (upcast to float32).
        rows, token_ids: ``[m]`` int64 element coordinates; counts, presence, frequency, bias: ``[m]`` float32
            (presence already zeroed where the count is 0).
    Raises:
        ValueError: a token id outside ``[0, V)`` or a row outside ``[0, n)``.
    """
    out = logits.float().clone()
    if rows.numel() == 0:
        return out
    n, vocab = out.shape
    if bool(((token_ids < 0) | (token_ids >= vocab)).any()) or bool(((rows < 0) | (rows >= n)).any()):
        raise ValueError(f"adjust_logits: token ids must be in [0, {vocab}) and rows in [0, {n})")
    penalty = presence + frequency * counts
    out[rows, token_ids] = (out[rows, token_ids] - penalty) + bias
    return out


# Temperatures below this are greedy: ``logits / T`` would overflow float32 for tiny T (1e-40 turned every logit into
# +-inf, and argmax then picked token 0); at 1e-5 the Gumbel noise can only decide between logits closer than ~1e-4.
MIN_SAMPLING_TEMPERATURE = 1e-5


def row_kinds(temperature, top_k, top_p, vocab: int) -> tuple[list, list]:
    """Host split of the rows (from the request parameters, ``[n]`` array-likes): (rows drawn without filtering, rows
    filtered by top-k / top-p); the others are greedy. Lets the sampler skip the device-side split, which reads
    back to the host."""
    t = np.asarray(temperature, dtype=np.float32)
    k = np.asarray(top_k, dtype=np.int64)
    p = np.asarray(top_p, dtype=np.float32)
    drawn = t >= MIN_SAMPLING_TEMPERATURE
    filtered = drawn & (((k > 0) & (k < vocab)) | (p < 1.0))
    return np.flatnonzero(drawn & ~filtered).tolist(), np.flatnonzero(filtered).tolist()


def _sample_rows(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                 seeds: torch.Tensor, counters: torch.Tensor, raw_logits: torch.Tensor | None = None,
                 batch_invariant: bool = False, kinds: tuple[list, list] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    logits = logits.float()
    vocab = logits.shape[-1]
    sampled = torch.argmax(logits, dim=-1)  # greedy rows keep this
    if kinds is None:  # split on the device (reads the masks back)
        do_sample = temperature >= MIN_SAMPLING_TEMPERATURE
        k = torch.where((top_k > 0) & (top_k < vocab), top_k, torch.full_like(top_k, vocab))
        filtered = do_sample & ((k < vocab) | (top_p < 1.0))
        plain = do_sample & ~filtered
        kinds = (plain.nonzero().squeeze(1).tolist(), filtered.nonzero().squeeze(1).tolist())
    plain_rows, filtered_rows = kinds[:2]
    if plain_rows or filtered_rows:
        plain_t, filtered_t = kinds[2:] if len(kinds) == 4 else index_tensors([plain_rows, filtered_rows],
                                                                              logits.device)
        k = torch.where((top_k > 0) & (top_k < vocab), top_k, torch.full_like(top_k, vocab))
        do_sample = temperature >= MIN_SAMPLING_TEMPERATURE
        temp = torch.where(do_sample, temperature, torch.ones_like(temperature))
        if plain_rows:
            rows = plain_t
            score = logits[rows] / temp[rows, None] + gumbel_noise(seeds[rows], counters[rows], vocab)
            sampled[rows] = torch.argmax(score, dim=-1)
        if filtered_rows:
            rows = filtered_t
            scaled = logits[rows] / temp[rows, None]
            if batch_invariant:  # sort / cumsum / logsumexp see one row at a time (see ``sample``)
                sampled[rows] = torch.cat([
                    _draw_filtered(scaled[i:i + 1], k[r:r + 1], top_p[r:r + 1], seeds[r:r + 1], counters[r:r + 1])
                    for i, r in enumerate(filtered_rows)])
            else:
                sampled[rows] = _draw_filtered(scaled, k[rows], top_p[rows], seeds[rows], counters[rows])
    raw = (logits if raw_logits is None else raw_logits).float()
    return sampled, raw.gather(1, sampled[:, None]).squeeze(1) - _log_softmax_normaliser(raw)


def _log_softmax_normaliser(raw: torch.Tensor) -> torch.Tensor:
    """``[n]`` float32 such that ``log_softmax(raw) = raw - normaliser[:, None]``: :func:`deepinfer_ops.logsumexp_rows`
    (each row in a fixed order, in either mode), NaN for a row holding +inf (log_softmax semantics: its finite tokens
    would otherwise get -inf, and the Sampler would emit them instead of ending the request with nan_logits)."""
    lse = deepinfer_ops.logsumexp_rows(raw if raw.stride(-1) == 1 else raw.contiguous())
    return torch.where(lse == float("inf"), torch.full_like(lse, float("nan")), lse)


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           seeds: torch.Tensor, counters: torch.Tensor, batch_invariant: bool = False,
           raw_logits: torch.Tensor | None = None, kinds: tuple[list, list] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row.

    Args:
        logits: ``[n, V]`` float32 (other float dtypes are upcast), the model's next-token logits.
        temperature: ``[n]`` float32; 0 (or below ``MIN_SAMPLING_TEMPERATURE`` = 1e-5) = greedy (argmax, ties to the
            lower id).
        top_k: ``[n]`` int64; <= 0 keeps all tokens.
        top_p: ``[n]`` float32 in (0, 1]; 1 keeps all tokens.
        seeds: ``[n]`` int64 in ``[0, 2**63)``.
        counters: ``[n]`` int64, the index of the token being drawn within its request.
        batch_invariant: a row's token and log-probability do not depend on the other rows. torch picks how it
            splits a float reduction by the tensor's shape, number of rows included (CPU ``parallel_reduce`` splits a
            lone row across threads; CUDA's ``ReduceConfig`` spreads a row over several blocks when there are few
            rows; CUDA ``cumsum`` of a single row uses cub's scan; CUDA ``topk`` picks its algorithm by the number of
            rows; measured: ``sum(-1)`` of fp32 rows of 129,280 on a 2-thread CPU, torch 2.14, differs for 5 of 8 rows
            alone vs batched). So: greedy and plain-temperature rows stay vectorised (argmax with the lower-id tie
            rule and max are exact in any order; the Gumbel noise is elementwise), the log-probability normaliser is
            :func:`deepinfer_ops.logsumexp_rows` (each row in a fixed order, in either mode), and only rows filtered
            by top-k / top-p (sort, cumsum, logsumexp) are drawn one row per call.
        raw_logits: ``[n, V]``, the unmodified logits when ``logits`` holds penalised/biased ones
            (``adjust_logits``); the reported log-probabilities are computed from them. Default: ``logits``.
        kinds: :func:`row_kinds` of the same parameters, computed on the host (no host read-back); default: split
            on the device.

    Returns:
        ``(token_ids [n] int64, logprobs [n] float32)`` where ``logprobs`` is the log-probability of the chosen
        token under the unmodified model distribution ``log_softmax(raw_logits)`` (before penalties, bias,
        temperature and filtering).

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
    if raw_logits is not None and raw_logits.shape != logits.shape:
        raise ValueError(f"sample: raw_logits must have the shape of logits {tuple(logits.shape)}, got "
                         f"{tuple(raw_logits.shape)}")
    if n == 0:
        return torch.empty(0, dtype=torch.int64, device=logits.device), torch.empty(0, device=logits.device)
    return _sample_rows(logits, temperature, top_k, top_p, seeds, counters, raw_logits, batch_invariant, kinds)


def top_logprobs(logits_row: torch.Tensor, n: int) -> list[tuple[int, float]]:
    """The ``n`` most likely tokens of one ``[V]`` logits row under ``log_softmax`` (unmodified distribution), ranked
    by log-probability then lower token id: ``[(token_id, logprob), ...]``. Same normaliser as the sampled token's
    log-probability (``deepinfer_ops.logsumexp_rows``), so the chosen token's entry carries the same value."""
    row = logits_row.float()[None, :]
    lp = row - _log_softmax_normaliser(row)[:, None]
    n = min(n, lp.shape[-1])
    vals, idx = torch.topk(lp, n, dim=-1)
    vals, idx = _rank_sorted(vals, idx)
    return list(zip(idx[0].tolist(), vals[0].tolist()))


NAN_LOGITS_TOKEN = -1  # Sampler's token for a row whose logits hold a NaN


def _nan_rows_token(tokens: torch.Tensor, logprobs: torch.Tensor) -> torch.Tensor:
    """``NAN_LOGITS_TOKEN`` for rows whose log-probability is NaN: a NaN logit makes the row's log-softmax NaN
    everywhere, so the drawn token's logprob shows it (no extra pass over the vocabulary)."""
    return torch.where(torch.isnan(logprobs), torch.full_like(tokens, NAN_LOGITS_TOKEN), tokens)


class Sampler:
    """Holds the batch-invariant switch and turns per-sequence parameters into the tensors ``sample`` takes."""

    def __init__(self, batch_invariant: bool = False) -> None:
        self.batch_invariant = batch_invariant

    def __call__(self, logits: torch.Tensor, seqs: list) -> tuple[list[int], list[float], list[list[tuple[int, float]]]]:
        """:meth:`sample_device`, with the tokens and log-probabilities read back to the host (synchronises)."""
        tokens, logprobs, tops = self.sample_device(logits, seqs)
        return tokens.tolist(), logprobs.tolist(), tops

    @staticmethod
    def plain_greedy(seqs: list) -> bool:
        """Every row of ``seqs`` is greedy with nothing adjusted and no top log-probabilities asked: what
        :meth:`greedy_device` computes (without structured-output masks, which the caller checks)."""
        return all(p.temperature < MIN_SAMPLING_TEMPERATURE and not p.adjusts_logits and p.top_logprobs == 0
                   for p in (s.params for s in seqs))

    def greedy_device(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`sample_device` for rows that are all :meth:`plain_greedy`, from device ops alone (a captured decode
        graph runs it after its forward): token ids ``[n]`` int64 and their log-probabilities ``[n]`` float32."""
        tokens, logprobs = _sample_rows(logits, None, None, None, None, None, None, self.batch_invariant, ([], []))
        return _nan_rows_token(tokens, logprobs), logprobs

    def sample_device(self, logits: torch.Tensor, seqs: list, counters=None,
                      masks: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor, list]:
        """Sample one token for each request in ``seqs`` (row i of ``logits`` belongs to ``seqs[i]``; each has
        ``params``, ``seed`` and ``output_token_counts()``: a ``Sequence`` or the runner's ``RequestState``).

        ``counters``: ``[n]`` ints, the index of the output token each row draws (default: ``num_output_tokens``
        of each, a sequence with nothing pending). Penalties and ``logit_bias`` of the sequences' ``SamplingParams``
        are applied first (``adjust_logits``; counts over each request's output tokens, so a penalised request must
        have no pending token: the engine runs such steps in order). ``masks``: ``(rows [m] int64, bitmask [m,
        ceil(V / 32)] int32)`` on the device, the structured-output rows and their allowed tokens
        (``structured.apply_token_bitmask``, after the penalties and bias; the other tokens get ``-inf``).
        Returns token ids ``[n]`` int64 and their log-probabilities ``[n]`` float32 on the logits' device (no host
        synchronisation; at most one host-to-device copy, none when every row is greedy), and per row the
        ``params.top_logprobs`` most likely ``(token_id, logprob)`` (see ``top_logprobs``; empty when not asked; a
        host read for the rows that ask), from the unmodified logits. A row whose logits hold a NaN or +inf (a
        broken checkpoint or kernel; its log-softmax is NaN in both modes) gets token ``NAN_LOGITS_TOKEN`` (-1):
        the scheduler ends that request with an error instead of emitting whatever argmax makes of NaN.
        """
        dev = logits.device
        n = len(seqs)
        params = [s.params for s in seqs]
        raw = None
        if any(p.adjusts_logits for p in params):
            raw = logits
            logits = adjust_logits(logits, *_adjustments(seqs, dev))
        if masks is not None:
            from deepinfer.structured import apply_token_bitmask

            raw = logits if raw is None else raw
            logits = apply_token_bitmask(logits, *masks)
        temps = np.fromiter((p.temperature for p in params), np.float32, n)
        drawn = temps >= MIN_SAMPLING_TEMPERATURE
        if not drawn.any():  # all greedy: no parameter reaches the device
            tokens, logprobs = _sample_rows(logits, None, None, None, None, None, raw, self.batch_invariant,
                                            ([], []))
        else:
            top_ps = np.fromiter((p.top_p for p in params), np.float32, n)
            top_ks = np.fromiter((p.top_k for p in params), np.int64, n)
            seeds = np.fromiter((s.seed for s in seqs), np.int64, n)
            if counters is None:
                counters = [s.num_output_tokens for s in seqs]
            plain_rows, filtered_rows = row_kinds(temps, top_ks, top_ps, logits.shape[-1])
            # one host-to-device copy: integer parameters, float32 bits, and the row split
            up = index_tensors([top_ks, seeds, np.asarray(counters, dtype=np.int64),
                                temps.view(np.int32).astype(np.int64), top_ps.view(np.int32).astype(np.int64),
                                plain_rows, filtered_rows], dev)
            top_k, seed_t, counter_t = up[:3]
            temperature, top_p = (t.to(torch.int32).view(torch.float32) for t in up[3:5])
            kinds = (plain_rows, filtered_rows, up[5], up[6])
            tokens, logprobs = _sample_rows(logits, temperature, top_k, top_p, seed_t, counter_t, raw,
                                            self.batch_invariant, kinds)
        raw = logits if raw is None else raw
        tokens = _nan_rows_token(tokens, logprobs)
        tops: list = [NO_TOP_LOGPROBS] * len(seqs)
        for i, p in enumerate(params):
            if p.top_logprobs > 0:
                tops[i] = top_logprobs(raw[i], p.top_logprobs)
        return tokens, logprobs, tops


def _adjustments(seqs: list, device: torch.device) -> tuple[torch.Tensor, ...]:
    """``adjust_logits``'s element lists for ``seqs``: per row, the tokens its output holds (when it has penalties)
    and the tokens of its ``logit_bias``, each once."""
    rows: list[int] = []
    toks: list[int] = []
    counts: list[float] = []
    pres: list[float] = []
    freq: list[float] = []
    bias: list[float] = []
    for i, s in enumerate(seqs):
        p = s.params
        if not p.adjusts_logits:
            continue
        occ = s.output_token_counts() if (p.frequency_penalty or p.presence_penalty) else {}
        lb = p.logit_bias or {}
        for t in sorted(set(occ) | set(lb)):
            c = occ.get(t, 0)
            rows.append(i)
            toks.append(int(t))
            counts.append(float(c))
            pres.append(float(p.presence_penalty) if c > 0 else 0.0)
            freq.append(float(p.frequency_penalty))
            bias.append(float(lb.get(t, 0.0)))

    r, t = index_tensors([rows, toks], device)
    return (r, t, *float_tensors([counts, pres, freq, bias], device))

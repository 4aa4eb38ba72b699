"""Sampler: greedy, temperature, top-k, top-p; counter-based draws independent of the batch."""

import math

import pytest
import torch

import deepinfer.sampler as S
from deepinfer.sampler import gumbel_noise, sample, top_logprobs, uniform_from_hash


def _args(n, temperature=1.0, top_k=0, top_p=1.0, seed=123, counters=None):
    return (torch.full((n,), float(temperature)), torch.full((n,), top_k, dtype=torch.int64),
            torch.full((n,), float(top_p)), torch.full((n,), seed, dtype=torch.int64),
            torch.arange(n, dtype=torch.int64) if counters is None else counters)


def test_hash_uniforms_are_uniform_and_keyed():
    u = uniform_from_hash(torch.tensor([7]), torch.tensor([0]), 1 << 16)[0]
    assert 0.0 < float(u.min()) and float(u.max()) < 1.0
    assert abs(float(u.mean()) - 0.5) < 0.01 and abs(float(u.var()) - 1 / 12) < 0.005
    hist = torch.histc(u, bins=16, min=0, max=1)
    assert float((hist / u.numel() - 1 / 16).abs().max()) < 0.01
    # each of seed, counter and token id changes the value; the same key gives the same value
    base = uniform_from_hash(torch.tensor([7, 8, 7]), torch.tensor([0, 0, 1]), 64)
    assert not torch.equal(base[0], base[1]) and not torch.equal(base[0], base[2])
    ids = torch.tensor([[5, 60, 3]])
    assert torch.equal(uniform_from_hash(torch.tensor([7]), torch.tensor([0]), ids)[0], base[0, [5, 60, 3]])


def test_uniform_mapping_edges_stay_inside_the_open_interval():
    u = S.bits_to_uniform(torch.tensor([0, 1, (1 << S.UNIFORM_BITS) - 1]))
    assert float(u[0]) > 0 and float(u[-1]) < 1.0
    g = -torch.log(-torch.log(u))
    assert torch.isfinite(g).all()


def test_peaked_logits_always_pick_the_peak():
    # a non-finite Gumbel value (u rounding to 1.0) would pick a wrong token in ~0.8% of such rows
    n, vocab = 128, 129280
    torch.manual_seed(5)
    target = torch.randint(0, vocab, (n,))
    logits = torch.zeros(n, vocab)
    logits[torch.arange(n), target] = 40.0
    seeds = torch.randint(0, 1 << 62, (n,))
    tok, _ = sample(logits, torch.ones(n), torch.zeros(n, dtype=torch.int64), torch.ones(n), seeds,
                    torch.randint(0, 1000, (n,)))
    assert torch.equal(tok, target)


def test_seed_extremes():
    u = uniform_from_hash(torch.tensor([0, (1 << 63) - 1]), torch.tensor([0, 1 << 40]), 1000)
    assert torch.isfinite(gumbel_noise(torch.tensor([0]), torch.tensor([0]), 10)).all()
    assert float(u.min()) > 0 and float(u.max()) < 1


def test_greedy_is_argmax_and_logprob():
    torch.manual_seed(0)
    logits = torch.randn(5, 300)
    logits[2, 17] = logits[2, 18] = 50.0  # tie -> lower id
    tok, lp = sample(logits, *_args(5, temperature=0.0))
    assert tok.tolist() == torch.argmax(logits, -1).tolist() and int(tok[2]) == 17
    ref = torch.log_softmax(logits, -1).gather(1, tok[:, None]).squeeze(1)
    torch.testing.assert_close(lp, ref, rtol=1e-6, atol=1e-5)  # normaliser: deepinfer_ops.logsumexp_rows


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_draws_do_not_depend_on_the_batch(batch_invariant):
    torch.manual_seed(1)
    vocab = 5000
    logits = torch.randn(7, vocab) * 2
    temp = torch.tensor([0.0, 0.7, 1.0, 1.3, 1.0, 0.9, 1.0])
    top_k = torch.tensor([0, 0, 50, 0, 2000, 0, 1], dtype=torch.int64)
    top_p = torch.tensor([1.0, 1.0, 1.0, 0.9, 0.8, 0.5, 1.0])
    seeds = torch.tensor([1, 2, 3, 4, 5, 6, 7], dtype=torch.int64) * 1000003
    counters = torch.tensor([0, 3, 9, 1, 4, 2, 8], dtype=torch.int64)
    full, full_lp = sample(logits, temp, top_k, top_p, seeds, counters, batch_invariant)
    for i in range(7):  # alone
        t, lp = sample(logits[i:i + 1], temp[i:i + 1], top_k[i:i + 1], top_p[i:i + 1], seeds[i:i + 1],
                       counters[i:i + 1], batch_invariant)
        assert int(t) == int(full[i]) and torch.equal(lp, full_lp[i:i + 1])
    perm = torch.tensor([6, 2, 0, 5, 1, 4, 3])  # another order, inside a bigger batch with other rows
    extra = torch.randn(3, vocab)
    big = torch.cat([logits[perm], extra])
    t, lp = sample(big, torch.cat([temp[perm], torch.ones(3)]), torch.cat([top_k[perm], torch.zeros(3, dtype=torch.int64)]),
                   torch.cat([top_p[perm], torch.ones(3)]), torch.cat([seeds[perm], torch.arange(3)]),
                   torch.cat([counters[perm], torch.arange(3)]), batch_invariant)
    assert torch.equal(t[:7], full[perm]) and torch.equal(lp[:7], full_lp[perm])
    # same seed, other counter -> (almost surely) another draw somewhere; other seed too
    t2, _ = sample(logits, temp, top_k, top_p, seeds, counters + 1, batch_invariant)
    t3, _ = sample(logits, temp, top_k, top_p, seeds + 1, counters, batch_invariant)
    assert not torch.equal(t2, full) and not torch.equal(t3, full)


def _counts(logits_row, n, **kw):
    logits = logits_row[None, :].expand(n, -1).contiguous()
    tok, _ = sample(logits, *_args(n, **kw))
    return torch.bincount(tok, minlength=logits_row.numel()).double()


def _assert_matches(counts, probs):
    n = counts.sum()
    expected = probs * n
    assert bool((counts[probs == 0] == 0).all()), "a filtered-out token was drawn"
    nz = probs > 0
    chi2 = float(((counts[nz] - expected[nz]) ** 2 / expected[nz]).sum())
    dof = int(nz.sum()) - 1
    assert chi2 < dof + 6 * math.sqrt(2 * dof) + 10, f"chi2 {chi2:.1f} for {dof} dof"


def test_temperature_distribution():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    for t in (1.0, 0.5, 2.0):
        _assert_matches(_counts(logits, 20000, temperature=t), torch.softmax(logits.double() / t, -1))


def test_top_k_distribution():
    logits = torch.tensor([0.3, 2.0, 1.0, 1.5, 0.0, -1.0, 1.2, 0.9])
    probs = torch.softmax(logits.double(), -1)
    keep = torch.zeros(8, dtype=torch.bool)
    keep[torch.tensor([1, 3, 6])] = True
    ref = torch.where(keep, probs, torch.zeros_like(probs))
    _assert_matches(_counts(logits, 20000, top_k=3), ref / ref.sum())


def test_top_p_distribution_and_tie_rule():
    logits = torch.log(torch.tensor([0.4, 0.1, 0.25, 0.1, 0.15]))
    # ranking: 0 (.4), 2 (.25), 4 (.15), 1 (.1, lower id first), 3 (.1); mass before: 0, .4, .65, .8, .9
    for p, kept in ((0.5, [0, 2]), (0.7, [0, 2, 4]), (0.85, [0, 2, 4, 1]), (0.3, [0])):
        probs = torch.softmax(logits.double(), -1)
        mask = torch.zeros(5, dtype=torch.bool)
        mask[kept] = True
        ref = torch.where(mask, probs, torch.zeros_like(probs))
        _assert_matches(_counts(logits, 20000, top_p=p), ref / ref.sum())


def test_candidate_path_equals_full_sort():
    torch.manual_seed(3)
    n, vocab = 12, 20000
    logits = torch.randn(n, vocab) * 6
    logits[3, :] = 0.0  # all ties: forces the fallback
    logits[4, 100:3000] = 30.0  # a tie group straddling the candidate boundary
    temp = torch.rand(n) + 0.5
    top_k = torch.tensor([5, 0, 1024, 50, 2000, 0, 0, 1, 3000, 10, 0, 0], dtype=torch.int64)
    top_p = torch.tensor([1.0, 0.9, 0.95, 0.5, 1.0, 0.3, 0.99, 1.0, 0.8, 0.2, 0.7, 0.6])
    seeds = torch.arange(n, dtype=torch.int64) * 77 + 5
    counters = torch.arange(n, dtype=torch.int64)
    got, _ = sample(logits, temp, top_k, top_p, seeds, counters)
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab))
    ref = S._draw_filtered_full(logits / temp[:, None], k, top_p, seeds, counters)
    assert got.tolist() == ref.tolist()
    assert 100 <= int(got[4]) < 3000


def test_shape_errors():
    with pytest.raises(ValueError, match="top_p must have shape"):
        sample(torch.zeros(2, 5), torch.zeros(2), torch.zeros(2, dtype=torch.int64), torch.ones(3),
               torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int64))
    tok, lp = sample(torch.zeros(0, 5), *_args(0))
    assert tok.shape == (0,) and lp.shape == (0,)


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.0, 0, 1.0), (0.5, 0, 1.0), (0.7, 5, 1.0), (0.5, 3, 0.5)])
def test_batch_invariant_logprobs_follow_log_softmax_on_inf_rows(temperature, top_k, top_p):
    """Rows holding +inf (or huge logits that overflow once divided by the temperature), NaN, all -inf: the
    batch-invariant log-probability is NaN exactly where log_softmax's is (so the Sampler ends those requests with
    nan_logits in both modes), and otherwise equals it."""
    g = torch.Generator().manual_seed(8)
    vocab = 1100
    logits = torch.randn(6, vocab, generator=g)
    logits[0, 10] = float("inf")
    logits[1, 5] = 3e38  # finite, but / 0.5 or / 0.7 overflows: ties the +inf token and has the lower id
    logits[1, 20] = float("inf")
    logits[2, 30] = float("nan")
    logits[3] = float("-inf")
    logits[4, :50] = float("-inf")
    n = logits.shape[0]
    args = _args(n, temperature=temperature, top_k=top_k, top_p=top_p)
    tok, lp = sample(logits, *args, batch_invariant=True)
    tok_off, lp_off = sample(logits, *args, batch_invariant=False)
    ref = torch.log_softmax(logits, -1).gather(1, tok[:, None]).squeeze(1)
    assert torch.equal(torch.isnan(lp), torch.isnan(ref)), (lp, ref)
    assert torch.equal(torch.isnan(lp), torch.isnan(lp_off)), (lp, lp_off)
    fin = ~torch.isnan(ref)
    torch.testing.assert_close(lp[fin], ref[fin], rtol=1e-6, atol=1e-5)
    assert bool(torch.isnan(lp[:4]).all()) and not bool(torch.isnan(lp[4:]).any())


def test_greedy_logprob_equals_its_top_logprobs_entry():
    """The sampled token's log-probability and its ``top_logprobs`` entry come from one normaliser: the same bits."""
    logits = torch.randn(4, 3001, generator=torch.Generator().manual_seed(2)) * 3
    tok, lp = sample(logits, *_args(4, temperature=0.0))
    for i in range(4):
        top = top_logprobs(logits[i], 3)
        assert top[0] == (int(tok[i]), float(lp[i]))


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_greedy_device_equals_sample_device_for_plain_greedy_rows(batch_invariant):
    """What a captured decode graph samples (``greedy_device``) equals ``sample_device`` for rows that are
    ``plain_greedy``, a NaN row included; rows with a temperature, a bias or top log-probabilities are not plain."""
    from deepinfer import SamplingParams
    from deepinfer.sequence import Sequence

    torch.manual_seed(0)
    logits = torch.randn(5, 300)
    logits[1, 7] = float("nan")
    logits[3, 4] = logits[3, 9] = logits[3].max() + 1  # a tie: the lower id
    seqs = [Sequence(i, [1], SamplingParams(temperature=0, max_tokens=4), seed=i) for i in range(5)]
    sampler = S.Sampler(batch_invariant=batch_invariant)
    assert S.Sampler.plain_greedy(seqs)
    want_t, want_lp, _ = sampler.sample_device(logits, seqs)
    got_t, got_lp = sampler.greedy_device(logits)
    assert torch.equal(got_t, want_t) and torch.equal(got_lp.isnan(), want_lp.isnan())
    assert torch.equal(got_lp[~got_lp.isnan()], want_lp[~want_lp.isnan()])
    assert got_t[1].item() == S.NAN_LOGITS_TOKEN and got_t[3].item() == 4
    for params in (SamplingParams(temperature=0.5, max_tokens=4), SamplingParams(temperature=0, logit_bias={3: 1.0}),
                   SamplingParams(temperature=0, top_logprobs=2)):
        assert not S.Sampler.plain_greedy(seqs[:2] + [Sequence(9, [1], params, seed=0)])

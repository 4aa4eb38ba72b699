"""Speculative decoding's acceptance rules: lossless sampling (a statistical test that also catches broken rules),
greedy prefix matching, counter-keyed draws that do not depend on the batch."""

import itertools

import pytest
import torch

import deepinfer.speculative as spec
from deepinfer.sampler import sample


pytestmark = pytest.mark.usefixtures("one_cpu_thread")

V = 5  # a small vocabulary: the joint distribution of a few tokens is enumerable
K = 3  # drafts per step
TEMP, TOP_K = 0.8, 4  # the target's sampling parameters (top-k drops one token per context)


def _markov(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(V, V, generator=g) * 1.5  # logits of the next token given the previous one


TARGET, DRAFTER = _markov(11), _markov(12)


def _params(n: int, temp: float, top_k: int):
    return (torch.full((n,), temp), torch.full((n,), top_k, dtype=torch.int64), torch.ones(n))


def _exact_joint(length: int) -> dict[tuple[int, ...], float]:
    """The target's exact distribution of the first ``length`` tokens after token 0 (temperature and top-k
    applied as the sampler does)."""
    p = spec.filtered_probs(TARGET, *_params(V, TEMP, TOP_K))
    out = {}
    for seq in itertools.product(range(V), repeat=length):
        prob, prev = 1.0, 0
        for t in seq:
            prob *= float(p[prev, t])
            prev = t
        out[seq] = prob
    return out


def _speculate(n: int, length: int, greedy: bool = False, seed0: int = 1, verify=None) -> torch.Tensor:
    """``n`` independent requests (seeds ``seed0 ..``) decode ``length`` tokens with K drafts per step from the
    drafter chain; returns ``[n, length]`` tokens. ``verify(q_drawn [n, K], q_expected [n, K]) -> [n, K] bool``:
    which drafts may be verified (a row verifies its leading run of them; default all), from each draft's
    probability under the drafter and that probability in expectation over the draw (sum q^2)."""
    temp = 0.0 if greedy else TEMP
    seeds = torch.arange(seed0, seed0 + n, dtype=torch.int64) * 1000003
    out = torch.full((n, length + K + 1), -1, dtype=torch.int64)
    count = torch.zeros(n, dtype=torch.int64)
    last = torch.zeros(n, dtype=torch.int64)
    while bool((count < length).any()):
        prev, drafts, q, drawn, expected = last, [], [], [], []
        for j in range(K):  # the drafter proposes on its own outputs
            probs = spec.filtered_probs(DRAFTER[prev], *_params(n, 1.0, 0))
            d, conf = spec.draw_drafts(probs, torch.full((n,), greedy), seeds, count + j)
            assert torch.allclose(conf, probs.gather(1, d[:, None]).squeeze(1))
            drafts.append(d)
            q.append(probs)
            drawn.append(conf)
            expected.append((probs * probs).sum(-1))
            prev = d
        drafts = torch.stack(drafts, 1)
        allowed = torch.ones(n, K, dtype=torch.bool) if verify is None else \
            verify(torch.stack(drawn, 1), torch.stack(expected, 1))
        num_drafts = torch.cumprod(allowed.to(torch.int64), 1).sum(1)
        ctx = torch.cat([last[:, None], drafts], 1)  # the token before each verified position
        base, p = [], []
        for j in range(K + 1):
            logits = TARGET[ctx[:, j]]
            base.append(sample(logits, *_params(n, temp, TOP_K), seeds, count + j)[0])
            p.append(spec.filtered_probs(logits, *_params(n, temp, TOP_K)))
        sampled = torch.full((n,), not greedy)
        m = 0 if greedy else n
        tokens, n_emit = spec.accept_drafts(torch.stack(base, 1), drafts, num_drafts, sampled,
                                            torch.stack(p[:K], 1)[:m], torch.stack(q, 1)[:m], seeds[:m], count[:m])
        assert bool(((n_emit >= 1) & (n_emit <= K + 1)).all())
        cols = torch.arange(K + 1)[None, :]
        assert bool((tokens[cols < n_emit[:, None]] >= 0).all()) and bool((tokens[cols >= n_emit[:, None]] == -1).all())
        dst = (count[:, None] + cols).clamp(max=out.shape[1] - 1)
        keep = (cols < n_emit[:, None]) & (count[:, None] < length)
        out.scatter_(1, torch.where(keep, dst, out.shape[1] - 1), torch.where(keep, tokens, -1))
        count = torch.where(count < length, count + n_emit, count)
        last = torch.where(keep.any(1), tokens.gather(1, (n_emit - 1)[:, None]).squeeze(1), last)
    return out[:, :length]


def _chi_square(tokens: torch.Tensor, exact: dict) -> tuple[float, int]:
    """Pearson's statistic of the observed joint vs ``exact`` over the cells of positive probability, and the
    number of samples that fell in a cell of probability 0."""
    n = tokens.shape[0]
    counts: dict[tuple[int, ...], int] = {}
    for row in tokens.tolist():
        counts[tuple(row)] = counts.get(tuple(row), 0) + 1
    stat = sum((counts.get(c, 0) - n * p) ** 2 / (n * p) for c, p in exact.items() if p > 0)
    impossible = sum(v for c, v in counts.items() if exact.get(c, 0.0) == 0.0)
    return stat, impossible


N_SAMPLES, LENGTH = 40000, 3
# 5**3 cells, a quarter of them impossible (top-k): about 64 of positive probability; chi-square's mean is the
# degrees of freedom and its standard deviation sqrt(2 df), so the bound is far in the tail of a correct rule
CHI2_BOUND = 64 + 8 * (2 * 64) ** 0.5


def test_speculative_sampling_is_lossless():
    exact = _exact_joint(LENGTH)
    stat, impossible = _chi_square(_speculate(N_SAMPLES, LENGTH), exact)
    assert impossible == 0
    assert stat < CHI2_BOUND, stat


@pytest.mark.parametrize("broken", ["accept_always", "resample_from_target", "ratio_inverted"])
def test_the_statistical_test_catches_a_broken_rule(monkeypatch, broken):
    if broken == "accept_always":
        monkeypatch.setattr(spec, "acceptance_mask", lambda p, q, u: torch.ones_like(p, dtype=torch.bool))
    elif broken == "resample_from_target":
        monkeypatch.setattr(spec, "residual", lambda p, q: p)
    else:
        monkeypatch.setattr(spec, "acceptance_mask", lambda p, q, u: u * p < q)
    exact = _exact_joint(LENGTH)
    stat, impossible = _chi_square(_speculate(N_SAMPLES, LENGTH), exact)
    assert impossible > 0 or stat > 4 * CHI2_BOUND, stat


def test_verified_length_may_depend_on_the_drafters_distribution_not_on_its_draw():
    """Choosing how many drafts to verify from each draft's expected confidence (a function of the tokens before
    it) keeps sampling lossless; choosing from the drawn token's own probability biases it. The confidence
    schedule therefore reads sum q^2 for sampled requests."""
    exact = _exact_joint(LENGTH)
    safe = _speculate(N_SAMPLES, LENGTH, verify=lambda drawn, expected: expected > 0.35)
    stat, impossible = _chi_square(safe, exact)
    assert impossible == 0 and stat < CHI2_BOUND, stat
    biased = _speculate(N_SAMPLES, LENGTH, verify=lambda drawn, expected: drawn > 0.35)
    stat, impossible = _chi_square(biased, exact)
    assert impossible > 0 or stat > 2 * CHI2_BOUND, stat


def test_greedy_is_the_longest_matching_prefix_plus_the_next_token():
    n = 64
    got = _speculate(n, 8, greedy=True)
    ref = torch.zeros(n, 8, dtype=torch.int64)
    prev = torch.zeros(n, dtype=torch.int64)
    for j in range(8):
        prev = torch.argmax(TARGET[prev], dim=-1)
        ref[:, j] = prev
    assert torch.equal(got, ref)
    # by hand: drafts [3, 1, 4] against argmax [3, 1, 2, 0] -> 3, 1 accepted, then 2
    base = torch.tensor([[3, 1, 2, 0], [5, 5, 5, 5], [3, 1, 4, 9]])
    drafts = torch.tensor([[3, 1, 4], [5, 5, 5], [3, 1, 4]])
    tokens, n_emit = spec.accept_drafts(base, drafts, torch.tensor([3, 2, 3]), torch.zeros(3, dtype=torch.bool))
    assert n_emit.tolist() == [3, 3, 4]
    assert tokens.tolist() == [[3, 1, 2, -1], [5, 5, 5, -1], [3, 1, 4, 9]]


def test_draws_are_keyed_by_seed_and_position_not_the_batch():
    n = 12
    alone = torch.cat([_speculate(1, 6, seed0=s) for s in range(1, n + 1)])
    assert torch.equal(_speculate(n, 6, seed0=1), alone)
    assert not torch.equal(_speculate(n, 6, seed0=1), _speculate(n, 6, seed0=100))


def test_stream_seeds_are_in_range_and_distinct():
    seeds = torch.tensor([0, 1, (1 << 63) - 1, 12345], dtype=torch.int64)
    streams = [spec.stream_seeds(seeds, s) for s in (spec.ACCEPT_STREAM, spec.RESIDUAL_STREAM, spec.DRAFT_STREAM)]
    for s in streams:
        assert bool((s >= 0).all())
    assert len({tuple(s.tolist()) for s in streams} | {tuple(seeds.tolist())}) == 4


def test_filtered_probs_is_the_samplers_distribution():
    torch.manual_seed(3)
    logits = torch.randn(4, 50) * 2
    temp = torch.tensor([0.0, 0.7, 1.0, 1.3])
    top_k = torch.tensor([0, 0, 5, 0], dtype=torch.int64)
    top_p = torch.tensor([1.0, 1.0, 1.0, 0.6])
    p = spec.filtered_probs(logits, temp, top_k, top_p)
    torch.testing.assert_close(p.sum(-1), torch.ones(4))
    assert float(p[0].max()) == 1.0 and int(p[0].argmax()) == int(logits[0].argmax())
    torch.testing.assert_close(p[1], torch.softmax(logits[1] / 0.7, -1))
    assert int((p[2] > 0).sum()) == 5
    assert torch.equal(spec.filtered_probs(logits, temp, top_k, top_p, batch_invariant=True) > 0, p > 0)
    # the sampler never draws outside the support, over many counters
    n = 2000
    rows = logits[3:4].expand(n, -1)
    tok, _ = sample(rows, temp[3:4].expand(n), top_k[3:4].expand(n), top_p[3:4].expand(n),
                    torch.full((n,), 9, dtype=torch.int64), torch.arange(n))
    assert bool((p[3][tok] > 0).all())


def test_accept_drafts_checks_shapes():
    with pytest.raises(ValueError, match="base_tokens"):
        spec.accept_drafts(torch.zeros(2, 3, dtype=torch.int64), torch.zeros(2, 3, dtype=torch.int64),
                           torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.bool))
    with pytest.raises(ValueError, match="sampled rows need"):
        spec.accept_drafts(torch.zeros(2, 4, dtype=torch.int64), torch.zeros(2, 3, dtype=torch.int64),
                           torch.zeros(2, dtype=torch.int64), torch.ones(2, dtype=torch.bool))

"""Graph-mode plans of several new tokens per sequence (``Capacity.tokens_per_seq``: the shapes a speculative
verification's CUDA graph will capture), on the CPU: for random steps of 1..q tokens per sequence (window closes of
both ratios, block ends, a sequence at position 3) the padded plan's logits equal the eager plan's up to float32
rounding (the GEMMs see another row count), both write the same cache slots with the same values up to that
rounding, and every step of one capacity fills a buffer of the same size."""

from __future__ import annotations

import random

import pytest
import torch

from deepinfer.models.deepseek_v4 import DeepseekV4ForCausalLM
from deepinfer.models.deepseek_v4.plan import Capacity, SeqStep

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

# 127: the next token ends block 0; 3: short of the first CSA window; 254: the window of 3+ new tokens spans
# three blocks
LENS = [150, 90, 127, 3, 254]
TABLES = [(0, 1, 2), (3, 4), (5, 6), (7,), (8, 9, 10)]


def _pools(cache) -> list[torch.Tensor]:
    return [t for layer in cache.layers for t in layer.values()]


@pytest.fixture(scope="module")
def prefilled():
    model = DeepseekV4ForCausalLM.from_checkpoint().eval()
    cache = model.allocate_cache(24)
    builder = model.plan_builder(cache)
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for n, table in zip(LENS, TABLES):
            ids = torch.randint(0, 129280, (n,), generator=g).tolist()
            model.forward(builder.build([SeqStep(0, n, table)], ids, [n - 1]), cache)
    return model, cache, builder, [t.clone() for t in _pools(cache)]


def _restore(cache, snap) -> None:
    for t, s in zip(_pools(cache), snap):
        t.copy_(s)


@pytest.mark.parametrize("q", [2, 4, 6])
def test_padded_multi_token_plans_equal_eager_plans(prefilled, q):
    model, cache, builder, snap = prefilled
    cap = Capacity(len(LENS), 8, 1024, tokens_per_seq=q)  # no spare sequence: the per-sequence caps must hold
    rng = random.Random(q)
    sizes = set()
    with torch.inference_mode():
        for trial in range(5):
            qs = [q] * len(LENS) if trial == 0 else [rng.randrange(1, q + 1) for _ in LENS]
            step = [SeqStep(n, k, t) for n, k, t in zip(LENS, qs, TABLES)]
            ids = [rng.randrange(129280) for _ in range(sum(qs))]
            rows = list(range(sum(qs)))
            _restore(cache, snap)
            eager = model.forward(builder.build(step, ids, rows), cache)
            want = [t.clone() for t in _pools(cache)]
            _restore(cache, snap)
            plan = builder.build(step, ids, rows, capacity=cap, finalize=False)
            assert plan.graph and plan.num_rows == cap.num_rows
            sizes.add(plan.input_ids.untyped_storage().nbytes())
            got = model.forward(plan, cache)
            assert got.shape[0] == cap.num_rows
            torch.testing.assert_close(got[:len(rows)], eager, rtol=1e-5, atol=1e-5)
            for w, g, s in zip(want, _pools(cache), snap):
                # the same slots written (padding rows write nothing), values equal up to float32 rounding
                assert torch.equal(w != s, g != s)
                torch.testing.assert_close(g.float(), w.float(), rtol=1e-5, atol=1e-5)
    assert len(sizes) == 1  # one buffer per capacity, whatever the step


def test_capacity_limits_are_checked(prefilled):
    _, _, builder, _ = prefilled
    cap = Capacity(2, 8, 1024, tokens_per_seq=3)
    with pytest.raises(ValueError, match="capacity"):
        builder.build([SeqStep(150, 4, TABLES[0])], [1] * 4, [3], capacity=cap, finalize=False)
    with pytest.raises(ValueError, match="capacity"):
        builder.build([SeqStep(150, 1, TABLES[0])], [1], [0], capacity=Capacity(2, 8, 1024, tokens_per_seq=0))
    with pytest.raises(ValueError, match="out: .* int64 entries to upload, the buffer has 0"):  # not the plan's size
        builder.fill([SeqStep(150, 1, TABLES[0])], [1], [0], cap, torch.empty(0, dtype=torch.int64))


def test_deferred_ring_state_commits_the_same_on_padded_plans(prefilled):
    """Speculative verification's rollback on a padded plan: with the ring state deferred, committing the kept
    positions (``state_commit`` + ``commit_deferred_state``) leaves the same cache as on the eager plan."""
    import numpy as np

    from deepinfer.models.deepseek_v4.compressor import commit_deferred_state
    from deepinfer.models.deepseek_v4.plan import StepSeqs

    model, cache, builder, snap = prefilled
    q = 4
    cap = Capacity(len(LENS), 8, 1024, tokens_per_seq=q)
    rng = random.Random(7)
    with torch.inference_mode():
        for trial in range(4):
            qs = [q] * len(LENS) if trial == 0 else [rng.randrange(1, q + 1) for _ in LENS]
            kept = [rng.randrange(1, k + 1) for k in qs]
            step = [SeqStep(n, k, t) for n, k, t in zip(LENS, qs, TABLES)]
            ids = [rng.randrange(129280) for _ in range(sum(qs))]
            rows = list(range(sum(qs)))
            row_starts = np.cumsum(qs) - np.array(qs)
            width = max(len(t) for t in TABLES)
            tables = np.array([list(t) + [-1] * (width - len(t)) for t in TABLES], dtype=np.int64)
            keep_seqs = StepSeqs(np.array(LENS, dtype=np.int64), np.array(kept, dtype=np.int64), tables)
            caches = []
            for capacity in (None, cap):
                _restore(cache, snap)
                plan = builder.build(step, ids, rows, capacity=capacity, finalize=capacity is None)
                for cp in plan.comp.values():
                    cp.deferred = []
                model.forward(plan, cache)
                commit_deferred_state(plan.comp, builder.state_commit(keep_seqs, row_starts))
                caches.append([t.clone() for t in _pools(cache)])
            names = [k for layer in cache.layers for k in layer]
            for name, w, g, s in zip(names, *caches, snap):
                assert torch.equal(w != s, g != s), (qs, kept, name)
                torch.testing.assert_close(g.float(), w.float(), rtol=1e-5, atol=1e-5)
            # the commit wrote ring state (the test would pass vacuously otherwise)
            assert any(not torch.equal(w, s) for name, w, s in zip(names, caches[0], snap) if "state" in name)


@pytest.mark.parametrize("seed", range(3))
def test_short_step_compressor_lists_equal_the_per_sequence_ones(prefilled, monkeypatch, seed):
    """The vectorised lists of steps of 1..block_size tokens per sequence (``_short_compressor_lists``: plans and
    ring-state commits) equal the per-sequence Python ones, element for element, with and without a capacity and
    with prefix-cache hits."""
    _, _, builder, _ = prefilled
    B = builder.block_size
    monkeypatch.setattr(type(builder), "VECTORISE_FROM", 1)
    rng = random.Random(seed)
    steps = []
    for _ in range(16):
        seqs, next_block = [], 0
        for _ in range(rng.randrange(1, 6)):
            c0 = rng.choice([0, 1, 3, B - 1, B, rng.randrange(0, 700)])
            q = rng.choice([1, 2, 4, 6, rng.randrange(1, B + 1)])
            nb = -(-(c0 + q) // B)
            shared = rng.choice([(c0 // B) * B, ((c0 + q) // B) * B]) if rng.random() < 0.4 else 0
            seqs.append(SeqStep(c0, q, tuple(range(next_block, next_block + nb)), None, shared))
            next_block += nb
        steps.append(seqs)
    vectorised = type(builder)._short_compressor_lists

    def per_sequence(self, c0, L, bt, wbt, w0, starts, m, overlap, capacity, shared=None):
        return self._compressor_lists(c0.tolist(), L.tolist(), bt.tolist(), wbt.tolist(), w0.tolist(),
                                      list(starts), m, overlap, capacity, None if shared is None else shared.tolist())

    for seqs in steps:
        ids = [1] * sum(s.q for s in seqs)
        qmax = max(s.q for s in seqs)
        caps = [None, Capacity(len(seqs) + 1, 8, 1024, tokens_per_seq=qmax)]
        for cap in caps:
            got = {}
            for name, impl in (("vectorised", vectorised), ("per_sequence", per_sequence)):
                monkeypatch.setattr(type(builder), "_short_compressor_lists", impl)
                got[name] = builder._chunks(seqs, ids, [0], 0, cap, checked=True)
            (a, meta_a, *_), (b, meta_b, *_) = got["vectorised"], got["per_sequence"]
            assert meta_a == meta_b and a.keys() == b.keys()
            for k in a:
                assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and (a[k] == b[k]).all(), (k, cap)
        from deepinfer.models.deepseek_v4.plan import StepSeqs

        arrays = StepSeqs.from_list(seqs, B)
        rows = [0]
        for s in seqs[:-1]:
            rows.append(rows[-1] + s.q + rng.randrange(0, 3))
        commits = {}
        for name, impl in (("vectorised", vectorised), ("per_sequence", per_sequence)):
            monkeypatch.setattr(type(builder), "_short_compressor_lists", impl)
            commits[name] = builder.state_commit(arrays, rows)
        for m in commits["vectorised"]:
            for x, y in zip(commits["vectorised"][m], commits["per_sequence"][m]):
                assert torch.equal(x, y)

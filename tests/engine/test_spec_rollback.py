"""Speculative verification's state rollback in the DeepSeek-V4 cache: a step over 1 + k positions whose ring state
is deferred, then committed for a kept prefix only, leaves the cache as if only the kept tokens had been computed
(window KV, compressed entries, indexer keys and the compressors' partial-window rings), fp32 on the CPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deepinfer.forward_batch import ForwardBatch
from deepinfer.models import TINY_CONFIG, DeepseekV4Config, init_parameters
from deepinfer.models.deepseek_v4 import DeepseekV4ForCausalLM
from deepinfer.models.deepseek_v4.compressor import commit_deferred_state
from deepinfer.models.deepseek_v4.plan import Capacity, StepSeqs
from deepinfer_ops.testing.compare import TOLERANCES, assert_close

TOL = TOLERANCES[torch.float32]
pytestmark = pytest.mark.usefixtures("one_cpu_thread")
V = TINY_CONFIG["vocab_size"]


@pytest.fixture(scope="module")
def model():
    c = DeepseekV4Config.from_dict(TINY_CONFIG)
    return DeepseekV4ForCausalLM.from_parameters(c, init_parameters(c, 0))


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(seed))


def _full_logits(model, ids: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    n = ids.numel()
    nb = (n + 127) // 128
    bt = torch.arange(nb, dtype=torch.int32).view(1, nb)
    return model.forward(ForwardBatch(ids, torch.arange(n), [n], [n], bt, rows), model.allocate_cache(nb))


def _verify_then_continue(model, seqs, defer: bool = True, capacity=None) -> list[torch.Tensor]:
    """``seqs``: per sequence ``(prefix ids, kept ids, rejected ids, continuation ids, block ids)``. Prefill the
    prefixes, run ONE step over kept + rejected of every sequence (state deferred, committed for the kept rows;
    ``defer=False``: written as a plain step; ``capacity``: the commit lists at that fixed capacity, as a captured
    commit writes them), then one step over the continuations. Returns the continuation logits of each
    sequence."""
    cache = model.allocate_cache(8)
    for layer in cache.layers:
        for t in layer.values():
            t.fill_(float("nan"))
    width = 4
    bt = torch.full((len(seqs), width), -1, dtype=torch.int32)
    for i, s in enumerate(seqs):
        bt[i, :len(s[4])] = torch.tensor(s[4], dtype=torch.int32)
    n = len(seqs)

    def step(parts: list[torch.Tensor], c0s: list[int], rows_all: bool):
        q = [p.numel() for p in parts]
        li = torch.arange(sum(q)) if rows_all else torch.tensor(np.cumsum(q) - 1)
        batch = ForwardBatch(torch.cat(parts), torch.cat([torch.arange(c, c + k) for c, k in zip(c0s, q)]), q,
                             [c + k for c, k in zip(c0s, q)], bt, li)
        return batch

    pre = [s[0] for s in seqs]
    model.forward(step(pre, [0] * n, False), cache)
    c0 = [p.numel() for p in pre]
    verify = [torch.cat([s[1], s[2]]) for s in seqs]
    builder = model.plan_builder(cache)
    plan = builder.from_forward_batch(step(verify, c0, True))
    if defer:
        for cp in plan.comp.values():
            cp.deferred = []
    model.forward(plan, cache)
    if defer:
        kept = np.array([s[1].numel() for s in seqs], dtype=np.int64)
        q = np.array([v.numel() for v in verify], dtype=np.int64)
        out = None if capacity is None else torch.full((builder.fill_size(capacity),), -7, dtype=torch.int64)
        lists = builder.state_commit(StepSeqs(np.array(c0, dtype=np.int64), kept, bt.numpy().astype(np.int64)),
                                     np.cumsum(q) - q, capacity=capacity, out=out)
        commit_deferred_state(plan.comp, lists)
    c1 = [c + s[1].numel() for c, s in zip(c0, seqs)]
    cont = [s[3] for s in seqs]
    logits = model.forward(step(cont, c1, True), cache)
    out, at = [], 0
    for s in seqs:
        out.append(logits[at:at + s[3].numel()])
        at += s[3].numel()
    return out


def _case(n0: int, kept: int, k: int, seed: int, blocks: list[int], n_cont: int = 6):
    ids = _ids(n0 + kept + n_cont, seed)
    rejected = _ids(k - kept, seed + 100)  # the drafts the target rejected: never part of the sequence
    return ids[:n0], ids[n0:n0 + kept], rejected, ids[n0 + kept:], blocks


# (prefix, kept, verified): a CSA ring (R = 8) row a rejected position would overwrite, block boundaries crossed
# by the kept part or by the rejected part only, and everything kept
CASES = [(10, 1, 4), (10, 3, 6), (125, 2, 4), (126, 3, 6), (60, 4, 4), (253, 1, 6)]


@pytest.mark.parametrize("n0,kept,k", CASES)
def test_rejected_positions_leave_no_trace(model, n0, kept, k):
    s = _case(n0, kept, k, n0 + kept, [3, 0, 5])
    (got,) = _verify_then_continue(model, [s])
    ids = torch.cat([s[0], s[1], s[3]])
    ref = _full_logits(model, ids, torch.arange(n0 + kept, ids.numel()))
    assert_close(got, ref, TOL, name=f"continuation after rollback to {n0 + kept}")


def test_rollback_of_several_sequences_in_one_step(model):
    a = _case(10, 1, 4, 1, [6, 1])
    b = _case(126, 3, 6, 2, [2, 7, 4])
    c = _case(30, 5, 5, 3, [0])
    got = _verify_then_continue(model, [a, b, c])
    for s, g in zip((a, b, c), got):
        ids = torch.cat([s[0], s[1], s[3]])
        start = s[0].numel() + s[1].numel()
        assert_close(g, _full_logits(model, ids, torch.arange(start, ids.numel())), TOL, name="batched rollback")


def test_commit_lists_at_a_larger_capacity_write_the_same_state(model):
    """A captured commit's lists have the lengths of its graph (more sequences, more tokens each, longer
    contexts): the padding writes nowhere; a step that does not fit is refused naming ``capacity``."""
    a = _case(10, 1, 4, 1, [6, 1])
    b = _case(126, 3, 6, 2, [2, 7, 4])
    got = _verify_then_continue(model, [a, b], capacity=Capacity(4, 6, 700, 7))
    for s, g in zip((a, b), got):
        ids = torch.cat([s[0], s[1], s[3]])
        start = s[0].numel() + s[1].numel()
        assert_close(g, _full_logits(model, ids, torch.arange(start, ids.numel())), TOL, name="padded commit")
    builder = model.plan_builder(model.allocate_cache(2))
    seqs = StepSeqs(np.array([3, 4]), np.array([2, 1]), np.array([[0], [1]]))
    for cap in (Capacity(1, 4, 64, 4), Capacity(2, 4, 64, 1), Capacity(2, 4, 4, 4)):
        with pytest.raises(ValueError, match="capacity"):
            builder.state_commit(seqs, np.array([0, 4]), capacity=cap)


def test_without_deferral_a_rejected_position_corrupts_the_ring(model):
    """The test above has teeth: the same step written as a plain step overwrites a CSA ring row still needed."""
    s = _case(10, 1, 4, 11, [3, 0, 5])
    (got,) = _verify_then_continue(model, [s], defer=False)
    ids = torch.cat([s[0], s[1], s[3]])
    ref = _full_logits(model, ids, torch.arange(11, ids.numel()))
    assert not torch.allclose(got, ref, atol=1e-4, rtol=1e-4)


def test_state_commit_checks_its_rows(model):
    builder = model.plan_builder(model.allocate_cache(2))
    seqs = StepSeqs(np.array([3]), np.array([1]), np.array([[0]]))
    with pytest.raises(ValueError, match="row_starts"):
        builder.state_commit(seqs, np.array([0, 1]))

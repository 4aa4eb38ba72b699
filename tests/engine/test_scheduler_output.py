"""The scheduler's output is plain data: ids, tokens per request, new block ids per cache group, finished and
preempted ids, new request data; failures are kinds and messages, records are the engine's."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

import deepinfer_ops
from deepinfer import LLM, SamplingParams
from deepinfer.block_manager import FULL_GROUP, BlockManager
from deepinfer.config import EngineConfig
from deepinfer.engine import error_record
from deepinfer.models import TINY_CONFIG, DeepseekV4Config
from deepinfer.models.deepseek_v4 import Capacity, PlanBuilder, SeqStep
from deepinfer.models.deepseek_v4.plan import StepSeqs
from deepinfer.scheduler import Scheduler, SchedulerOutput
from deepinfer.sequence import RequestFailure, Sequence


def _sched(num_blocks=4, block_size=16, budget=256):
    cfg = EngineConfig(block_size=block_size, num_blocks=num_blocks, max_num_batched_tokens=budget, max_num_seqs=8)
    cfg.validate()
    return Scheduler(cfg, BlockManager(num_blocks, block_size), 1024, eos_token_ids=1)


def _seq(i, n, max_tokens=20):
    return Sequence(i, [3 + j for j in range(n)], SamplingParams(temperature=0, max_tokens=max_tokens), seed=i)


def _apply(s, out, token=7):
    return s.postprocess(out, [token] * out.num_logits, [0.0] * out.num_logits)


def test_output_carries_new_requests_blocks_finished_and_preempted_ids():
    s = _sched()
    a, b = _seq(0, 16), _seq(1, 16)  # each grows to 36 tokens = 3 blocks of a 4-block cache: b is preempted
    s.add(a)
    s.add(b)
    out = s.schedule()
    assert isinstance(out, SchedulerOutput) and out.step_id == 0
    assert [(r.req_id, r.num_new_tokens, r.start, r.needs_logits) for r in out.scheduled] == [(0, 16, 0, True),
                                                                                           (1, 16, 0, True)]
    assert [d.req_id for d in out.new_requests] == [0, 1] and out.new_requests[1].prompt_token_ids == tuple(b.prompt_token_ids)
    assert [dict(r.new_block_ids) for r in out.scheduled] == [{FULL_GROUP: (0,)}, {FULL_GROUP: (1,)}]
    assert all(r.num_draft_tokens == 0 for r in out.scheduled)
    with pytest.raises((AttributeError, TypeError)):
        out.scheduled[0].new_block_ids[FULL_GROUP] = (5,)  # immutable
    with pytest.raises(AttributeError):
        out.scheduled = ()
    seen_blocks = {0: [0], 1: [1]}
    preempted_at = resumed = None
    while s.has_unfinished():
        _apply(s, out)
        out = s.schedule()
        for r in out.scheduled:
            seen_blocks.setdefault(r.req_id, []).extend(r.new_block_ids.get(FULL_GROUP, ()))
        if out.preempted_req_ids and preempted_at is None:
            preempted_at = out.step_id
            assert out.preempted_req_ids == (1,)
            seen_blocks[1] = []  # its blocks were freed: it comes back with new ones
        for d in out.new_requests:
            if d.req_id == 1 and preempted_at is not None:
                resumed = d
                # its context is recomputed: prompt + the outputs it had
                assert d.output_token_ids == (7,) * len(d.output_token_ids) and d.output_token_ids
        if 0 in out.finished_req_ids:
            assert a.is_finished
        for seq in s.running:  # the blocks the outputs announced are the blocks each request holds
            assert seen_blocks[seq.seq_id] == seq.block_table
    assert preempted_at is not None and resumed is not None
    assert a.output_token_ids == [7] * 20 and b.output_token_ids == [7] * 20
    assert out.scheduled == () and out.finished_req_ids == (1,)  # the last output only reports the end


def test_failures_are_kinds_and_the_engine_builds_records():
    s = _sched()
    dup = _seq(0, 4)
    assert s.add(_seq(0, 4)) and not s.add(dup)
    assert dup.failure == RequestFailure("invalid_request", "request id 0 is already in use") and dup.error is None
    assert error_record(RequestFailure("cache_exhausted", "m")) == {
        "type": "invalid_request_error", "code": "cache_exhausted", "message": "m", "param": None, "status_code": 400}
    assert error_record(RequestFailure("nan_logits", "m")) == {"type": "server_error", "code": "nan_logits",
                                                              "message": "m", "param": None, "status_code": 500}
    with pytest.raises(TypeError, match="failure must be a RequestFailure"):
        s.abort(_seq(5, 3), {"code": "x", "message": "y"})
    llm = LLM("tiny")
    with pytest.raises(TypeError, match="error must be a record dict"):
        llm.engine.abort(_seq(6, 3), RequestFailure("x", "y"))
    seq = _seq(7, 3)
    llm.engine.add_request(seq)
    llm.engine.abort(seq, {"type": "invalid_request_error", "code": "client_disconnected", "message": "gone"})
    assert seq.failure.kind == "client_disconnected" and seq.error["code"] == "client_disconnected"
    assert seq.finish_reason == "error"
    assert llm.generate([[]])[0].error == {"type": "invalid_request_error", "code": "invalid_request",
                                           "message": "the prompt is empty", "param": "prompt", "status_code": 400}


def _loop_lists(b, c0, bt, wbt, w0, m, overlap, cap):
    """The per-sequence reference (the loop used for prefill steps) for a decode step."""
    S = len(c0)
    return b._compressor_lists(list(c0), [p + 1 for p in c0], bt.tolist(), wbt.tolist(), list(w0), list(range(S)),
                               m, overlap, cap)


def _random_decode_step(rng, b, S, num_window_blocks, q=None):
    """Positions (window closes, block ends, 0, long contexts; with ``q[i]`` new tokens each, default 1: steps
    crossing a block end), ``full`` tables and ``window`` tables whose blocks before each step's window are
    released (-1), window ids drawn apart from the full ones' order."""
    B = b.block_size
    q = [1] * S if q is None else q
    c0 = [rng.choice([0, 1, 3, 125, 127, 128, 129, 254, 255, 256, rng.randrange(0, 2000)]) for _ in range(S)]
    nb = max(-(-(p + k) // B) for p, k in zip(c0, q))
    blocks = rng.sample(range(b.num_blocks), S * nb)
    bt = np.array([blocks[i * nb:(i + 1) * nb] for i in range(S)], dtype=np.int64)
    wblocks = rng.sample(range(num_window_blocks), S * nb)
    wt = np.array([wblocks[i * nb:(i + 1) * nb] for i in range(S)], dtype=np.int64)
    for i, (p, k) in enumerate(zip(c0, q)):
        wt[i, -(-(p + k) // B):] = -1  # after the table
        wt[i, :b.first_window_block(p)] = -1  # released
    return c0, bt, wt


@pytest.mark.parametrize("graph", [False, True])
def test_vectorised_decode_lists_equal_the_per_sequence_loop(graph):
    """Random decode steps (window closes, block ends, position 0, long contexts) with window tables that released
    their old blocks: the numpy lists equal the per-sequence loop's, entry for entry, for every ratio, eager and at
    a graph capacity; and the plan's window table ``tok_wbt`` / ``win_base`` and token slots equal a per-sequence
    construction."""
    cfg = DeepseekV4Config.from_dict(TINY_CONFIG)
    b = PlanBuilder(cfg, 128, 4096, "cpu", window_blocks=4096)
    B = b.block_size
    rng = random.Random(1)
    for trial in range(40):
        S = rng.randrange(1, 40)
        c0, bt, wt = _random_decode_step(rng, b, S, 4096)
        nb = bt.shape[1]
        cap = Capacity(S + rng.randrange(0, 3), max(nb, 16), 2048) if graph else None
        plan = b.build(StepSeqs(np.array(c0), np.ones(S, dtype=np.int64), bt, wt), [1] * S, list(range(S)),
                       capacity=cap, finalize=False)
        w0 = np.array([b.first_window_block(p) for p in c0], dtype=np.int64)
        nwb = plan.tok_wbt.shape[1]
        if graph:
            assert nwb == -(-b.lookback // B) + 1  # fixed: a decode's window spans at most this many blocks
        ref_wbt = np.full((S + 1, nwb), -1, dtype=np.int64)
        for i, p in enumerate(c0):
            span = wt[i, w0[i]:-(-(p + 1) // B)]
            assert (span >= 0).all()
            ref_wbt[i, :len(span)] = span
        rows = plan.num_rows
        assert np.array_equal(plan.tok_wbt.numpy()[:S], ref_wbt[:S]) and (plan.tok_wbt.numpy()[S:rows] == -1).all()
        assert plan.win_base.tolist()[:S] == w0.tolist()
        assert plan.token_slots.tolist()[:S] == [int(wt[i, p // B]) * B + p % B for i, p in enumerate(c0)]
        bt_pad = np.concatenate([bt, np.full((1, nb), -1, dtype=np.int64)])
        for m, overlap in b.ratios:
            want = _loop_lists(b, c0, bt_pad, ref_wbt, w0, m, overlap, cap)
            c0a = np.array(c0, dtype=np.int64)
            got = b._short_compressor_lists(c0a, c0a + 1, bt_pad, ref_wbt, w0, np.arange(S), m, overlap, cap)
            assert set(got) == set(want)
            for k in want:
                assert np.array_equal(np.asarray(got[k]), np.asarray(want[k])), (trial, m, k)
            # the state rings live in the window group, the compressed entries in the full one
            held_w = set(wt[wt >= 0].tolist())
            assert set((got["ring_src"] // (2 * m if overlap else m)).tolist()) <= held_w | ({0} if graph else set())
            st = got["st_dst"][got["st_dst"] >= 0] // (2 * m if overlap else m)
            assert set(st.tolist()) <= held_w
            dst = got["dst"][got["dst"] >= 0] // (B // m)
            assert set(dst.tolist()) <= set(bt.reshape(-1).tolist())


@pytest.mark.parametrize("max_q", [1, 6])
def test_fill_writes_the_buffer_build_uploads(max_q):
    """Graph mode: ``fill`` (the C++ ``decode_plan_fill``) writes into a captured plan's buffer exactly what the
    numpy ``build`` with the same capacity uploads, entry for entry: random decode steps of one token per sequence
    and verification-shaped steps of 1 to ``max_q`` (window closes, block ends inside the step, position 0, long
    contexts), window tables that released their old blocks, prefix-cache shared lengths, host ids and
    device-tensor ids; and returns the step's token and logits counts."""
    cfg = DeepseekV4Config.from_dict(TINY_CONFIG)
    b = PlanBuilder(cfg, 128, 4096, "cpu", window_blocks=4096)
    B = b.block_size
    rng = random.Random(3 + max_q)
    for trial in range(60):
        S = rng.randrange(1, 30)
        q = [rng.randrange(1, max_q + 1) for _ in range(S)]
        c0, bt, wt = _random_decode_step(rng, b, S, 4096, q)
        cap = Capacity(S + rng.randrange(0, 3), max(bt.shape[1], 16), 2048, max(q) + rng.randrange(0, 2))
        shared = None
        if trial % 3 == 1:  # prefix-cache hits: shared full blocks below each position's block
            shared = np.array([B * rng.randrange(0, p // B + 1) for p in c0], dtype=np.int64)
        seqs = StepSeqs(np.array(c0), np.array(q, dtype=np.int64), bt, wt, shared,
                        None if shared is None else np.zeros(S, dtype=np.int64))
        T = sum(q)
        ids = [rng.randrange(cfg.vocab_size) for _ in range(T)]
        rows = sorted(rng.sample(range(T), rng.randrange(1, T + 1)))
        ref = b.build(seqs, ids, rows, capacity=cap, finalize=False)
        st = ref.input_ids.untyped_storage()
        want = torch.empty(0, dtype=torch.int64).set_(st, 0, (st.nbytes() // 8,)).clone()
        for as_tensor in (False, True):
            out = torch.full_like(want, -7)
            got = b.fill(seqs, torch.tensor(ids) if as_tensor else ids, rows, cap, out)
            assert got == (T, len(rows))
            assert torch.equal(out, want), (trial, as_tensor, (out != want).nonzero()[:5].tolist())
    with pytest.raises(ValueError, match="capacity"):
        b.fill(seqs, ids, rows, Capacity(S - 1 if S > 1 else 0, 16, 2048, cap.tokens_per_seq), out)


def test_state_commit_writes_what_the_per_sequence_lists_write():
    """``state_commit`` (graph-mode lists of the kept tokens, padding writing nowhere) leaves the rings exactly as
    the per-sequence reference lists of the same kept tokens do: random kept lengths, block ends inside them,
    rows of a wider deferred step."""
    import deepinfer_ops

    cfg = DeepseekV4Config.from_dict(TINY_CONFIG)
    b = PlanBuilder(cfg, 128, 512, "cpu", window_blocks=512)
    rng = random.Random(5)
    for trial in range(30):
        S = rng.randrange(1, 12)
        kept = [rng.randrange(1, 7) for _ in range(S)]
        c0, bt, wt = _random_decode_step(rng, b, S, 512, kept)
        seqs = StepSeqs(np.array(c0), np.array(kept, dtype=np.int64), bt, wt)
        row_starts = np.arange(S, dtype=np.int64) * 6  # the deferred step verified 6 tokens per sequence
        got = b.state_commit(seqs, row_starts)
        w0 = np.array([b.first_window_block(p) for p in c0], dtype=np.int64)
        L = np.array(c0) + np.array(kept)
        nwb = int((-(-L // b.block_size) - w0).max())
        wbt = np.array([[wt[i, w0[i] + k] if w0[i] + k < wt.shape[1] else -1 for k in range(nwb)]
                        for i in range(S)], dtype=np.int64)
        wrote = False
        for m, overlap in b.ratios:
            R = 2 * m if overlap else m
            ref = b._compressor_lists(list(c0), L.tolist(), bt.tolist(), wbt.tolist(), w0.tolist(),
                                      row_starts.tolist(), m, overlap, None)
            gen = torch.Generator().manual_seed(trial)
            ring0 = torch.randn(512 * R, 3, generator=gen)
            new = torch.randn(6 * S, 3, generator=gen)
            rings = []
            for ring_src, st_src, st_dst in (got[m], tuple(torch.from_numpy(ref[k]) for k in
                                                           ("ring_src", "st_src", "st_dst"))):
                kv, gate = ring0.clone(), ring0.clone() * 2
                deepinfer_ops.compressor_state_write(kv, gate, new, new * 3, ring_src, st_src, st_dst)
                rings.append((kv, gate))
            assert torch.equal(rings[0][0], rings[1][0]) and torch.equal(rings[0][1], rings[1][1]), (trial, m)
            wrote = wrote or not torch.equal(rings[1][0], ring0)
        assert wrote  # the commit writes something


@pytest.mark.native_errors
def test_decode_plan_fill_names_the_argument_at_fault():
    import deepinfer_ops

    i64 = dict(dtype=torch.int64)
    bt = torch.zeros(1, 2, **i64)
    none = torch.empty(0, **i64)

    def args(out, c=(5,), q=none, cap=1):
        ids = torch.ones(int(q.sum()) if q.numel() else 1, **i64)
        return (out, torch.tensor(c, **i64) if isinstance(c, tuple) else c, q, none, bt, bt, none, ids,
                torch.tensor([0], **i64), 1, cap, 2, 128, 127, [4], [True])

    with pytest.raises(RuntimeError, match="decode_plan_fill: out holds 3 entries"):
        deepinfer_ops.decode_plan_fill(*args(torch.empty(3, **i64)))
    with pytest.raises(RuntimeError, match="decode_plan_fill: c0 must be int64"):
        deepinfer_ops.decode_plan_fill(*args(torch.empty(3, **i64), c=torch.tensor([5], dtype=torch.int32)))
    n, nb, nwb, m = 1, 2, 2, 4
    total = n * (6 + nb + nwb) + n * (2 * m - 1) + n * m + 2 * n + 2 * n * 2 * m + n * m + n
    deepinfer_ops.decode_plan_fill(*args(torch.empty(total, **i64)))  # the right size: fine
    with pytest.raises(RuntimeError, match="reads block column 2 past max_blocks 2"):  # a position past the capacity
        deepinfer_ops.decode_plan_fill(*args(torch.empty(total, **i64), c=(299,)))
    with pytest.raises(RuntimeError, match=r"query_lens\[0\]=3 must be in \[1, 2\]"):
        deepinfer_ops.decode_plan_fill(*args(torch.empty(10 ** 4, **i64), q=torch.tensor([3], **i64), cap=2))
    with pytest.raises(RuntimeError, match="tokens_per_seq must be in"):
        deepinfer_ops.decode_plan_fill(*args(torch.empty(total, **i64), cap=129))


def test_group_check_with_shared_blocks():
    """The vectorised step check: a block read by two sequences (a shared prefix) passes, the same block written by
    one of them or listed twice by one row fails, naming the table."""
    cfg = DeepseekV4Config.from_dict(TINY_CONFIG)
    b = PlanBuilder(cfg, 128, 512, "cpu", window_blocks=512)
    shared = StepSeqs(np.array([300, 300]), np.ones(2, dtype=np.int64), np.array([[0, 1, 2], [0, 1, 3]]),
                      np.array([[-1, 4, 5], [-1, 6, 7]]))
    b.check_arrays(shared)
    written = StepSeqs(np.array([300, 300]), np.ones(2, dtype=np.int64), np.array([[0, 1, 2], [0, 1, 2]]),
                       np.array([[-1, 4, 5], [-1, 6, 7]]))
    with pytest.raises(ValueError, match="block_tables: block 2 is written"):
        b.check_arrays(written)
    twice = StepSeqs(np.array([300]), np.ones(1, dtype=np.int64), np.array([[0, 1, 1]]), np.array([[-1, 4, 5]]))
    with pytest.raises(ValueError, match="lists a block twice"):
        b.check_arrays(twice)


def test_array_and_list_steps_build_the_same_plan_with_window_tables():
    """A mixed step (prefill chunks and decodes) as SeqStep lists and as StepSeqs arrays: every plan field equal."""
    cfg = DeepseekV4Config.from_dict(TINY_CONFIG)
    b = PlanBuilder(cfg, 128, 64, "cpu", window_blocks=32)
    seqs = [SeqStep(300, 1, (0, 1, 2), (-1, 3, 4)), SeqStep(0, 200, (5, 6), (7, 8)),
            SeqStep(300, 20, (9, 10, 11), (-1, 12, 13))]
    arr = StepSeqs.from_list(seqs, 128)
    assert arr.window_tables.tolist() == [[-1, 3, 4], [7, 8, -1], [-1, 12, 13]]
    assert arr.to_list() == seqs
    ids = [1] * 221
    ref = b.build(seqs, ids, [0, 200, 220])
    plan = b.build(arr, ids, [0, 200, 220])
    for name in ("positions", "token_slots", "tok_bt", "tok_wbt", "win_base", "logits_indices"):
        assert torch.equal(getattr(plan, name), getattr(ref, name)), name
    for m in ref.comp:
        for name in ("ring_src", "cur", "w_pos", "dst", "st_src", "st_dst"):
            assert torch.equal(getattr(plan.comp[m], name), getattr(ref.comp[m], name)), (m, name)


def test_array_steps_are_checked_with_the_per_sequence_messages():
    cfg = DeepseekV4Config.from_dict(TINY_CONFIG)
    b = PlanBuilder(cfg, 128, 8, "cpu")
    good = StepSeqs(np.array([129, 128]), np.array([1, 1]), np.array([[0, 1], [0, 2]]))
    b.check_arrays(good)  # a shared full prefix block is fine
    # released window blocks (-1 before the window) are not read; a window block read by two sequences and written by
    # none is fine too
    b.check_arrays(StepSeqs(np.array([300, 129]), np.array([1, 1]), np.array([[0, 1, 2], [3, 4, -1]]),
                            np.array([[-1, 5, 6], [5, 7, -1]])))
    plan = b.build(good, [5, 6], [0, 1])
    ref = b.build([SeqStep(129, 1, (0, 1)), SeqStep(128, 1, (0, 2))], [5, 6], [0, 1])
    assert plan.tok_bt.tolist() == ref.tok_bt.tolist() and plan.token_slots.tolist() == ref.token_slots.tolist()
    for seqs, msg in [
        (StepSeqs(np.array([0, 0]), np.array([3, 1]), np.array([[0], [0]])), r"block 0 is written by sequence 1"),
        (StepSeqs(np.array([200]), np.array([1]), np.array([[1, 1]])), r"sequence 0 lists a block twice"),
        (StepSeqs(np.array([0]), np.array([1]), np.array([[9]])), r"sequence 0 uses a block id outside"),
        (StepSeqs(np.array([200]), np.array([1]), np.array([[1, -1]])), r"sequence 0 needs 2 blocks"),
        (StepSeqs(np.array([0]), np.array([0]), np.array([[1]])), r"query_lens\[0\]"),
        # window group: a block written by two sequences, a released (-1) block inside the window, a short row
        (StepSeqs(np.array([300, 300]), np.array([1, 1]), np.array([[0, 1, 2], [3, 4, 5]]),
                  np.array([[-1, 1, 2], [-1, 3, 2]])), r"window_block_tables: block 2 is written by sequence 1"),
        (StepSeqs(np.array([200]), np.array([1]), np.array([[0, 1]]), np.array([[-1, 1]])),
         r"window_block_tables: sequence 0 uses a block id outside"),
        (StepSeqs(np.array([300]), np.array([1]), np.array([[0, 1, 2]]), np.array([[-1, 1]])),
         r"window_block_tables: sequence 0 needs 3 blocks"),
        (StepSeqs(np.array([0]), np.array([1]), np.array([[0]]), np.array([[8]])),
         r"window_block_tables: sequence 0 uses a block id outside \[0, 8\)"),
    ]:
        with pytest.raises(ValueError, match=msg):
            b.check_arrays(seqs)


def test_step_tables_check_agrees_with_the_per_sequence_checks():
    """deepinfer_ops.step_tables_check (check_arrays's C++ verdict) against check_step on random steps whose block
    ids collide often: shared and written blocks, ids out of range, short rows, released window blocks, prefix
    lengths and window floors (valid and not), one or two tables. Both accept or both refuse."""
    cfg = DeepseekV4Config.from_dict(TINY_CONFIG)
    rng = np.random.default_rng(7)
    seen = {True: 0, False: 0}
    for trial in range(1500):
        B = 128
        b = PlanBuilder(cfg, B, 24, "cpu", window_blocks=int(rng.integers(20, 30)))
        S = int(rng.integers(1, 5))
        c0 = rng.integers(0, 3 * B, S)
        q = rng.integers(0 if trial % 50 == 0 else 1, 2 * B, S)
        nb = -(-(c0 + q) // B)
        width = int(nb.max() + rng.integers(-1 if trial % 9 == 0 else 0, 2))

        def table(limit):  # distinct ids per step, then a few faults: shared prefixes, repeats, ids out of range
            t = rng.permutation(30)[:S * max(width, 1)].reshape(S, -1)[:, :width] % limit
            for _ in range(int(rng.integers(0, 3))):
                i, j, c = rng.integers(0, S), rng.integers(0, S), rng.integers(0, max(width, 1))
                if width:
                    t[i, c] = [t[j, c], t[i, 0], -1, limit][int(rng.integers(0, 4))]
            return t

        bt = table(24)
        wt = table(30) if trial % 2 else None
        shared = floor = None
        if trial % 3 == 0:
            shared = rng.choice([0, 0, B, 2 * B, 50], S)
            floor = rng.choice([0, 0, B, 2 * B, 3 * B, 7], S) if wt is not None else np.zeros(S, dtype=np.int64)
        seqs = StepSeqs(c0, q, bt, wt, shared, floor)
        try:
            b.check_step(seqs.to_list())
            ref = True
        except ValueError:
            ref = False
        try:
            b.check_arrays(seqs)
            got = True
        except ValueError:
            got = False
        assert got == ref, (trial, c0, q, bt, wt, shared, floor)
        seen[ref] += 1
    assert min(seen.values()) > 100, seen  # both verdicts are exercised


def test_step_tables_check_refuses_bad_arguments_naming_them():
    i64 = dict(dtype=torch.int64)
    one, none = torch.ones(1, **i64), torch.empty(0, **i64)
    bt = torch.zeros(1, 2, **i64)
    args = [one, one, bt, torch.empty(0, 0, **i64), none, none, 128, 127, 8, 8, 1024]
    assert deepinfer_ops.step_tables_check(*args)
    with pytest.raises(RuntimeError, match="step_tables_check: c0 must be int64"):
        deepinfer_ops.step_tables_check(one.int(), *args[1:])
    with pytest.raises(RuntimeError, match="step_tables_check: block_tables must be 2-D"):
        deepinfer_ops.step_tables_check(one, one, one, *args[3:])
    with pytest.raises(RuntimeError, match="window_tables must be empty or have 1 rows"):
        deepinfer_ops.step_tables_check(one, one, bt, torch.zeros(2, 2, **i64), *args[4:])
    with pytest.raises(RuntimeError, match=r"shared_len must be empty or \[1\]"):
        deepinfer_ops.step_tables_check(one, one, bt, args[3], torch.zeros(3, **i64), *args[5:])
    assert not deepinfer_ops.step_tables_check(one, one, bt, args[3], none, none, 128, 127, 8, 8, 1)  # past max
    with pytest.raises(RuntimeError, match="max_positions >= 0"):
        deepinfer_ops.step_tables_check(one, one, bt, args[3], none, none, 128, 127, 8, 8, -2 ** 63)


def test_check_arrays_takes_any_integer_layout_and_names_what_it_refuses():
    """Reversed views (a length-1 axis keeps its negative stride), read-only and int32 arrays pass as the same step
    in int64; a 0-d c0 is a shape error, a uint64 entry past int64 a value error (not a disagreement of the
    rules)."""
    b = PlanBuilder(DeepseekV4Config.from_dict(TINY_CONFIG), 128, 8, "cpu")
    ro = np.array([[3, 4]])
    ro.flags.writeable = False
    b.check_arrays(StepSeqs(np.array([5])[::-1], np.array([1]), np.array([[3]])))
    b.check_arrays(StepSeqs(np.array([5, 7]), np.array([1, 1]), np.array([[3], [4]])[:, ::-1]))
    b.check_arrays(StepSeqs(np.array([130], dtype=np.int32), np.array([1], dtype=np.uint8), ro))
    with pytest.raises(ValueError, match="StepSeqs needs c0"):
        b.check_arrays(StepSeqs(np.array(5), np.array(1), np.array([[3]])))
    u = np.uint64
    with pytest.raises(ValueError, match="must fit int64"):
        b.check_arrays(StepSeqs(np.array([0], u), np.array([1], u), np.array([[0]], u), None, np.array([2 ** 63], u),
                                np.array([0], u)))

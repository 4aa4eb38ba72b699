"""The scheduler's output is plain data: ids, tokens per request, new block ids per cache group, finished and
preempted ids, new request data; failures are kinds and messages, records are the engine's."""

from __future__ import annotations

import random

import numpy as np
import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.block_manager import KV_GROUP, BlockManager
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
    assert [dict(r.new_block_ids) for r in out.scheduled] == [{KV_GROUP: (0,)}, {KV_GROUP: (1,)}]
    assert all(r.num_draft_tokens == 0 for r in out.scheduled)
    with pytest.raises((AttributeError, TypeError)):
        out.scheduled[0].new_block_ids[KV_GROUP] = (5,)  # immutable
    with pytest.raises(AttributeError):
        out.scheduled = ()
    seen_blocks = {0: [0], 1: [1]}
    preempted_at = resumed = None
    while s.has_unfinished():
        _apply(s, out)
        out = s.schedule()
        for r in out.scheduled:
            seen_blocks.setdefault(r.req_id, []).extend(r.new_block_ids.get(KV_GROUP, ()))
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
    assert error_record(RequestFailure("cache_exhausted", "m")) == {"type": "invalid_request_error",
                                                                   "code": "cache_exhausted", "message": "m"}
    assert error_record(RequestFailure("nan_logits", "m")) == {"type": "server_error", "code": "nan_logits",
                                                              "status_code": 500, "message": "m"}
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
                                           "message": "the prompt is empty"}


def _loop_lists(b, c0, bt, m, overlap, cap):
    """The per-sequence reference (the loop used for prefill steps) for a decode step."""
    S = len(c0)
    return b._compressor_lists(list(c0), [p + 1 for p in c0], bt.tolist(), list(range(S)), m, overlap, cap)


@pytest.mark.parametrize("graph", [False, True])
def test_vectorised_decode_lists_equal_the_per_sequence_loop(graph):
    """Random decode steps (window closes, block ends, position 0, long contexts): the numpy lists equal the
    per-sequence loop's, entry for entry, for every ratio, eager and at a graph capacity."""
    cfg = DeepseekV4Config.from_dict(TINY_CONFIG)
    b = PlanBuilder(cfg, 128, 4096, "cpu")
    rng = random.Random(1)
    for trial in range(40):
        S = rng.randrange(1, 40)
        c0 = [rng.choice([0, 1, 3, 127, 128, 129, 255, 256, rng.randrange(0, 2000)]) for _ in range(S)]
        nb = max(-(-(p + 1) // 128) for p in c0)
        blocks = rng.sample(range(4096), S * nb)
        bt = np.array([blocks[i * nb:(i + 1) * nb] for i in range(S)] + [[-1] * nb], dtype=np.int64)
        cap = Capacity(S + rng.randrange(0, 3), nb, 2048) if graph else None
        for m, overlap in b.ratios:
            want = _loop_lists(b, c0, bt, m, overlap, cap)
            got = b._decode_compressor_lists(np.array(c0, dtype=np.int64), bt, m, overlap, cap)
            assert set(got) == set(want)
            for k in want:
                assert np.array_equal(np.asarray(got[k]), np.asarray(want[k])), (trial, m, k)


def test_array_steps_are_checked_with_the_per_sequence_messages():
    cfg = DeepseekV4Config.from_dict(TINY_CONFIG)
    b = PlanBuilder(cfg, 128, 8, "cpu")
    good = StepSeqs(np.array([129, 128]), np.array([1, 1]), np.array([[0, 1], [0, 2]]))
    b.check_arrays(good)  # a shared full prefix block is fine
    plan = b.build(good, [5, 6], [0, 1])
    ref = b.build([SeqStep(129, 1, (0, 1)), SeqStep(128, 1, (0, 2))], [5, 6], [0, 1])
    assert plan.tok_bt.tolist() == ref.tok_bt.tolist() and plan.token_slots.tolist() == ref.token_slots.tolist()
    for seqs, msg in [
        (StepSeqs(np.array([0, 0]), np.array([3, 1]), np.array([[0], [0]])), r"block 0 is written by sequence 1"),
        (StepSeqs(np.array([200]), np.array([1]), np.array([[1, 1]])), r"sequence 0 lists a block twice"),
        (StepSeqs(np.array([0]), np.array([1]), np.array([[9]])), r"sequence 0 uses a block id outside"),
        (StepSeqs(np.array([200]), np.array([1]), np.array([[1, -1]])), r"sequence 0 needs 2 blocks"),
        (StepSeqs(np.array([0]), np.array([0]), np.array([[1]])), r"query_lens\[0\]"),
    ]:
        with pytest.raises(ValueError, match=msg):
            b.check_arrays(seqs)

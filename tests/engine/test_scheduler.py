"""Scheduler: token budget, chunked prefill, decode batching, admission, preemption, refusals."""

import random

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.block_manager import BlockManager
from deepinfer.config import EngineConfig
from deepinfer.scheduler import Scheduler
from deepinfer.sequence import Sequence, SequenceStatus
from fake_model import FakeConfig, FakeModel, reference_greedy

VOCAB = 512


def _sched(num_blocks=16, block_size=16, budget=64, max_num_seqs=8, max_model_len=1024, **kw):
    cfg = EngineConfig(block_size=block_size, num_blocks=num_blocks, max_num_batched_tokens=budget,
                       max_num_seqs=max_num_seqs, **kw)
    cfg.validate()
    return Scheduler(cfg, BlockManager(num_blocks, block_size), max_model_len, eos_token_ids=1)


def _seq(i, n, max_tokens=8):
    return Sequence(seq_id=i, prompt_token_ids=[3 + (j % 100) for j in range(n)],
                    params=SamplingParams(temperature=0, max_tokens=max_tokens), seed=0)


def _fake_step(s, out, token=7):
    n = out.num_logits
    return s.postprocess(out, [token] * n, [0.0] * n)


def test_chunked_prefill_within_budget_then_decode_batching():
    s = _sched(budget=64)
    long, short = _seq(0, 150), _seq(1, 10)
    s.add(long)
    s.add(short)
    steps = []
    while s.has_unfinished():
        sch = s.schedule()
        assert sch.num_scheduled_tokens <= 64
        steps.append([(it.req_id, it.num_new_tokens) for it in sch.scheduled])
        _fake_step(s, sch)
    # the long prompt is cut into 64-token chunks; the short one is admitted once the budget allows
    assert steps[0] == [(0, 64)]
    assert steps[1] == [(0, 64)]
    assert steps[2] == [(0, 22), (1, 10)]
    # then both decode together, one token each, every step
    assert all(step == [(0, 1), (1, 1)] for step in steps[3:10])
    assert long.num_output_tokens == 8 and short.num_output_tokens == 8
    assert long.finish_reason == "length" and s.block_manager.num_free_blocks == 16


def test_batch_invariant_chunks_end_at_alignment():
    s = _sched(budget=50, batch_invariant=True, prefill_chunk_align=16)
    a = _seq(0, 70)
    s.add(a)
    ends = []
    while a.num_computed_tokens < a.num_prompt_tokens:
        sch = s.schedule()
        ends.append(sch.scheduled[0].start + sch.scheduled[0].num_new_tokens)
        _fake_step(s, sch)
    assert ends == [48, 70]  # 50 cut back to 48 (a multiple of 16); the last chunk ends the prompt


def test_batch_invariant_needs_budget_of_one_chunk():
    with pytest.raises(ValueError, match="prefill_chunk_align"):
        _sched(budget=8, batch_invariant=True, prefill_chunk_align=16)


def test_admission_waits_for_free_blocks_and_max_num_seqs():
    s = _sched(num_blocks=4, block_size=16, budget=512, max_num_seqs=2)
    seqs = [_seq(i, 30, max_tokens=2) for i in range(3)]  # 2 blocks each
    for q in seqs:
        s.add(q)
    sch = s.schedule()
    assert [it.req_id for it in sch.scheduled] == [0, 1]  # max_num_seqs = 2 and only 4 blocks
    assert s.block_manager.num_free_blocks == 0 and seqs[2].status == SequenceStatus.WAITING
    _fake_step(s, sch)  # a schedule is applied before the next one (or, asynchronously, right after it)
    while s.has_unfinished():
        _fake_step(s, s.schedule())
    assert all(q.num_output_tokens == 2 for q in seqs)


def test_refusals_are_error_records():
    s = _sched(num_blocks=4, block_size=16, max_model_len=100)
    too_long = _seq(0, 95, max_tokens=8)  # 103 > 100
    too_big = _seq(1, 60, max_tokens=8)  # 68 tokens -> 5 blocks > 4
    empty = _seq(2, 0)
    assert not s.add(too_long) and too_long.failure.kind == "context_length_exceeded"
    assert not s.add(too_big) and too_big.failure.kind == "cache_exhausted"
    assert not s.add(empty) and empty.failure.kind == "invalid_request"
    assert "103 exceeds the model's context length (100)" in too_long.failure.message
    # the scheduler reports kinds, never records: those are the engine's
    assert too_long.error is None and too_long.finish_reason == "error"
    assert not s.has_unfinished()


def test_preemption_by_recompute_keeps_outputs():
    s = _sched(num_blocks=4, block_size=16, budget=256)
    a, b = _seq(0, 16, max_tokens=20), _seq(1, 16, max_tokens=20)  # each grows to 36 tokens = 3 blocks
    s.add(a)
    s.add(b)
    while s.has_unfinished():
        _fake_step(s, s.schedule())
        assert s.block_manager.num_free_blocks + len(a.block_table) + len(b.block_table) == 4
    assert s.num_preemptions >= 1 and b.num_preemptions >= 1
    assert a.output_token_ids == [7] * 20 and b.output_token_ids == [7] * 20


# ------------------------------------------------------------------ engine level, through the fake model
def _llm(block_size=16, num_blocks=64, budget=64, vocab=VOCAB, max_len=2048, **kw):
    model = FakeModel(FakeConfig(vocab_size=vocab, max_position_embeddings=max_len), block_size=block_size)
    return model, LLM(model, block_size=block_size, num_blocks=num_blocks, max_num_batched_tokens=budget, **kw)


def _prompts(n, lo, hi, seed=0):
    r = random.Random(seed)
    return [[r.randrange(2, VOCAB) for _ in range(r.randrange(lo, hi))] for _ in range(n)]


def test_engine_preemption_and_exhaustion_complete_others():
    model, llm = _llm(num_blocks=6, budget=48, max_num_seqs=8)
    prompts = _prompts(5, 10, 40, seed=1)
    prompts.append(list(range(2, 90)))  # 88 + 24 tokens = 7 blocks > 6: refused, not a hang
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24))
    assert outs[-1].error is not None and outs[-1].error["code"] == "cache_exhausted"
    for p, o in zip(prompts[:-1], outs[:-1]):
        assert o.error is None
        assert o.token_ids == reference_greedy(model, p, 24)
    assert llm.scheduler.num_preemptions > 0, "the test must exercise preemption"
    assert llm.block_manager.num_free_blocks == 6


def test_engine_step_token_budget_respected():
    model, llm = _llm(budget=40)
    outs = llm.generate(_prompts(6, 5, 100, seed=2), SamplingParams(temperature=0, max_tokens=5))
    assert all(o.error is None for o in outs)
    assert model.max_tokens_per_call <= 40


def test_any_of_several_eos_ids_stops():
    s = _sched()
    s.eos_token_ids = frozenset({1, 9})
    a = _seq(0, 5)
    s.add(a)
    _fake_step(s, s.schedule(), token=4)
    _fake_step(s, s.schedule(), token=9)
    assert a.output_token_ids == [4] and a.finish_reason == "stop" and a.stop_token_id == 9


def test_context_length_refusal_names_max_tokens():
    from deepinfer import LLM, SamplingParams

    llm = LLM("tiny", num_blocks=8, max_model_len=64)
    out = llm.generate([[5] * 40], SamplingParams(max_tokens=30))[0]
    assert out.error["code"] == "context_length_exceeded" and out.error["param"] == "max_tokens"

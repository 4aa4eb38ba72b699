"""Cache groups: the window group's blocks are released after the sliding window, the model reads window KV and
compressor state only through the window table, and the engine frees both groups (finish, abort, preemption)."""

from __future__ import annotations

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.block_manager import FULL_GROUP, WINDOW_GROUP, BlockManager, CacheGroup, blocks_for
from deepinfer.config import EngineConfig
from deepinfer.models import TINY_CONFIG, DeepseekV4Config, init_parameters
from deepinfer.models.deepseek_v4 import DeepseekV4ForCausalLM, SeqStep
from deepinfer.model_runner import ModelRunner
from deepinfer.models.deepseek_v4.cache import WINDOW_POOLS, CacheSpec
from deepinfer.scheduler import Scheduler
from deepinfer.sequence import Sequence, SequenceStatus
from deepinfer_ops.testing.compare import TOLERANCES, assert_close
from fake_model import FakeModel

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


def _seq(i, n, max_tokens=8):
    return Sequence(seq_id=i, prompt_token_ids=[3 + (j % 100) for j in range(n)],
                    params=SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), seed=0)


def _bm(full=8, window=4, lookback=5, block_size=4):
    return BlockManager(full, block_size, [CacheGroup(FULL_GROUP, full), CacheGroup(WINDOW_GROUP, window, lookback)])


# ---------------------------------------------------------------------------------------------------- block manager
def test_window_blocks_are_released_once_the_window_passes():
    bm = _bm(lookback=3)
    a = _seq(0, 24)
    new = bm.allocate(a, 7)  # step [0, 7): blocks 0, 1 in both groups
    assert new == {FULL_GROUP: [0, 1], WINDOW_GROUP: [0, 1]} and a.block_tables[WINDOW_GROUP] == [0, 1]
    a.num_computed_tokens = 7
    # step [7, 12) reads from 7 - 3 = 4 on: window block 0 (positions 0..3) goes back first, block 2 is new
    assert bm.blocks_needed(a, 12, WINDOW_GROUP) == 1 and bm.blocks_needed(a, 12) == 1
    assert bm.allocate(a, 12) == {FULL_GROUP: [2], WINDOW_GROUP: [2]}
    assert a.block_tables[WINDOW_GROUP] == [-1, 1, 2] and a.block_table == [0, 1, 2]
    assert bm.num_free(WINDOW_GROUP) == 2 and bm.num_free_blocks == 5
    a.num_computed_tokens = 20
    # step [20, 21) reads from 17 on (block 4): blocks 1 and 2 go back, the free list hands out 3 then 0
    assert bm.allocate(a, 21) == {FULL_GROUP: [3, 4, 5], WINDOW_GROUP: [3, 0]}
    assert a.block_tables[WINDOW_GROUP] == [-1, -1, -1, -1, 3, 0] and a.block_table == [0, 1, 2, 3, 4, 5]
    assert bm.num_free(WINDOW_GROUP) == 2
    bm.free(a)
    assert a.block_tables == {} and bm.num_free_blocks == 8 and bm.num_free(WINDOW_GROUP) == 4


def test_can_allocate_counts_the_blocks_a_step_releases_and_every_group():
    bm = _bm(full=8, window=3, lookback=3)
    a, b = _seq(0, 40), _seq(1, 40)
    bm.allocate(a, 8)  # window 0, 1
    bm.allocate(b, 4)  # window 2: the window pool is empty now
    assert bm.num_free(WINDOW_GROUP) == 0
    a.num_computed_tokens = 8
    # a's step [8, 12) reads from 5 on: block 0 is released, so block 2 of a fits although nothing is free
    assert bm.can_allocate(a, 12) and bm.allocate(a, 12)[WINDOW_GROUP] == [0]
    b.num_computed_tokens = 4
    assert bm.can_allocate(b, 8, FULL_GROUP) and not bm.can_allocate(b, 8, WINDOW_GROUP)
    assert not bm.can_allocate(b, 8)
    tables = {k: list(v) for k, v in b.block_tables.items()}
    with pytest.raises(RuntimeError, match="cache group 'window'"):
        bm.allocate(b, 8)
    assert b.block_tables == tables and bm.num_free_blocks == 8 - 4  # nothing changed


def test_free_checks_ownership_in_every_group():
    bm = _bm()
    a, b = _seq(0, 8), _seq(1, 8)
    bm.allocate(a, 4)
    bm.allocate(b, 4)
    b.block_tables[WINDOW_GROUP] = list(a.block_tables[WINDOW_GROUP])  # a corrupted window table
    with pytest.raises(RuntimeError, match="owned by 0"):
        bm.free(b)


@pytest.mark.parametrize("groups,match", [
    ([CacheGroup(WINDOW_GROUP, 4, 3)], "groups\\[0\\]"),
    ([CacheGroup(FULL_GROUP, 4), CacheGroup(FULL_GROUP, 4)], "names must differ"),
    ([CacheGroup(FULL_GROUP, 4), CacheGroup(WINDOW_GROUP, 0, 3)], "num_blocks of group 'window'"),
    ([CacheGroup(FULL_GROUP, 4), CacheGroup(WINDOW_GROUP, 4, 0)], "lookback of group 'window'"),
])
def test_bad_groups_name_the_field(groups, match):
    with pytest.raises(ValueError, match=match):
        BlockManager(4, 4, groups)


def test_peak_blocks_bound_the_window_group():
    bm = _bm(full=100, window=10, lookback=5, block_size=4)
    assert bm.peak_blocks(3, 64) == {FULL_GROUP: 1, WINDOW_GROUP: 1}
    assert bm.peak_blocks(400, 8) == {FULL_GROUP: 100, WINDOW_GROUP: blocks_for(5 + 8, 4) + 1}


def test_allocate_step_reports_released_ids_and_fits_held_waits_for_nothing():
    """``allocate_step`` returns the released window ids with the new ones (a released block may come straight
    back); ``fits_held`` is False as soon as a window block is due back, even when the tables cover the step."""
    bm = _bm(full=8, window=2, lookback=3, block_size=4)
    a = _seq(0, 24)
    assert not bm.fits_held(a, 1)  # no tables yet
    ch = bm.allocate_step(a, 7)
    assert ch.new == {FULL_GROUP: [0, 1], WINDOW_GROUP: [0, 1]} and ch.released == {FULL_GROUP: [], WINDOW_GROUP: []}
    a.num_computed_tokens = 6
    assert bm.fits_held(a, 8)  # [6, 8) reads from 3 on: block 0 is still needed
    a.num_computed_tokens = 7
    assert not bm.fits_held(a, 8)  # [7, 8) reads from 4 on: block 0 is due back
    ch = bm.allocate_step(a, 12)  # the window pool is empty: block 0 goes back and comes straight back
    assert ch.released == {FULL_GROUP: [], WINDOW_GROUP: [0]} and ch.new == {FULL_GROUP: [2], WINDOW_GROUP: [0]}
    assert a.block_tables[WINDOW_GROUP] == [-1, 1, 0]
    a.num_computed_tokens = 12
    ch = bm.allocate_step(a, 13)
    assert ch.released[WINDOW_GROUP] == [1] and ch.new[WINDOW_GROUP] == [1]
    assert a.block_tables[WINDOW_GROUP] == [-1, -1, 0, 1]
    a.num_computed_tokens = 13
    assert bm.fits_held(a, 14)


# ---------------------------------------------------------------------------------------------------- scheduler
def _sched(bm, budget=16, max_num_seqs=4):
    cfg = EngineConfig(block_size=bm.block_size, num_blocks=bm.num_blocks, max_num_batched_tokens=budget,
                       max_num_seqs=max_num_seqs)
    return Scheduler(cfg, bm, 4096, eos_token_ids=1)


def test_preemption_when_the_window_group_runs_out_frees_both_groups():
    """Plenty of full blocks, few window blocks: the scheduler preempts on the window group, every request still
    completes with all its tokens, and both pools are full again at the end. The model runner, fed the scheduler
    outputs alone (new and released block ids per group), holds the scheduler's tables, ``-1`` entries included, so
    no freed block stays in its tables."""
    bm = _bm(full=64, window=8, lookback=5, block_size=4)
    s = _sched(bm, budget=16, max_num_seqs=4)
    runner = ModelRunner(FakeModel(block_size=4), FakeModel(block_size=4).allocate_cache(64), "cpu")
    seqs = [_seq(i, 10 + 3 * i, max_tokens=12) for i in range(4)]
    by_id = {q.seq_id: q for q in seqs}
    for q in seqs:
        assert s.add(q)
    released = skipped = 0
    for _ in range(500):
        if not s.has_unfinished():
            break
        out = s.schedule()
        runner.update_states(out)
        for it in out.scheduled:  # every scheduled step holds the window blocks it reads
            seq = by_id[it.req_id]
            wt = seq.block_tables[WINDOW_GROUP]
            first = max(0, it.start - 5) // 4
            assert all(b >= 0 for b in wt[first:blocks_for(it.start + it.num_new_tokens, 4)])
            released += len(it.released_block_ids.get(WINDOW_GROUP, ()))
            assert FULL_GROUP not in it.released_block_ids  # the full group keeps its blocks
            skipped += not it.new_block_ids and not it.released_block_ids
        for q in s.running:
            st = runner.requests[q.seq_id]
            for g in (FULL_GROUP, WINDOW_GROUP):
                t = runner.block_tables[g]
                assert t.ids[st.slot, :t.num_blocks[st.slot]].tolist() == q.block_tables[g], (q.seq_id, g)
        s.postprocess(out, [7] * out.num_logits, [0.0] * out.num_logits)
    runner.update_states(s.schedule())  # the last finished requests leave the runner
    assert not runner.requests
    assert released > 0 and skipped > 0  # window blocks went back; decodes inside held blocks allocated nothing
    assert not s.has_unfinished() and s.num_preemptions > 0
    assert all(q.finish_reason == "length" and q.num_output_tokens == 12 for q in seqs)
    assert bm.num_free_blocks == 64 and bm.num_free(WINDOW_GROUP) == 8


def test_a_request_the_window_group_cannot_hold_alone_is_refused():
    bm = _bm(full=64, window=2, lookback=5, block_size=4)
    s = _sched(bm, budget=16)
    q = _seq(0, 30)
    assert not s.add(q)
    assert q.status == SequenceStatus.FINISHED and q.failure.kind == "cache_exhausted"
    assert "cache group 'window'" in q.failure.message


# ---------------------------------------------------------------------------------------------------- model
@pytest.fixture(scope="module")
def model():
    c = DeepseekV4Config.from_dict(TINY_CONFIG)
    return DeepseekV4ForCausalLM.from_parameters(c, init_parameters(c, 0)).eval()


def test_model_reads_the_window_group_only_through_its_table(model):
    """A 600-token sequence in chunks then decodes, with its window blocks handed out and released by a block
    manager whose window pool (4 blocks) is far smaller than the context (5 blocks), and every window block the
    sequence does not hold filled with NaN before each step: the logits equal those of one table for both groups
    (fp32 tolerance), so released blocks are never read and the compressor state follows the window table."""
    n = 604
    ids = torch.randint(0, TINY_CONFIG["vocab_size"], (n,), generator=torch.Generator().manual_seed(3))
    steps = [(0, 100), (100, 177), (277, 123), (400, 200), (600, 1), (601, 1), (602, 1), (603, 1)]
    spec = CacheSpec.from_config(model.config, torch.float32)
    bm = BlockManager(8, 128, spec.cache_groups(8, 4))
    seq = Sequence(0, ids.tolist(), SamplingParams(), 0)
    grouped = model.allocate_cache(8, window_blocks=4)
    single = model.allocate_cache(8)
    builder, ref_builder = model.plan_builder(grouped), model.plan_builder(single)
    for c0, q in steps:
        bm.allocate(seq, c0 + q)
        held = {b for b in seq.block_tables[WINDOW_GROUP] if b >= 0}
        for layer in grouped.layers:  # poison the window blocks the sequence does not hold
            for name, pool in layer.items():
                if name in WINDOW_POOLS:
                    for b in set(range(4)) - held:
                        pool[b] = float("nan")
        rows = [q - 1]
        step = SeqStep(c0, q, tuple(seq.block_table), tuple(seq.block_tables[WINDOW_GROUP]))
        got = model.forward(builder.build([step], ids[c0:c0 + q].tolist(), rows), grouped)
        want = model.forward(ref_builder.build([SeqStep(c0, q, tuple(range(blocks_for(c0 + q, 128))))],
                                               ids[c0:c0 + q].tolist(), rows), single)
        assert_close(got, want, TOLERANCES[torch.float32], f"step at {c0}")
        seq.num_computed_tokens = c0 + q
    assert seq.block_tables[WINDOW_GROUP][:3] == [-1, -1, -1]  # positions < 603 - 127 were released


def test_window_table_errors_name_the_field(model):
    cache = model.allocate_cache(8, window_blocks=2)
    b = model.plan_builder(cache)
    with pytest.raises(ValueError, match="window_block_tables: sequence 0 uses a block id outside \\[0, 2\\)"):
        b.build([SeqStep(200, 1, (0, 1), (-1, 5))], [5], [0])
    with pytest.raises(ValueError, match="window_block_tables: sequence 0 needs 2 blocks"):
        b.build([SeqStep(200, 1, (0, 1), (0,))], [5], [0])
    with pytest.raises(ValueError, match="window_block_tables: block 1 is written by sequence 1"):
        b.build([SeqStep(200, 1, (0, 1), (0, 1)), SeqStep(130, 1, (2, 3), (0, 1))], [5, 6], [0, 1])
    with pytest.raises(ValueError, match="window group's \\[0, 2\\)"):
        b.build([SeqStep(0, 1, (4,))], [5], [0])  # one table for both groups: its ids must fit both


# ---------------------------------------------------------------------------------------------------- engine
def test_engine_holds_a_bounded_window_and_returns_every_block():
    """Long prompts through the engine: after every step a running request holds at most the window blocks of its
    last step; the greedy tokens equal a full recompute; both groups are full again at the end."""
    llm = LLM("tiny", max_num_seqs=2, max_num_batched_tokens=256)
    cache = llm.startup["cache"]
    assert cache["groups"][WINDOW_GROUP]["blocks"] == llm.block_manager.groups[1].num_blocks
    assert cache["tokens"] == llm.block_manager.num_blocks * 128
    lb = llm.block_manager.groups[1].lookback
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [[(7 * j) % 5000 + 3 for j in range(700)], [(11 * j) % 5000 + 3 for j in range(300)]]
    seqs = [Sequence(500 + i, p, sp, 0) for i, p in enumerate(prompts)]
    eng = llm.engine
    for q in seqs:
        assert eng.add_request(q)
    while eng.has_unfinished_requests():
        eng.step()
        for q in llm.scheduler.running:
            held = [b for b in q.block_tables[WINDOW_GROUP] if b >= 0]
            assert len(held) <= blocks_for(lb + 256, 128) + 1, held
    bm = llm.block_manager
    assert bm.num_free_blocks == bm.num_blocks and bm.num_free(WINDOW_GROUP) == bm.groups[1].num_blocks
    for q, p in zip(seqs, prompts):
        ctx = list(p)
        for _ in range(sp.max_tokens):
            ctx.append(int(llm.model.forward_full(torch.tensor(ctx, device=llm.model.embed.weight.device))[-1].argmax()))
        assert q.output_token_ids == ctx[len(p):]

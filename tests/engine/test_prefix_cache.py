"""Prefix caching: chain hashes, shared reference-counted blocks, the LRU, window snapshots and the exact replay.

Outputs with a hit equal those without it (bitwise in batch-invariant mode, greedy tokens otherwise), at every
alignment of the divergence point to the window and the compression ratios; no block keeps a reference after a
test; memory held per request is the same with caching on and off. Design: docs/prefix-cache.md.
"""

from __future__ import annotations

import random

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.block_manager import FULL_GROUP, WINDOW_GROUP, BlockManager, CacheGroup
from deepinfer.models import TINY_CONFIG, DeepseekV4Config, init_parameters
from deepinfer.models.deepseek_v4 import DeepseekV4ForCausalLM
from deepinfer.models.deepseek_v4.cache import exact_replay_tokens
from deepinfer.prefix_cache import PrefixCaching, block_hash, cache_salt
from deepinfer.sequence import Sequence
from fake_model import FakeModel

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

B = 128
SALT = cache_salt(model="test")
GREEDY = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)


def _ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 5000) for _ in range(n)]


def _seq(i: int, tokens: list[int]) -> Sequence:
    return Sequence(i, list(tokens), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), 0)


def _no_references(bm: BlockManager) -> None:
    """Every reference returned: each group's pool is entirely free (uncached or in the LRU)."""
    for g in bm.groups:
        assert bm.num_referenced(g.name) == 0, g.name
        assert bm.num_free(g.name) == g.num_blocks, g.name


# ---------------------------------------------------------------------------------------------------- hashes
def test_chain_hash_depends_on_the_salt_and_every_earlier_block():
    a, b = list(range(B)), list(range(1, B + 1))
    h0 = block_hash(SALT, a)
    assert h0 == block_hash(SALT, list(a)) and len(h0) == 32
    assert h0 != block_hash(cache_salt(model="other"), a)
    assert block_hash(h0, b) != block_hash(block_hash(SALT, b), b)  # same block after a different prefix
    assert cache_salt(x=1, y=2) == cache_salt(y=2, x=1)


@pytest.mark.parametrize("salt,replay,match", [(b"", 1, "salt"), ("s", 1, "salt"), (b"s", 0, "prefix_replay_tokens"),
                                               (b"s", True, "prefix_replay_tokens")])
def test_bad_prefix_caching_settings_name_the_field(salt, replay, match):
    with pytest.raises(ValueError, match=match):
        PrefixCaching(salt, replay)


# ---------------------------------------------------------------------------------------------------- one group
def _bm1(num_blocks: int = 8) -> BlockManager:
    return BlockManager(num_blocks, B, prefix_caching=PrefixCaching(SALT, 1))


def _admit(bm: BlockManager, seq: Sequence) -> int:
    """What the scheduler does at admission: take the hit, allocate the rest of the prompt; returns the start."""
    hit = bm.lookup(seq)
    if hit is not None:
        bm.apply_hit(seq, hit)
    bm.allocate(seq, seq.num_tokens)
    start = seq.num_computed_tokens
    seq.num_computed_tokens = seq.num_tokens
    return start


def test_requests_share_blocks_by_reference_and_freed_blocks_stay_cached():
    bm = _bm1()
    p = _ids(1, 3 * B + 5)
    a, b = _seq(0, p), _seq(1, p[:2 * B + 7] + [9] * 40)
    assert _admit(bm, a) == 0 and a.block_table == [0, 1, 2, 3]
    bm.cache_blocks(a)
    assert bm.num_free_blocks == 4
    assert _admit(bm, b) == 2 * B  # blocks 0, 1 shared, block 2 differs
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] not in a.block_table
    assert bm.num_referenced() == 5 and bm.num_free_blocks == 3
    bm.free(a)
    assert bm.num_referenced() == 3  # b still holds the shared ones
    bm.free(b)
    _no_references(bm)
    assert bm.num_cached() == 3  # a's 3 full blocks (b's block 2 and a's block 3 are partial: never hashed)
    c = _seq(2, p[:3 * B] + [4])
    assert _admit(bm, c) == 3 * B and c.block_table[:3] == [0, 1, 2]
    bm.free(c)
    _no_references(bm)


def test_a_hit_leaves_at_least_one_token_to_compute():
    bm = _bm1()
    p = _ids(2, 2 * B)
    a = _seq(0, p)
    _admit(bm, a)
    bm.cache_blocks(a)
    bm.free(a)
    assert bm.lookup(_seq(1, p)).start == B  # both blocks cached, the last one is recomputed for its logits
    assert bm.lookup(_seq(2, p + [1])).start == 2 * B
    assert bm.lookup(_seq(3, p[:B])) is None
    assert bm.lookup(_seq(4, [7] + p[1:])) is None  # the first block differs: nothing after it matches


def test_lru_evicts_the_least_recently_used_cached_block_first():
    bm = _bm1(num_blocks=4)
    seqs = [_seq(i, _ids(10 + i, B + 1)) for i in range(3)]
    for s in seqs:  # each leaves one cached block (its first) and one uncached partial block
        _admit(bm, s)
        bm.cache_blocks(s)
        bm.free(s)
    assert bm.num_cached() == 3 and bm.prefix_stats.evictions == 0
    assert bm.lookup(_seq(9, seqs[0].prompt_token_ids)) is not None
    # 3 new blocks: the uncached free block first, then the cached blocks of seqs[0] and seqs[1] (oldest first)
    big = _seq(5, _ids(20, 3 * B))
    bm.allocate(big, 3 * B)
    assert bm.prefix_stats.evictions == 2
    assert bm.lookup(_seq(9, seqs[0].prompt_token_ids)) is None
    assert bm.lookup(_seq(9, seqs[1].prompt_token_ids)) is None
    assert bm.lookup(_seq(9, seqs[2].prompt_token_ids)).start == B
    bm.free(big)
    _no_references(bm)


def test_caching_off_finds_nothing_and_frees_in_table_order():
    bm = BlockManager(4, B)
    a = _seq(0, _ids(3, 2 * B + 1))
    bm.allocate(a, a.num_tokens)
    a.num_computed_tokens = a.num_tokens
    bm.cache_blocks(a)
    bm.free(a)
    assert bm.lookup(_seq(1, a.prompt_token_ids)) is None and bm.free_blocks == [3, 0, 1, 2]


# ---------------------------------------------------------------------------------------------------- window group
def _bm2(full=16, window=8, lookback=127, replay=300, exact=True) -> BlockManager:
    return BlockManager(full, B, [CacheGroup(FULL_GROUP, full), CacheGroup(WINDOW_GROUP, window, lookback)],
                        PrefixCaching(SALT, replay, exact))


def _run_to(bm: BlockManager, seq: Sequence, end: int, step: int = B) -> None:
    """Compute ``seq`` up to position ``end`` in steps (window blocks released as it goes)."""
    while seq.num_computed_tokens < end:
        bm.cache_blocks(seq)
        target = min(end, seq.num_computed_tokens + step)
        bm.allocate(seq, target)
        seq.num_computed_tokens = target


def test_window_blocks_older_than_the_window_are_not_kept_except_snapshots():
    """A 6-block prompt computed in block steps: the window blocks it releases go back uncached, except the one
    ending at the prompt's last full block; at the end the window before its last full boundary is kept."""
    bm = _bm2()
    a = _seq(0, _ids(4, 5 * B + 10))
    _run_to(bm, a, a.num_tokens)
    assert bm.num_cached(WINDOW_GROUP) == 0
    a.output_token_ids = _ids(5, 2 * B)  # decoding on: the window leaves the prompt's last full block (4)
    _run_to(bm, a, a.num_tokens)
    assert bm.num_cached(WINDOW_GROUP) == 1
    bm.free(a)
    _no_references(bm)
    assert bm.num_cached(WINDOW_GROUP) == 2 and bm.num_cached() == 7  # + the window of block 6; 7 full blocks
    # the next turn resumes at the end of the first one's last full block, the prompt alone at its end
    nxt = _seq(1, a.prompt_token_ids + a.output_token_ids + [3] * 50)
    hit = bm.lookup(nxt)
    assert (hit.start, hit.shared, hit.window_floor) == (7 * B, 7 * B, 0)
    assert set(hit.ids[WINDOW_GROUP]) == {6} and len(hit.ids[FULL_GROUP]) == 7
    hit = bm.lookup(_seq(2, a.prompt_token_ids + [3] * 50))
    assert (hit.start, hit.shared) == (5 * B, 5 * B) and set(hit.ids[WINDOW_GROUP]) == {4}


def test_a_hit_without_a_snapshot_replays_from_a_block_boundary():
    bm = _bm2(replay=300)
    a = _seq(0, _ids(6, 8 * B))
    _run_to(bm, a, a.num_tokens)
    bm.free(a)  # a window snapshot at 8 blocks (the end of its prompt and context)
    b = _seq(1, a.prompt_token_ids[:6 * B + 3] + [2] * 200)
    hit = bm.lookup(b)
    # 6 shared blocks, no snapshot at 6: replay from floor((768 - 300) / 128) * 128 = 384
    assert (hit.start, hit.shared, hit.window_floor) == (3 * B, 6 * B, 3 * B) and WINDOW_GROUP not in hit.ids
    bm.apply_hit(b, hit)
    assert bm.blocks_needed(b, b.num_tokens, WINDOW_GROUP) == 5  # blocks 3..7; none before the floor
    new = bm.allocate(b, b.num_tokens)
    assert b.block_tables[WINDOW_GROUP][:3] == [-1, -1, -1] and len(new[WINDOW_GROUP]) == 5
    assert len(new[FULL_GROUP]) == 2 and b.block_table[:6] == [hit.ids[FULL_GROUP][j] for j in range(6)]
    b.num_computed_tokens = b.num_tokens
    b.output_token_ids = [5] * B
    # past the branch point (768; its prompt ends in block 7): the replayed window before 768 is kept
    _run_to(bm, b, b.num_tokens)
    bm.free(b)
    _no_references(bm)
    hit = bm.lookup(_seq(2, a.prompt_token_ids[:6 * B + 3] + [8] * 30))
    assert (hit.start, hit.shared, hit.window_floor) == (6 * B, 6 * B, 0)


def test_an_inexact_replay_leaves_no_snapshot_at_its_branch_point():
    bm = _bm2(replay=140, exact=False)
    a = _seq(0, _ids(7, 8 * B))
    _run_to(bm, a, a.num_tokens)
    bm.free(a)
    b = _seq(1, a.prompt_token_ids[:6 * B + 3] + [2] * 200)
    bm.apply_hit(b, bm.lookup(b))
    assert b.num_computed_tokens == 4 * B
    bm.allocate(b, b.num_tokens)
    b.num_computed_tokens = b.num_tokens
    b.output_token_ids = [5] * B
    _run_to(bm, b, b.num_tokens)
    bm.free(b)
    assert bm.lookup(_seq(2, a.prompt_token_ids[:6 * B + 3] + [8] * 30)).start == 4 * B
    _no_references(bm)


def test_a_shared_window_snapshot_is_released_by_each_holder():
    bm = _bm2()
    a = _seq(0, _ids(8, 3 * B + 1))
    _run_to(bm, a, a.num_tokens)
    bm.free(a)
    b, c = (_seq(i, a.prompt_token_ids + [i] * 20) for i in (1, 2))
    for s in (b, c):
        bm.apply_hit(s, bm.lookup(s))
        bm.allocate(s, s.num_tokens)
        s.num_computed_tokens = s.num_tokens
    snap = b.block_tables[WINDOW_GROUP][2]
    assert snap == c.block_tables[WINDOW_GROUP][2] and bm.num_referenced(WINDOW_GROUP) == 3
    b.output_token_ids = [1] * (2 * B)
    _run_to(bm, b, b.num_tokens)  # b's window leaves the snapshot: c still holds it
    assert b.block_tables[WINDOW_GROUP][2] == -1 and snap in c.block_tables[WINDOW_GROUP]
    bm.free(c)
    bm.free(b)
    _no_references(bm)


# ---------------------------------------------------------------------------------------------------- engine, fake
def _fake_llm(caching: bool, num_blocks: int, **kw) -> LLM:
    return LLM(FakeModel(), enable_prefix_caching=caching, num_blocks=num_blocks, max_model_len=2048, **kw)


def test_fake_engine_sharing_diverging_and_preempting_equals_caching_off():
    """The fake model reads each context back through its block table: shared blocks, hits and preemption of
    requests holding shared blocks give the tokens a run without caching gives, and every reference returns."""
    base = _ids(30, 3 * B + 20)
    prompts = [base[:B + 40] + _ids(31 + i, 50) for i in range(3)] + [base, base, base[:2 * B] + [3]]
    sp = SamplingParams(temperature=0, max_tokens=150, ignore_eos=True)
    ref = _fake_llm(False, 40).generate(prompts, sp)
    llm = _fake_llm(True, 14, max_num_seqs=6, max_num_batched_tokens=256)
    warm = llm.generate([base[:2 * B + 1]], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))[0]
    outs = llm.generate(prompts, sp)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert sum(o.num_preemptions for o in outs) > 0 and warm.num_cached_tokens == 0
    assert all(o.num_cached_tokens >= B for o in outs) and outs[5].num_cached_tokens == 2 * B
    _no_references(llm.block_manager)


def test_fake_engine_eviction_under_memory_pressure():
    llm = _fake_llm(True, 6, max_num_seqs=1)
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompts = [_ids(40 + i, 2 * B + 10) for i in range(4)]
    first = [llm.generate([p], sp)[0] for p in prompts]
    assert llm.block_manager.prefix_stats.evictions > 0
    again = [llm.generate([p], sp)[0] for p in (prompts[0], prompts[3])]
    assert again[0].num_cached_tokens == 0 and again[1].num_cached_tokens == 2 * B  # evicted / still cached
    assert [o.token_ids for o in again] == [first[0].token_ids, first[3].token_ids]
    _no_references(llm.block_manager)


# ---------------------------------------------------------------------------------------------------- engine, V4
_MODELS: dict[int, DeepseekV4ForCausalLM] = {}


def _model(window: int) -> DeepseekV4ForCausalLM:
    """The tiny config (4 layers: sliding, CSA 4, HCA 128, CSA 4) with sliding window ``window``, fp32."""
    if window not in _MODELS:
        c = DeepseekV4Config.from_dict(dict(TINY_CONFIG, sliding_window=window))
        _MODELS[window] = DeepseekV4ForCausalLM.from_parameters(c, init_parameters(c, 0)).eval()
    return _MODELS[window]


def _v4_llm(window: int, caching: bool, batch_invariant: bool = True, **kw) -> LLM:
    opts = dict(num_blocks=40, max_model_len=1536, max_num_batched_tokens=256, max_num_seqs=8)
    opts.update(kw)
    return LLM(_model(window), batch_invariant=batch_invariant, enable_prefix_caching=caching, **opts)


def _out(o):
    return o.token_ids, o.logprobs


def test_exact_replay_bound_of_the_tiny_configs():
    assert exact_replay_tokens(_model(128).config) == 4 * 127
    assert exact_replay_tokens(_model(8).config) == 4 * 7
    assert exact_replay_tokens(_model(3).config) == 4 * 4  # a CSA ring holds 4 positions before the hit


# (warm prompt length, divergence point, expected cached tokens): the warm request ends 1 token past its prompt
# (2 output tokens, the last one never computed), keeping window snapshots at its prompt's and its end's last
# full block boundary; a hit elsewhere replays 4 x 127 positions (from a block boundary) or starts at 0.
ALIGNMENTS = [
    (100, 100, 0),  # H < 128: nothing to share
    (128, 128, 128),  # a block exactly, snapshot at the end
    (130, 129, 128),  # D mod 4 = 1, just past a window
    (131, 131, 128),  # D mod 4 = 3
    (300, 258, 256),  # D mod 4 = 2, two windows
    (384, 388, 384),  # D mod 128 = 4, H mod 128 = 0, snapshot at the prompt end
    (300, 255, 0),  # one shared block, no snapshot there: replayed from 0 (shared, not written)
    (1000, 700, 128),  # 5 shared blocks, no snapshot: replay [128, 640)
]


def test_hits_at_every_alignment_equal_a_cold_run_bitwise():
    cold, warm = _v4_llm(128, False), _v4_llm(128, True)
    end = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    for k, (la, d, cached) in enumerate(ALIGNMENTS):
        base = _ids(100 + k, max(la, d) + 10)
        b = base[:d] + _ids(200 + k, 40)
        warm.generate([base[:la]], end)
        hit = warm.generate([b], GREEDY)[0]
        assert hit.num_cached_tokens == cached, (la, d)
        assert _out(hit) == _out(cold.generate([b], GREEDY)[0]), (la, d)
    # a next turn that re-sends the whole history resumes at its last full block
    base = _ids(99, 255)
    first = warm.generate([base], end)[0]
    nxt = warm.generate([base + first.token_ids + _ids(98, 30)], GREEDY)[0]
    assert nxt.num_cached_tokens == 256
    assert _out(nxt) == _out(cold.generate([base + first.token_ids + _ids(98, 30)], GREEDY)[0])
    _no_references(warm.block_manager)


def _poisoned_run(llm: LLM, prompts: list[list[int]], sp: SamplingParams) -> list[Sequence]:
    """Run ``prompts`` through the engine with every uncached free block of every pool set to NaN before each
    step: a step that reads a block its request does not hold (or a replay reading the window before its floor)
    spreads NaN into the logits."""
    eng, bm = llm.engine, llm.block_manager
    seqs = [Sequence(1000 + i, list(p), sp, 0) for i, p in enumerate(prompts)]
    for s in seqs:
        assert eng.add_request(s)
    while eng.has_unfinished_requests():
        for layer, spec in zip(llm.cache.layers, llm.cache.spec.layers):
            for name, t in layer.items():
                free = sorted(bm._pools[spec.pools[name].group].free)
                if free:
                    t[free] = float("nan")
        eng.step()
    return seqs


def test_replay_with_a_short_window_reads_nothing_it_does_not_hold():
    """Window 8 (replay bound 4 x 7 = 28): hits replay [256, 384) or resume at snapshots; free blocks hold NaN."""
    cold, warm = _v4_llm(8, False), _v4_llm(8, True, num_blocks=24)
    base = _ids(50, 700)
    prompts = [base[:450] + _ids(51, 30), base[:260] + _ids(52, 30), base[:600] + _ids(53, 5)]
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    _poisoned_run(warm, [base[:640]], SamplingParams(temperature=0, max_tokens=140, ignore_eos=True))
    got = _poisoned_run(warm, prompts, sp)
    assert [s.num_cached_tokens for s in got] == [256, 128, 384]
    ref = cold.generate(prompts, sp)
    assert [(s.output_token_ids, s.output_logprobs) for s in got] == [_out(o) for o in ref]
    _no_references(warm.block_manager)


def test_many_requests_sharing_and_diverging_in_one_batch():
    base = _ids(60, 520)
    prompts = [base[:300] + _ids(61 + i, 20 + 7 * i) for i in range(5)] + [base, base[:388], base]
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    cold, warm = _v4_llm(8, False), _v4_llm(8, True, max_num_batched_tokens=128)
    outs = warm.generate(prompts, sp)
    assert [_out(o) for o in outs] == [_out(o) for o in cold.generate(prompts, sp)]
    assert sum(o.num_cached_tokens for o in outs) > 0
    _no_references(warm.block_manager)


def test_preempting_a_request_that_holds_shared_blocks():
    base = _ids(70, 400)
    prompts = [base[:300] + _ids(71 + i, 30) for i in range(3)]
    sp = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
    warm = _v4_llm(8, True, num_blocks=7)
    warm.generate([base[:300]], SamplingParams(temperature=0, max_tokens=1))
    outs = warm.generate(prompts, sp)
    assert sum(o.num_preemptions for o in outs) > 0 and all(o.num_cached_tokens == 256 for o in outs)
    assert [_out(o) for o in outs] == [_out(o) for o in _v4_llm(8, False).generate(prompts, sp)]
    _no_references(warm.block_manager)


def test_greedy_tokens_equal_without_batch_invariance():
    base = _ids(80, 800)
    prompts = [base[:700] + _ids(81, 20), base[:300] + _ids(82, 20)]
    cold, warm = _v4_llm(128, False, False), _v4_llm(128, True, False)
    warm.generate([base], SamplingParams(temperature=0, max_tokens=1))
    outs = [warm.generate([p], GREEDY)[0] for p in prompts]
    assert [o.num_cached_tokens for o in outs] == [128, 0]
    assert [o.token_ids for o in outs] == [o.token_ids for o in cold.generate(prompts, GREEDY)]
    _no_references(warm.block_manager)


def test_a_replay_shorter_than_the_exact_bound_changes_outputs():
    """DeepInfer's 140-token replay on a 4-layer model: layer 4 reads a window that layer 1 computed without its
    own window, so the logits move (why the default is the exact bound)."""
    base = _ids(90, 1000)
    b = base[:700] + _ids(91, 40)
    cold, short = _v4_llm(128, False), _v4_llm(128, True, prefix_replay_tokens=140)
    short.generate([base], SamplingParams(temperature=0, max_tokens=1))
    got = short.generate([b], GREEDY)[0]
    assert got.num_cached_tokens == 384 and got.logprobs != cold.generate([b], GREEDY)[0].logprobs
    _no_references(short.block_manager)


def test_memory_per_token_with_caching_is_not_larger_for_a_single_request():
    p = _ids(95, 700)
    peaks = {}
    for caching in (False, True):
        llm = _v4_llm(128, caching)
        eng, bm = llm.engine, llm.block_manager
        seq = Sequence(1, list(p), SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), 0)
        assert eng.add_request(seq)
        peak = {g.name: 0 for g in bm.groups}
        while eng.has_unfinished_requests():
            eng.step()
            for g in bm.groups:
                peak[g.name] = max(peak[g.name], bm.num_referenced(g.name))
        peaks[caching] = peak
        _no_references(bm)
    assert all(peaks[True][g] <= peaks[False][g] for g in peaks[False]) and peaks[True][FULL_GROUP] == 6


def test_chat_usage_reports_cached_prompt_tokens_and_server_metrics():
    from deepinfer.server.metrics import ServerMetrics

    llm = LLM("tiny", batch_invariant=True)
    text = " ".join(f"w{i}" for i in range(300))
    body = {"model": "tiny", "max_tokens": 2, "temperature": 0, "seed": 5,
            "messages": [{"role": "user", "content": text}]}
    first, again = llm.chat([body])[0], llm.chat([body])[0]
    u0, u = first["usage"], again["usage"]
    assert u0["prompt_tokens_details"]["cached_tokens"] == 0 and u0["prompt_cache_hit_tokens"] == 0
    n = u["prompt_tokens_details"]["cached_tokens"]
    assert n > 0 and n % B == 0 and n < u["prompt_tokens"]
    assert u["prompt_cache_hit_tokens"] == n and u["prompt_cache_miss_tokens"] == u["prompt_tokens"] - n
    assert again["choices"][0]["message"] == first["choices"][0]["message"]
    resp = llm.chat([{"model": "tiny", "max_output_tokens": 2, "temperature": 0, "input": text}], api="responses")[0]
    assert resp["usage"]["input_tokens_details"]["cached_tokens"] > 0
    msg = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "m " + text}]}
    m0, m1 = llm.chat([msg], api="messages")[0]["usage"], llm.chat([msg], api="messages")[0]["usage"]
    assert m0["cache_read_input_tokens"] == 0 and m1["cache_read_input_tokens"] > 0
    _no_references(llm.block_manager)

    metrics = ServerMetrics(lambda: {"running": 0, "waiting": 0, "cache_used_blocks": 0, "cache_blocks": 1})
    for cached in (0, 256):
        seq = Sequence(1, [5] * 300, SamplingParams(), 0)
        seq.num_cached_tokens = cached
        metrics.observe_request(seq)
    text = metrics.render().decode()
    assert "deepinfer_prefix_cache_hits_total 256.0" in text and "deepinfer_prefix_cache_queries_total 600.0" in text
    assert "deepinfer_prefix_cache_hit_rate 0.4266" in text


def test_cli_flags_reach_the_engine_config():
    from deepinfer.cli import build_parser, engine_config

    io = ["--input", "in.jsonl", "--output", "out.jsonl"]
    for argv, want in ((["generate"] + io, (True, None)),
                       (["generate", "--no-enable-prefix-caching"] + io, (False, None)),
                       (["serve", "--prefix-replay-tokens", "140"], (True, 140))):
        args = build_parser().parse_args(argv)
        cfg = engine_config(args)
        assert (cfg.enable_prefix_caching, cfg.prefix_replay_tokens) == want
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--prefix-replay-tokens", "0"] + io)
    with pytest.raises(ValueError, match="prefix_replay_tokens"):
        LLM(FakeModel(), prefix_replay_tokens=0, max_model_len=512)
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        LLM(FakeModel(), enable_prefix_caching=1, max_model_len=512)
    assert LLM(FakeModel(), enable_prefix_caching=False, max_model_len=512).block_manager.caching is False

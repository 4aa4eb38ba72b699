"""The prefix cache's host-memory tier: evicted blocks copied to host memory, restored on a later hit.

Outputs with a restored hit equal a cold run bitwise (batch-invariant mode); copies run in the order the block
manager queued them, so a slot or block reused within one step is read before it is written; no block keeps a
reference after a test. Design: docs/prefix-cache.md ("The host-memory tier").
"""

from __future__ import annotations

import random

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.block_manager import FULL_GROUP, WINDOW_GROUP, BlockManager
from deepinfer.config import EngineConfig
from deepinfer.host_cache import HostCacheTier, HostIndex, SwapOp, host_slots
from deepinfer.models import TINY_CONFIG, DeepseekV4Config, init_parameters
from deepinfer.models.deepseek_v4 import DeepseekV4ForCausalLM
from deepinfer.prefix_cache import PrefixCaching, cache_salt
from deepinfer.sequence import Sequence
from fake_model import FakeModel

from test_prefix_cache import _admit as _admit_prompt
from test_prefix_cache import _ids, _no_references, _seq

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

B = 128
SALT = cache_salt(model="host-tier-test")


# ---------------------------------------------------------------------------------------------------- host index
def test_host_index_is_an_lru_of_slots():
    h = HostIndex(2)
    assert h.put(b"a") == 0 and h.put(b"b") == 1 and len(h) == 2
    assert h.put(b"a") == 0  # already stored: refreshed, b is now the oldest
    assert h.put(b"c") == 1 and b"b" not in h and h.evictions == 1
    slot = h.take(b"a")
    assert slot == 0 and b"a" not in h
    assert h.put(b"d") == 1 and b"c" not in h  # a taken slot stays in use until released: c makes room
    h.release(slot)
    assert h.put(b"e") == slot
    h.discard(b"d")
    h.discard(b"zz")  # not stored: nothing happens
    assert len(h) == 1 and h.free == [1]
    assert (h.stores, h.loads, h.evictions) == (5, 1, 2)
    with pytest.raises(KeyError):
        h.take(b"a")
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="num_slots"):
            HostIndex(bad)


def test_host_slots_mirror_the_device_mix():
    per_block = {FULL_GROUP: 100, WINDOW_GROUP: 1000}
    blocks = {FULL_GROUP: 40, WINDOW_GROUP: 4}
    device = 40 * 100 + 4 * 1000
    assert host_slots(device, per_block, blocks) == blocks  # as much host as device memory: the same blocks
    assert host_slots(device // 2, per_block, blocks) == {FULL_GROUP: 20, WINDOW_GROUP: 2}
    assert host_slots(device // 10, per_block, blocks) == {FULL_GROUP: 4}  # no window slot fits
    assert host_slots(0, per_block, blocks) == {}


# ---------------------------------------------------------------------------------------------------- copies
def _pools(seed: int, blocks: int = 6):
    g = torch.Generator().manual_seed(seed)
    return {FULL_GROUP: [torch.randn(blocks, 3, 5, generator=g), torch.randint(0, 255, (blocks, 7), generator=g,
                                                                               dtype=torch.uint8)],
            WINDOW_GROUP: [torch.randn(blocks, 2, generator=g).to(torch.bfloat16)]}


def test_copies_run_in_order_and_match_a_reference():
    pools = _pools(0)
    tier = HostCacheTier(pools, {FULL_GROUP: 3, WINDOW_GROUP: 2})
    assert tier.nbytes == sum(t[0].numel() * t.element_size() * n for ts, n in
                              ((pools[FULL_GROUP], 3), (pools[WINDOW_GROUP], 2)) for t in ts)
    ref_dev = {g: [t.clone() for t in ts] for g, ts in pools.items()}
    ref_host: dict = {}
    rng = random.Random(1)
    for step in range(40):
        ops: list[SwapOp] = []
        written = set(ref_host)
        for _ in range(rng.randrange(1, 7)):  # slots and blocks reused within one step
            g = rng.choice([FULL_GROUP, WINDOW_GROUP])
            slot = rng.randrange(tier.slots[g])
            kind = rng.choice(["out", "in"]) if (g, slot) in written else "out"
            written.add((g, slot))
            ops.append(SwapOp(kind, g, rng.randrange(6), slot))
        for op in ops:
            if op.kind == "out":
                ref_host[op.group, op.slot] = [t[op.block].clone() for t in ref_dev[op.group]]
            else:
                for t, h in zip(ref_dev[op.group], ref_host[op.group, op.slot]):
                    t[op.block] = h
        tier.apply(ops)
        for g in pools:
            assert all(torch.equal(a, b) for a, b in zip(pools[g], ref_dev[g])), step
        j = rng.randrange(6)  # the device writes a block between steps
        for t, r in zip(pools[FULL_GROUP], ref_dev[FULL_GROUP]):
            t[j] = step % 7
            r[j] = step % 7
    # a clean replay: same ops on fresh pools, checked against the reference at the end
    pools = _pools(2)
    tier = HostCacheTier(pools, {FULL_GROUP: 2, WINDOW_GROUP: 1})
    before = {g: [t.clone() for t in ts] for g, ts in pools.items()}
    ops = [SwapOp("out", FULL_GROUP, 1, 0), SwapOp("out", FULL_GROUP, 2, 1), SwapOp("in", FULL_GROUP, 4, 0),
           SwapOp("out", FULL_GROUP, 3, 0),  # slot 0 reused after it was read
           SwapOp("in", FULL_GROUP, 1, 0), SwapOp("out", WINDOW_GROUP, 5, 0), SwapOp("in", WINDOW_GROUP, 0, 0)]
    tier.apply(ops)
    for i, t in enumerate(pools[FULL_GROUP]):
        b = before[FULL_GROUP][i]
        assert torch.equal(t[4], b[1]) and torch.equal(t[1], b[3]) and torch.equal(t[2], b[2])
        assert torch.equal(t[0], b[0]) and torch.equal(t[5], b[5])
    assert torch.equal(pools[WINDOW_GROUP][0][0], before[WINDOW_GROUP][0][5])
    assert tier.bytes_copied == 5 * tier.block_bytes(FULL_GROUP) + 2 * tier.block_bytes(WINDOW_GROUP)


@pytest.mark.parametrize("op,err", [(SwapOp("up", FULL_GROUP, 0, 0), ValueError),
                                    (SwapOp("out", "other", 0, 0), KeyError),
                                    (SwapOp("out", FULL_GROUP, 6, 0), IndexError),
                                    (SwapOp("in", FULL_GROUP, 0, 3), IndexError),
                                    (SwapOp("in", FULL_GROUP, -1, 0), IndexError)])
def test_a_bad_copy_is_refused_before_any_copy(op, err):
    pools = _pools(3)
    tier = HostCacheTier(pools, {FULL_GROUP: 3})
    before = [t.clone() for t in pools[FULL_GROUP]]
    with pytest.raises(err):
        tier.apply([SwapOp("out", FULL_GROUP, 0, 0), SwapOp("in", FULL_GROUP, 1, 0), op])
    assert all(torch.equal(a, b) for a, b in zip(before, pools[FULL_GROUP]))
    assert tier.bytes_copied == 0
    with pytest.raises(ValueError, match="window"):
        HostCacheTier({FULL_GROUP: pools[FULL_GROUP]}, {WINDOW_GROUP: 1})


# ---------------------------------------------------------------------------------------------------- block manager
def _bm(num_blocks: int, slots: int) -> BlockManager:
    return BlockManager(num_blocks, B, prefix_caching=PrefixCaching(SALT, 1), host_slots={FULL_GROUP: slots})


def _admit(bm: BlockManager, seq: Sequence) -> int:
    """Admit ``seq``'s prompt, then hash its full blocks as the next step would."""
    start = _admit_prompt(bm, seq)
    bm.cache_blocks(seq)
    return start


def test_evicted_blocks_go_to_the_host_tier_and_come_back_on_a_hit():
    bm = _bm(4, 8)
    a = _seq(1, _ids(1, 3 * B + 5))
    _admit(bm, a)
    a_blocks = list(a.block_table)
    bm.free(a)
    assert bm.take_swaps() == () and bm.num_cached() == 3
    b = _seq(2, _ids(2, 4 * B))  # needs every block: a's three cached ones are evicted
    _admit(bm, b)
    outs = bm.take_swaps()
    assert [op.kind for op in outs] == ["out"] * 3 and sorted(op.block for op in outs) == sorted(a_blocks[:3])
    assert bm.num_host_cached() == 3 and bm.take_swaps() == ()
    bm.free(b)
    a2 = _seq(3, a.prompt_token_ids[:3 * B] + _ids(3, 20))
    assert _admit(bm, a2) == 3 * B
    ops = bm.take_swaps()
    ins = [op for op in ops if op.kind == "in"]
    assert len(ins) == 3 and [op.block for op in ins] == a2.block_table[:3]
    # each restore evicted one of b's cached blocks first (its copy-out queued before the copy-in), and the
    # block of the new tokens another
    assert [op.kind for op in ops] == ["out", "in"] * 3 + ["out"]
    by_slot = {op.slot: op for op in outs}
    assert [by_slot[op.slot].block for op in ins] == a_blocks[:3]  # the right content into each table entry
    st = bm.prefix_stats
    assert (st.host_loads, st.host_stores) == (3, 7) and bm.num_host_cached() == 4  # now b's blocks are there
    bm.free(a2)
    _no_references(bm)


def test_a_restore_never_evicts_the_hits_own_blocks_and_is_bounded_by_free_blocks():
    bm = _bm(3, 8)
    a = _seq(1, _ids(1, 3 * B))
    _admit(bm, a)
    bm.free(a)  # 2 blocks hashed (the last position is never computed... all 3 are full and computed)
    hashed = bm.num_cached()
    c = _seq(2, _ids(2, 2 * B + 1))
    _admit(bm, c)  # evicts the oldest cached blocks: a's tail goes first (freed last-first)
    bm.free(c)
    bm.take_swaps()
    a2 = _seq(3, a.prompt_token_ids + [7])
    hit = bm.lookup(a2)
    assert hit is not None and hit.shared == hashed * B
    assert set(hit.ids.get(FULL_GROUP, {})) | set(hit.host.get(FULL_GROUP, {})) == set(range(hashed))
    bm.apply_hit(a2, hit)
    ops = bm.take_swaps()
    held = set(hit.ids.get(FULL_GROUP, {}).values())
    assert all(op.block not in held for op in ops)  # nothing the hit holds was evicted or overwritten
    assert len(set(a2.block_table[:hashed])) == hashed
    bm.free(a2)
    _no_references(bm)
    # a hit needing more restores than there are free blocks stops where the blocks run out
    bm = _bm(3, 8)
    a = _seq(1, _ids(5, 2 * B + 1))
    _admit(bm, a)
    bm.free(a)
    b = _seq(2, _ids(6, 3 * B))
    _admit(bm, b)  # a's 2 full blocks go to the host tier; b holds every device block
    bm.take_swaps()
    assert bm.num_host_cached() == 2
    assert bm.lookup(_seq(3, a.prompt_token_ids)) is None  # no free block to restore into
    bm.free(b)
    hit = bm.lookup(_seq(4, a.prompt_token_ids))
    assert hit is not None and hit.shared == 2 * B and len(hit.host[FULL_GROUP]) == 2


def test_host_slots_need_prefix_caching_and_known_groups():
    with pytest.raises(ValueError, match="needs prefix_caching"):
        BlockManager(4, B, host_slots={FULL_GROUP: 2})
    with pytest.raises(ValueError, match="unknown cache groups"):
        BlockManager(4, B, prefix_caching=PrefixCaching(SALT, 1), host_slots={"other": 2})


# ---------------------------------------------------------------------------------------------------- engine, V4
_MODEL: list = []


def _model() -> DeepseekV4ForCausalLM:
    """The tiny config with a window of 8 (exact replay 28 tokens), fp32."""
    if not _MODEL:
        c = DeepseekV4Config.from_dict(dict(TINY_CONFIG, sliding_window=8))
        _MODEL.append(DeepseekV4ForCausalLM.from_parameters(c, init_parameters(c, 0)).eval())
    return _MODEL[0]


def _llm(host_ratio: float, caching: bool = True, **kw) -> LLM:
    opts = dict(num_blocks=8, max_model_len=1024, max_num_batched_tokens=256, max_num_seqs=4, batch_invariant=True)
    opts.update(kw)
    if host_ratio:
        probe = LLM(_model(), enable_prefix_caching=caching, **opts)
        opts["host_cache_gib"] = host_ratio * probe.cache.nbytes / (1 << 30)
    return LLM(_model(), enable_prefix_caching=caching, **opts)


def _out(o):
    return o.token_ids, o.logprobs


def test_a_prefix_evicted_to_the_host_tier_is_restored_and_outputs_equal_a_cold_run():
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    base = _ids(10, 700)
    prompt = base[:640] + _ids(11, 20)  # diverges at the warm prompt's last full boundary: a window snapshot
    others = [_ids(20 + i, 600) for i in range(2)]
    cold = _llm(0, caching=False).generate([prompt], sp)[0]
    results = {}
    for ratio in (0, 4):
        llm = _llm(ratio)
        llm.generate([base[:640]], SamplingParams(temperature=0, max_tokens=1))
        for o in others:  # each fills the device cache: the prefix's blocks are evicted
            llm.generate([o], SamplingParams(temperature=0, max_tokens=1))
        got = llm.generate([prompt], sp)[0]
        results[ratio] = (got, llm.block_manager.prefix_stats)
        _no_references(llm.block_manager)
    off, on = results[0], results[4]
    assert off[0].num_cached_tokens == 0 and off[1].host_loads == 0
    assert on[0].num_cached_tokens == 640 and on[1].host_loads >= 5
    assert on[1].replayed == 0  # the window snapshot at the prompt's boundary came back too
    assert _out(on[0]) == _out(off[0]) == _out(cold)
    assert on[0].token_ids == cold.token_ids


def test_many_requests_through_a_small_host_tier_keep_outputs_and_references():
    sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    bases = [_ids(30 + k, 600) for k in range(3)]  # three prefixes: more cached blocks than the device holds
    prompts = [bases[i % 3][:300 + 40 * (i % 4)] + _ids(40 + i, 10 + i) for i in range(10)]
    rng = random.Random(4)
    rng.shuffle(prompts)
    llm = _llm(0.5, num_blocks=6)
    cold = _llm(0, caching=False, num_blocks=6)
    got = [llm.generate([p], sp)[0] for p in prompts]
    batched = llm.generate(prompts, sp)
    ref = cold.generate(prompts, sp)
    assert [_out(o) for o in got] == [_out(o) for o in batched] == [_out(o) for o in ref]
    st = llm.block_manager.prefix_stats
    assert st.host_stores > 0 and st.host_loads > 0 and st.hits > 0
    _no_references(llm.block_manager)


@pytest.mark.parametrize("gib,match", [(-1.0, "host_cache_gib must be >= 0"), (float("nan"), "finite"),
                                       ("1", "finite")])
def test_bad_host_cache_settings_name_the_field(gib, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(host_cache_gib=gib).validate()


def test_host_tier_needs_caching_cache_groups_and_room_for_a_block():
    with pytest.raises(ValueError, match="host_cache_gib needs enable_prefix_caching"):
        LLM(_model(), num_blocks=8, max_model_len=1024, enable_prefix_caching=False, host_cache_gib=1.0)
    with pytest.raises(ValueError, match="host_cache_gib=1e-09 holds no cache block"):
        LLM(_model(), num_blocks=8, max_model_len=1024, host_cache_gib=1e-9)
    with pytest.raises(ValueError, match="has no cache groups"):
        LLM(FakeModel(), num_blocks=8, max_model_len=1024, host_cache_gib=1.0)
    llm = LLM(_model(), num_blocks=8, max_model_len=1024, host_cache_gib=0.01)
    assert llm.startup["host_cache"]["bytes"] > 0 and set(llm.startup["host_cache"]["slots"]) == {FULL_GROUP,
                                                                                              WINDOW_GROUP}


def test_cli_flag_reaches_the_engine_config():
    import argparse

    from deepinfer.cli import add_engine_options, engine_config

    p = argparse.ArgumentParser()
    add_engine_options(p)
    assert engine_config(p.parse_args(["--host-cache-gib", "2.5"])).host_cache_gib == 2.5
    assert engine_config(p.parse_args([])).host_cache_gib == 0.0


def test_a_host_tier_larger_than_the_host_memory_is_refused_before_allocating(monkeypatch):
    """``--host-cache-gib 1e6`` used to die in a MemoryError traceback building the slot list, and a figure above
    the free memory was accepted (its pages fill as blocks are evicted, until the OOM killer ends the run)."""
    import deepinfer.llm as L

    with pytest.raises(ValueError, match=r"host_cache_gib=1000000.0 is more than the .* GiB of host memory"):
        LLM(_model(), num_blocks=8, max_model_len=1024, host_cache_gib=1e6)
    monkeypatch.setattr(L, "available_memory", lambda device: 64 << 20)  # 64 MiB free, of which the cache takes some
    with pytest.raises(ValueError, match="host_cache_gib=0.0625 is more than"):
        LLM(_model(), num_blocks=8, max_model_len=1024, host_cache_gib=0.0625)
    assert LLM(_model(), num_blocks=8, max_model_len=1024, host_cache_gib=0.01).startup["host_cache"]["bytes"] > 0


def test_batched_runs_and_slot_spans():
    from deepinfer.host_cache import _runs, _spans

    ops = [SwapOp("out", FULL_GROUP, b, s) for b, s in ((4, 7), (2, 5), (9, 6))]
    ops += [SwapOp("out", FULL_GROUP, 1, 5)]  # slot 5 again: a new run
    ops += [SwapOp("in", FULL_GROUP, 3, 7), SwapOp("in", WINDOW_GROUP, 3, 0), SwapOp("in", WINDOW_GROUP, 3, 1)]
    assert _runs(ops) == [("out", FULL_GROUP, [4, 2, 9], [7, 5, 6]), ("out", FULL_GROUP, [1], [5]),
                          ("in", FULL_GROUP, [3], [7]), ("in", WINDOW_GROUP, [3], [0]),
                          ("in", WINDOW_GROUP, [3], [1])]
    assert _spans([5, 6, 7]) == [(0, 5, 3)]
    assert _spans([0, 2, 3, 9]) == [(0, 0, 1), (1, 2, 2), (3, 9, 1)]


def test_large_batches_of_scattered_slots_match_per_block_copies():
    rng = random.Random(7)
    pools = _pools(5, blocks=40)
    tier = HostCacheTier(pools, {FULL_GROUP: 32, WINDOW_GROUP: 4})
    slots = rng.sample(range(32), 24)
    out = [SwapOp("out", FULL_GROUP, b, s) for b, s in zip(rng.sample(range(40), 24), slots)]
    tier.apply(out)
    for op in out:
        assert all(torch.equal(h[op.slot], d[op.block]) for h, d in zip(tier.host[FULL_GROUP], pools[FULL_GROUP]))
    for t in pools[FULL_GROUP]:
        t.zero_()
    back = [SwapOp("in", FULL_GROUP, b, s) for b, s in zip(rng.sample(range(40), 24), slots)]
    tier.apply(back)
    for op in back:
        assert all(torch.equal(h[op.slot], d[op.block]) for h, d in zip(tier.host[FULL_GROUP], pools[FULL_GROUP]))
    untouched = set(range(40)) - {op.block for op in back}
    assert all(not t[sorted(untouched)].any() for t in pools[FULL_GROUP])
    assert tier.bytes_copied == 48 * tier.block_bytes(FULL_GROUP)

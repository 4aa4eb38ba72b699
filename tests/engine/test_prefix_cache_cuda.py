"""Prefix caching and its host-memory tier on the GPU: the FP8 path with CUDA graphs and async scheduling.

Outputs with a hit (device-cached or restored from pinned host memory on the side stream) equal a cold run:
greedy-identical, and bitwise (logprobs too) in batch-invariant mode. The CPU versions: test_prefix_cache.py,
test_host_cache.py.
"""

from __future__ import annotations

import random

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.block_manager import FULL_GROUP, WINDOW_GROUP
from deepinfer.host_cache import HostCacheTier, SwapOp

pytestmark = pytest.mark.cuda


def _ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 120000) for _ in range(n)]


def _llm(caching: bool, batch_invariant: bool, host_ratio: float = 0.0, **kw) -> LLM:
    opts = dict(device="cuda", num_blocks=10, max_model_len=2048, max_num_seqs=4, max_num_batched_tokens=512,
                batch_invariant=batch_invariant, enable_prefix_caching=caching)
    opts.update(kw)
    if host_ratio:
        probe = LLM("tiny", **opts)
        opts["host_cache_gib"] = host_ratio * probe.cache.nbytes / (1 << 30)
        del probe
    return LLM("tiny", **opts)


def _out(o, bitwise: bool):
    return o.token_ids, (o.logprobs if bitwise else None)


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_cuda_hits_with_graphs_and_async_equal_a_cold_run(batch_invariant):
    base = _ids(1, 1200)
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [base[:640] + _ids(2, 30), base[:1000] + _ids(3, 5), base[:300] + _ids(4, 50), base[:640] + _ids(5, 9)]
    cold = _llm(False, batch_invariant, num_blocks=40)
    warm = _llm(True, batch_invariant, num_blocks=40)
    assert warm.runner.graphs  # decode steps replay graphs
    warm.generate([base[:1100]], SamplingParams(temperature=0, max_tokens=1))
    got = warm.generate(prompts, sp)
    assert sum(o.num_cached_tokens for o in got) > 0
    assert [_out(o, batch_invariant) for o in got] == [_out(o, batch_invariant) for o in cold.generate(prompts, sp)]
    for g in warm.block_manager.groups:
        assert warm.block_manager.num_referenced(g.name) == 0


def test_cuda_host_tier_restores_an_evicted_prefix_bitwise():
    base = _ids(10, 700)
    prompt = base[:640] + _ids(11, 20)
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    cold = _llm(False, True, num_blocks=8).generate([prompt], sp)[0]
    llm = _llm(True, True, host_ratio=4, num_blocks=8)
    assert llm.runner.host_tier.cuda and all(t.is_pinned() for t in llm.runner.host_tier.host[FULL_GROUP])
    llm.generate([base[:640]], SamplingParams(temperature=0, max_tokens=1))
    for i in range(2):  # each fills the device cache: the prefix goes to host memory
        llm.generate([_ids(20 + i, 600)], SamplingParams(temperature=0, max_tokens=1))
    got = llm.generate([prompt], sp)[0]
    st = llm.block_manager.prefix_stats
    assert got.num_cached_tokens == 640 and st.host_loads >= 5 and st.replayed == 0
    assert _out(got, True) == _out(cold, True)


def test_cuda_copies_run_in_order_on_the_side_stream():
    g = torch.Generator(device="cuda").manual_seed(0)
    pools = {FULL_GROUP: [torch.randn(6, 64, 33, device="cuda", generator=g),
                          torch.randint(0, 255, (6, 128), device="cuda", generator=g, dtype=torch.uint8)],
             WINDOW_GROUP: [torch.randn(6, 17, device="cuda", generator=g).to(torch.bfloat16)]}
    before = {k: [t.clone() for t in ts] for k, ts in pools.items()}
    tier = HostCacheTier(pools, {FULL_GROUP: 2, WINDOW_GROUP: 1})
    ops = [SwapOp("out", FULL_GROUP, 1, 0), SwapOp("out", FULL_GROUP, 2, 1), SwapOp("in", FULL_GROUP, 4, 0),
           SwapOp("out", FULL_GROUP, 3, 0), SwapOp("in", FULL_GROUP, 1, 0), SwapOp("out", WINDOW_GROUP, 5, 0),
           SwapOp("in", WINDOW_GROUP, 0, 0)]
    for t, b in zip(pools[FULL_GROUP], before[FULL_GROUP]):  # queued on the compute stream: copies start after
        t[3].mul_(2)
        b[3].mul_(2)
    tier.apply(ops)
    for t in pools[FULL_GROUP]:  # queued after the copies: must see the restored blocks
        t[4].add_(1)
    torch.cuda.synchronize()
    for t, b in zip(pools[FULL_GROUP], before[FULL_GROUP]):
        assert torch.equal(t[4], b[1] + 1) and torch.equal(t[1], b[3]) and torch.equal(t[2], b[2])
        assert torch.equal(t[0], b[0]) and torch.equal(t[5], b[5])
    assert torch.equal(pools[WINDOW_GROUP][0][0], before[WINDOW_GROUP][0][5])

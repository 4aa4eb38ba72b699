"""Speculative decoding on CUDA with its graphs (``spec_graphs.py``): the tiny model, the oracle drafter of
test_spec_engine.py (accepted blocks and partial rejections)."""

from __future__ import annotations

import random

import pytest

from deepinfer.llm import LLM
from deepinfer.sequence import SamplingParams
from test_spec_engine import _use_oracle

pytestmark = pytest.mark.cuda


def _prompts(n: int) -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(3, 120000) for _ in range(rng.randrange(5, 200))] for _ in range(n)]


@pytest.mark.parametrize("schedule", ["fixed", "confidence"])
def test_cuda_spec_graphs_greedy_equals_speculation_off(monkeypatch, schedule):
    """Greedy tokens with the speculation graphs equal speculation off (its decode graphs), for a batch of 8 and
    one running alone; verifications replay graphs, and with the confidence schedule the start-up profile is
    there (graph replay times, plain steps' times)."""
    prompts = _prompts(8)
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    off = LLM("tiny", device="cuda", enforce_eager=False, max_num_seqs=8)
    ref = [o.token_ids for o in off.generate(prompts, sp)]
    _use_oracle(monkeypatch, {tuple(p): r for p, r in zip(prompts, ref)})
    llm = LLM("tiny", device="cuda", enforce_eager=False, max_num_seqs=8, speculative_method="mtp",
              num_speculative_tokens=3, spec_schedule=schedule)
    spec = llm.runner.spec
    assert llm.startup["spec_graphs"] == len(spec.graphs) > 0
    if schedule == "confidence":
        assert spec.graphs.seconds and spec.plain_cost and "speculation_pays" in llm.startup
        spec.plain_cost = {b: 1e9 for b in spec.plain_cost}  # verification always pays: every step speculates
    graph_steps = []
    real = type(spec).execute

    def execute(self, output):
        out = real(self, output)
        graph_steps.append(out.graph)
        return out

    monkeypatch.setattr(type(spec), "execute", execute)
    assert [o.token_ids for o in llm.generate(prompts, sp)] == ref
    assert [o.token_ids for o in llm.generate(prompts[:1], sp)] == ref[:1]
    assert any(graph_steps) and spec.stats.accepted > 0 and spec.stats.accepted < spec.stats.drafted


def test_cuda_spec_graph_memory_is_in_the_estimate():
    """The graph memory measured before the cache is sized covers the speculation graphs too."""
    base = LLM("tiny", device="cuda", enforce_eager=False, max_num_seqs=8).startup["graph_memory_estimate_bytes"]
    spec = LLM("tiny", device="cuda", enforce_eager=False, max_num_seqs=8, speculative_method="mtp",
               num_speculative_tokens=3).startup["graph_memory_estimate_bytes"]
    assert spec > base > 0


@pytest.mark.parametrize("schedule", ["fixed", "confidence"])
def test_cuda_greedy_graph_step_reads_the_device_once(monkeypatch, schedule):
    """A greedy step replaying the speculation graphs keeps its drafts on the device: the draft chain, the
    verification and the MTP pass read the device once (the acceptance; the confidence schedule's confidences
    come with it, and its choice reads none); one read of slack. Each draw was read before: ``k + 2`` reads a
    step."""
    import warnings

    import torch

    prompts = _prompts(4)
    llm = LLM("tiny", device="cuda", enforce_eager=False, max_num_seqs=4, speculative_method="mtp",
              num_speculative_tokens=3, spec_schedule=schedule)
    spec = llm.runner.spec
    if spec.plain_cost:
        spec.plain_cost = {b: 1e9 for b in spec.plain_cost}  # verification always pays: every step speculates
    syncs = []
    real = type(spec).execute

    def execute(self, output):
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                out = real(self, output)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        if out.graph:
            syncs.append(sum("synchroniz" in str(w.message) for w in seen))
        return out

    monkeypatch.setattr(type(spec), "execute", execute)
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    assert syncs and max(syncs) <= 2, syncs

"""Speculation falls back to plain steps where verifying cannot pay (`SpecDecoder.pays`, the confidence schedule):
the decision rule, and engine runs that switch between plain and speculative steps as the batch drains (CPU, tiny
model; the oracle drafter of test_spec_engine.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import deepinfer.spec_cost as sc
import deepinfer.spec_decode as sd
from deepinfer.llm import LLM
from deepinfer.model_runner import ModelRunner
from deepinfer.scheduler import Scheduler
from deepinfer.sequence import SamplingParams
from test_spec_engine import PROMPTS, _use_oracle

pytestmark = pytest.mark.usefixtures("one_cpu_thread", "cpu_accelerator")


class _Runner:
    """The attributes ``SpecDecoder`` reads from a runner."""

    def __init__(self, model):
        self.model, self.builder = model, object()


def _decoder(plain, schedule="confidence", k=3):
    model = LLM("tiny", num_blocks=4, max_num_seqs=1).model
    return sd.SpecDecoder(_Runner(model), k, schedule, cost=lambda n, t: 1.0 + t / 8, plain_cost=plain)


def test_pays_compares_a_full_verification_with_plain_steps():
    d = _decoder({1: 0.5, 4: 0.6, 16: 1.0})
    # one sequence: 1 + 4/8 = 1.5 against 4 x 0.5 = 2; four: 1 + 16/8 = 3 against 2.4; sixteen: 9 against 4
    assert d.pays(1) and not d.pays(3) and not d.pays(4) and not d.pays(16)
    assert d.pays(17)  # past the largest graph bucket plain steps run eagerly too
    assert _decoder(None).pays(16)  # nothing profiled (the CPU): always
    assert _decoder({1: 0.5}, schedule="fixed").plain_cost is None and _decoder({1: 0.5}, "fixed").pays(8)


class _Graphs:
    """The cost side of ``SpecGraphs``: buckets 1 and 4, a step of ``d`` drafts costs ``1 + d / 2`` (0.1 of it the
    MTP pass)."""

    seconds = {"profiled": True}
    buckets = (1, 4)

    def bucket(self, n):
        return next((b for b in self.buckets if b >= n), None)

    def step_seconds(self, n, drafts, mtp=True):
        return None if self.bucket(n) is None else 0.9 + 0.5 * drafts + 0.1 * mtp


def _items(*req_ids):
    return [SimpleNamespace(req_id=r) for r in req_ids]


def test_pays_with_graphs_reads_measured_acceptance_and_step_periods():
    model = LLM("tiny", num_blocks=4, max_num_seqs=1).model
    d = sd.SpecDecoder(_Runner(model), 3, "confidence", plain_cost={1: 1.0, 4: 1.0, 64: 1.0}, graphs=_Graphs())
    # before any verification every draft counts as accepted: 4 tokens per 2.5 s against 1 per 1 s
    assert d.expected_emitted(3) == 4.0 and d.pays(1) and d.pays(4)
    assert not d.pays(8)  # no speculation graph: an eager verification against graph plain steps
    assert d.pays(100)  # past the decode graphs plain steps are eager too
    # a step verifying 3 drafts for 2 sequences (one accepted 2 of them, one had no draft)
    d._measure([3, 0], [3, 1], [1, 1])
    # (accepted + 1) / (verified + 2) per position: the prior keeps one step's rejection from reading as 0
    assert d.accept_rate == pytest.approx([2 / 3, 2 / 3, 1 / 3])
    assert d.expected_emitted(3) == pytest.approx(1 + 2 / 3 + 4 / 9 + 4 / 27)
    # it started at 0 s, the next step of the same requests at 3 s: 0.5 s past its replays (1 + 0.5 * 3)
    d.mark_step(_items(1, 2), "spec", 4, 3, 0.0)
    d.mark_step(_items(1, 2), "spec", 4, 3, 3.0)
    assert d.overhead_samples == {4: [0.5]}
    d.mark_step(_items(1), "spec", None, 3, 10.0)  # other requests (the batch changed): no sample
    d.mark_step(_items(1), "spec", 4, 3, 20.0)  # after an eager step: none either
    assert d.overhead_samples == {4: [0.5]}
    d._last = None
    assert d.graph_step_seconds(1, 3) == 3.0  # bucket 1 takes the figure of a larger bucket as it is
    assert d.graph_step_seconds(16, 0) is None  # past the largest speculation bucket
    d.graphs.buckets = (1, 4, 16)
    assert d.graph_step_seconds(16, 0) == 1.0 + 0.5 * 2  # a larger one scales it by sqrt(16 / 4)
    d.graphs.buckets = (1, 4)
    assert not d.estimate_pays(1)  # 1.67 tokens per 2 s, 2.11 per 2.5 s, 2.26 per 3 s
    for _ in range(50):  # 50 steps accepting both of their 2 drafts: 2.9 tokens per 2.5 s
        d._measure([2], [3], [1])
    assert d.accept_rate[0] > 0.96 and d.accept_rate[2] == pytest.approx(1 / 3) and d.pays(1)
    before = list(d.accept_rate)
    d._measure([3], [1], [1])  # none of three accepted: only the first position verified anything
    assert d.accept_rate[0] < before[0] and d.accept_rate[1:] == before[1:]
    d.accept_rate = [0.9, 1.0, 0.0]

    def slow_step(t, period=4.0, drafts=3):  # a bucket-1 step followed by a plain one: 1.5 s past its replays
        d.mark_step(_items(9), "spec", 1, drafts, t)
        d.mark_step(_items(9), "plain", 1, 0, t + period)
        d._last = None

    slow_step(30.0)
    assert d.overhead_samples[1] == [1.5] and d.stats.first_overheads[1] == [1.5]
    # 2.8 tokens per 3.5 s, 1.9 per 3 s, 2.8 per 4 s: below a plain step. The 8th refusal starts a probe of
    # PROBE_STEPS speculative steps, then the 16th, and so on at every doubling; estimate_pays never probes
    assert not any(d.estimate_pays(1) for _ in range(64)) and not d._refused
    answers = [d.pays(1) for _ in range(1024)]
    assert d.PROBE_STEPS == 3
    assert [i + 1 for i, a in enumerate(answers) if a][:9] == [8, 9, 10, 18, 19, 20, 36, 37, 38]
    assert sum(answers) == 3 * 7  # refusals 8, 16, .., 512 within 1024 answers
    for t in (40.0, 50.0):  # two more slow steps
        slow_step(t)
    assert d.overhead_samples[1] == [1.5, 1.5, 1.5] and not d.estimate_pays(1)
    for t in (60.0, 70.0):  # then two fast ones: the second smallest of five is 0 (the median would be 1.5)
        slow_step(t, period=2.5)
    assert d.overhead_samples[1] == [1.5, 1.5, 1.5, 0.0, 0.0] and d._overhead[1] == 0.0 and d.estimate_pays(1)
    assert d.stats.first_overheads[1] == [1.5, 1.5, 1.5, 0.0, 0.0]
    d._refused.clear()
    d.accept_rate = [0.1, 0.1, 0.1]  # 1.1 tokens per 1.5 s of replays at best: no probe can find a win
    assert not any(d.pays(1) for _ in range(1024)) and d._refused == {}


def test_an_early_rejection_does_not_end_speculation_for_good():
    """The first verification rejects its first draft and the first step carries a one-time cost: the schedule
    refuses, but its probes still run (a rate of 0 would have ended them: no speculative step would measure
    again), and a probe that measures cheap steps and accepted drafts brings speculation back."""
    model = LLM("tiny", num_blocks=4, max_num_seqs=1).model
    # plain steps of 1.4 s; a rate of 0 would emit 1 token per 1.5 s of replays at best: no probe
    d = sd.SpecDecoder(_Runner(model), 3, "confidence", plain_cost={1: 1.4, 4: 1.4}, graphs=_Graphs())
    d._measure([3], [1], [1])  # draft 1 rejected
    assert d.accept_rate == [pytest.approx(1 / 3), None, None]
    d.mark_step(_items(5), "spec", 1, 3, 0.0)
    d.mark_step(_items(5), "spec", 1, 3, 10.0)  # 7.5 s past the replays (a first step's one-time costs)
    assert not d.estimate_pays(1)
    answers = [d.pays(1) for _ in range(8)]
    assert answers == [False] * 7 + [True]  # the 8th refusal starts a probe
    for t in (20.0, 22.5, 25.0, 27.5):  # its steps take 2.5 s (no time past the replays) and accept every draft
        d._measure([3], [4], [1])
        d.mark_step(_items(5), "spec", 1, 3, t)
    assert d.estimate_pays(1)


def test_plain_steps_are_measured_start_to_start_as_speculative_ones():
    model = LLM("tiny", num_blocks=4, max_num_seqs=1).model
    d = sd.SpecDecoder(_Runner(model), 3, "confidence", plain_cost={1: 1.0, 4: 1.0}, graphs=_Graphs())
    d._measure([3], [1], [1])  # no draft accepted: 1 token per 2.5 s of replays
    assert d.plain_step_seconds(1) == 1.0 and d.plain_step_seconds(3) == 1.0 and d.plain_step_seconds(5) is None
    assert not d.estimate_pays(1)
    d.mark_step(_items(7), "plain", 1, 0, 0.0)
    d.mark_step(_items(7), "plain", 1, 0, 3.0)
    assert d.plain_samples == {1: [3.0]} and d.plain_step_seconds(1) == 3.0
    assert d.estimate_pays(1)  # plain steps measured at 3 s (their host time): 1 token per 2.5 s now wins
    d.mark_step(_items(7), "spec", 1, 3, 4.0)  # a plain step before a speculative one: no sample (it waited)
    d.mark_step(_items(7), "plain", None, 0, 9.0)  # an eager plain step: its period is not a graph step's
    d.mark_step(_items(7), "plain", 1, 0, 10.0)
    assert d.plain_samples == {1: [3.0]} and d.overhead_samples == {1: [2.5]}
    for t in (11.0, 12.0, 13.0, 14.0):  # steps of 1 s each (10 s was one)
        d.mark_step(_items(7), "plain", 1, 0, t)
    assert d.plain_samples == {1: [3.0, 1.0, 1.0, 1.0, 1.0]} and d.plain_step_seconds(1) == 1.0
    assert d.plain_step_seconds(4) == 1.0  # another bucket keeps its replay time


def test_choices_that_verify_nothing_switch_speculation_off():
    """A drafter whose drafts the target never takes (random weights): the acceptance rates' prior still promises
    a gain, but each choice, reading the requests' own confidences, verifies no draft, a step dearer than a plain
    one. The bucket's gain (from 1.3, about three steps' memory) falls below 1 and the schedule runs plain steps,
    probing at the refusal doublings; choices that pay again bring speculation back and restart the refusal
    count."""
    model = LLM("tiny", num_blocks=4, max_num_seqs=1).model
    graphs = _Graphs()
    graphs.max_len = 1 << 20
    runner = _Runner(model)
    runner.requests = {7: SimpleNamespace(num_prompt_tokens=4)}
    d = sd.SpecDecoder(runner, 3, "confidence", plain_cost={1: 0.9, 4: 0.9}, graphs=graphs)
    item = SimpleNamespace(req_id=7, start=10, num_new_tokens=4, num_draft_tokens=3, needs_logits=True)
    d.accept_rate = [0.9, None, None]  # 1.9 tokens per 1.5 s of replays at 1 draft against 1 per 0.9 s
    assert d.pays(1) and d._gain == {}
    d.confidences[7] = [1e-4, 1e-4, 1e-4]
    gains = []
    for _ in range(4):  # 1 token per 1 s of a verification of nothing: 0.9 of a plain step's rate
        assert d.estimate_pays(1) and d._lengths([item], [3]) == [0]
        gains.append(d._gain[1])
    assert gains == pytest.approx([1.18, 1.096, 1.0372, 0.99604]) and not d.estimate_pays(1)
    answers = [d.pays(1) for _ in range(20)]
    assert [i + 1 for i, a in enumerate(answers) if a] == [8, 9, 10, 18, 19, 20]  # probes
    d.confidences[7] = [0.99, 0.99, 0.99]  # a probe's choice verifies every draft: 3.94 tokens per 2.5 s
    assert d._lengths([item], [3]) == [3]
    assert d._gain[1] == pytest.approx(0.7 * 0.99604 + 0.3 * 3.940399 / 2.5 * 0.9) and d._gain[1] > 1
    assert d._refused == {} and d.estimate_pays(1)
    # the rate it reads: expected tokens (1.75 + 1 + 2, a confidence above 1 counted as 1) per unit of cost
    assert sc.choose_lengths([[0.5, 0.5], [], [2.0]], sc.CostByLongest([1.0, 1.0, 1.0])) == ([2, 0, 1],
                                                                                          pytest.approx(4.75))
    # a slow plain sample (3 s) makes any verification look cheap, and plain steps then never run to correct it;
    # a plain step costs no more than a graph step verifying no draft without its MTP pass (0.9 + 0.5 s here)
    for t in (100.0, 103.0):
        d.mark_step(_items(7), "plain", 1, 0, t)
    assert d.plain_samples[1] == [3.0] and d.plain_step_seconds(1) == 3.0
    d.mark_step(_items(8), "spec", 1, 3, 200.0)
    d.mark_step(_items(8), "spec", 1, 3, 203.0)  # 0.5 s past its 2.5 s of replays
    assert d.graph_step_seconds(1, 0) == 1.5 and d.plain_step_seconds(1) == pytest.approx(1.4)
    d._gain.clear()
    d.confidences[7] = [1e-4, 1e-4, 1e-4]
    choices = 0
    while d.estimate_pays(1) and choices < 10:  # verifications of nothing: 1.4 / 1.5 of a plain step's rate
        assert d._lengths([item], [3]) == [0]
        choices += 1
    assert choices == 5 and d._gain[1] < 1


def test_every_eighth_choice_that_drops_drafts_verifies_them_all():
    """A confidence bin the choice stops verifying would keep its prior (the raw confidence) for good. While the
    bucket's choices pay, every eighth choice that drops some of a request's drafts verifies them all instead,
    so the bins it avoids are measured; a bin found better than its prior then takes part again. Not while the
    bucket's gain is at or below 1 (probes), and not for a request's first, uninformed choice."""
    model = LLM("tiny", num_blocks=4, max_num_seqs=1).model
    graphs = _Graphs()
    graphs.max_len = 1 << 20
    runner = _Runner(model)
    runner.requests = {7: SimpleNamespace(num_prompt_tokens=4)}

    def decoder():
        return sd.SpecDecoder(runner, 3, "confidence", plain_cost={1: 0.9, 4: 0.9}, graphs=graphs)

    d = decoder()
    item = SimpleNamespace(req_id=7, start=10, num_new_tokens=4, num_draft_tokens=3, needs_logits=True)
    d.accept_rate = [0.9, 0.9, 0.9]
    assert d._lengths([item], [3]) == [3]  # no confidence of its own yet: all, and no count
    d.confidences[7] = [0.95, 0.2, 0.2]  # 1.95 tokens per 1.5 s at one draft, 2.14 per 2 s at two
    chosen = [d._lengths([item], [3])[0] for _ in range(16)]
    assert chosen == [1] * 7 + [3] + [1] * 7 + [3] and d._gain[1] > 1
    # an explored verification accepted every draft: the 0.2 bins at depths 1 and 2 move towards what they see
    before = d.calibrated(1, 0.2)
    for _ in range(4):
        d._lengths([item], [3])
        d._calibrate([item], [3], [4], [1])
    assert d.calibrated(1, 0.2) > before + 0.4 and d._lengths([item], [3]) == [2]  # was 1
    # a bucket whose choices stopped paying never explores: its steps are probes
    d = decoder()
    d.accept_rate, d.confidences[7], d._gain[1] = [0.9, 0.9, 0.9], [0.95, 0.2, 0.2], 0.5
    assert [d._lengths([item], [3])[0] for _ in range(3)] == [1] * 3 and d._gain[1] < 1 and not d._dropped
    d.confidences[7], d._gain[1] = [0.95, 0.2, 0.2], 5.0
    assert [d._lengths([item], [2])[0] for _ in range(8)] == [1] * 7 + [2]  # all it made room for


@pytest.fixture(scope="module")
def reference():
    llm = LLM("tiny", max_num_seqs=8)
    sp = [SamplingParams(max_tokens=4 + 5 * i, temperature=0.0, ignore_eos=True) for i in range(len(PROMPTS))]
    return sp, [o.token_ids for o in llm.generate(PROMPTS, sp)]


@pytest.mark.parametrize("async_", [False, True])
def test_plain_steps_while_the_batch_is_large_then_speculation(monkeypatch, reference, async_):
    """Verification "pays" only at <= 2 running requests: the first steps are plain (and overlap under async
    scheduling), the last ones verify drafts; greedy outputs equal speculation off, nothing leaks."""
    sp, ref = reference
    _use_oracle(monkeypatch, {tuple(p): r for p, r in zip(PROMPTS, ref)})
    llm = LLM("tiny", speculative_method="mtp", num_speculative_tokens=3, spec_schedule="confidence",
              max_num_seqs=8, async_scheduling=async_)
    llm.scheduler.spec_pays = lambda n: n <= 2
    modes, overlapped = [], []
    real = ModelRunner.execute

    def execute(self, output, prev=None):
        modes.append(output.speculative)
        overlapped.append(prev is not None and prev._result is None)
        return real(self, output, prev)

    monkeypatch.setattr(ModelRunner, "execute", execute)
    outs = llm.generate(PROMPTS, sp)
    assert [o.token_ids for o in outs] == ref
    stats = llm.runner.spec.stats
    assert stats.plain_steps > 0 and stats.verifications > 0 and stats.accepted > 0
    first = modes.index(True)
    assert not any(modes[:first]) and all(modes[first:])  # 4 requests drain: plain, then speculative
    assert any(overlapped) == async_
    assert not llm.engine.has_unfinished_requests() and llm.block_manager.num_free_blocks == llm.config.num_blocks


@pytest.mark.parametrize("period", [3, 4])
def test_plain_steps_after_speculative_ones_see_the_kept_ring_state(monkeypatch, reference, period):
    """A speculative step leaves its ring-state commit pending (the next step's draft chain goes first); a plain
    step that follows must write it before its forward: ``period - 1`` speculative steps, then a plain one (period
    3 fails when the plain step does not; period 4 accepts drafts), greedy outputs equal speculation off."""
    sp, ref = reference
    _use_oracle(monkeypatch, {tuple(p): r for p, r in zip(PROMPTS, ref)})
    llm = LLM("tiny", speculative_method="mtp", num_speculative_tokens=3, spec_schedule="fixed", max_num_seqs=8)
    turns = iter(range(10 ** 6))
    llm.scheduler.spec_pays = lambda n: next(turns) % period != period - 1
    outs = llm.generate(PROMPTS, sp)
    assert [o.token_ids for o in outs] == ref
    stats = llm.runner.spec.stats
    assert stats.plain_steps >= 3 and stats.verifications > 3 and stats.drafted > 0
    assert stats.accepted > 0 or period == 3


def test_sampled_requests_switching_modes_finish_with_their_lengths(monkeypatch):
    """Seeded sampled requests through both kinds of step: every request ends at max_tokens, tokens in the
    vocabulary, the same outputs on a second run (the switch points depend on the batch only)."""
    params = [SamplingParams(max_tokens=3 + 4 * i, temperature=0.9, top_p=0.9, seed=i, ignore_eos=True)
              for i in range(len(PROMPTS))]
    runs = []
    for _ in range(2):
        llm = LLM("tiny", speculative_method="mtp", num_speculative_tokens=2, spec_schedule="confidence",
                  max_num_seqs=8)
        llm.scheduler.spec_pays = lambda n: n % 2 == 1
        outs = llm.generate(PROMPTS, params)
        assert [len(o.token_ids) for o in outs] == [3 + 4 * i for i in range(len(PROMPTS))]
        assert all(0 <= t < llm.vocab_size for o in outs for t in o.token_ids)
        assert llm.runner.spec.stats.plain_steps > 0
        runs.append([o.token_ids for o in outs])
    assert runs[0] == runs[1]


def test_steps_with_a_prefill_chunk_verify_no_draft_under_the_schedule(monkeypatch, reference):
    """With the schedule's rule set (``spec_pays``), a step that admits a request or carries a prompt chunk verifies
    no draft (it would run eagerly, its verification too) but still runs the MTP pass, so the next step verifies
    drafts; the other steps verify. Two requests at a time, so admissions come while others decode; greedy outputs
    equal speculation off."""
    sp, ref = reference
    _use_oracle(monkeypatch, {tuple(p): r for p, r in zip(PROMPTS, ref)})
    llm = LLM("tiny", speculative_method="mtp", num_speculative_tokens=3, spec_schedule="confidence",
              max_num_seqs=2, max_num_batched_tokens=64)
    llm.scheduler.spec_pays = lambda n: True
    steps = []
    real = ModelRunner.execute

    def execute(self, output, prev=None):
        prefill = bool(output.new_requests) or any(it.num_new_tokens - it.num_draft_tokens > 1
                                                   for it in output.scheduled)
        steps.append((output.speculative, prefill, sum(it.num_draft_tokens for it in output.scheduled)))
        return real(self, output, prev)

    monkeypatch.setattr(ModelRunner, "execute", execute)
    outs = llm.generate(PROMPTS, sp)
    assert [o.token_ids for o in outs] == ref
    assert all(spec for spec, _, _ in steps)
    assert not any(prefill and drafts for _, prefill, drafts in steps), steps
    assert sum(prefill for _, prefill, _ in steps) >= 3
    # the step after an admission verifies the drafts its MTP pass made
    after = [steps[i + 1][2] for i, (_, prefill, _) in enumerate(steps[:-1]) if prefill and not steps[i + 1][1]]
    assert after and all(d > 0 for d in after), steps
    assert llm.runner.spec.stats.accepted > 0


def test_requests_held_back_for_blocks_do_not_stop_verification(monkeypatch, reference):
    """A cache too small for every request at once: requests wait for blocks while a free slot exists. The running
    ones still verify drafts in the steps that admit nobody; greedy outputs equal speculation off."""
    sp, ref = reference
    _use_oracle(monkeypatch, {tuple(p): r for p, r in zip(PROMPTS, ref)})
    llm = LLM("tiny", speculative_method="mtp", num_speculative_tokens=3, spec_schedule="confidence",
              max_num_seqs=8, num_blocks=3)
    llm.scheduler.spec_pays = lambda n: True
    held = []
    real = Scheduler.schedule

    def schedule(self, speculate=None):
        waiting = bool(self.waiting) and len(self.running) < self.config.max_num_seqs
        out = real(self, speculate)
        held.append(waiting and not out.new_requests and sum(it.num_draft_tokens for it in out.scheduled) > 0)
        return out

    monkeypatch.setattr(Scheduler, "schedule", schedule)
    outs = llm.generate(PROMPTS, sp)
    assert [o.token_ids for o in outs] == ref
    assert any(held)  # steps with a request waiting for blocks, and drafts verified


MANY = [[(11 * i + 5 * j) % 900 + 20 for j in range(4 + i % 5)] for i in range(20)]
MANY_SP = [SamplingParams(max_tokens=3 + (7 * i) % 11, temperature=0.0, ignore_eos=True) for i in range(20)]


@pytest.fixture(scope="module")
def many_reference():
    llm = LLM("tiny", max_num_seqs=16)
    return [o.token_ids for o in llm.generate(MANY, MANY_SP)]


def _admissions(monkeypatch) -> list[tuple[int, int]]:
    """Per schedule call: (free slots with a request waiting, else 0; requests admitted)."""
    steps = []
    real = Scheduler.schedule

    def schedule(self, speculate=None):
        free = self.config.max_num_seqs - len(self.running) if self.waiting else 0
        out = real(self, speculate)
        steps.append((free, len(out.new_requests)))
        return out

    monkeypatch.setattr(Scheduler, "schedule", schedule)
    return steps


@pytest.mark.parametrize("hold", [0, 3])
def test_admissions_come_in_groups_under_the_schedule(monkeypatch, many_reference, hold):
    """16 slots, 20 requests of uneven lengths: with ``spec_admit_hold`` a free slot waits for a second one (16 // 8)
    or for ``hold`` steps before the waiting requests are admitted; with 0, every free slot is filled at once.
    Greedy outputs equal speculation off either way and every request finishes."""
    _use_oracle(monkeypatch, {tuple(p): r for p, r in zip(MANY, many_reference)})
    llm = LLM("tiny", speculative_method="mtp", num_speculative_tokens=2, spec_schedule="confidence",
              max_num_seqs=16, spec_admit_hold=hold)
    llm.scheduler.spec_pays = lambda n: True
    steps = _admissions(monkeypatch)
    outs = llm.generate(MANY, MANY_SP)
    assert [o.token_ids for o in outs] == many_reference
    assert not llm.engine.has_unfinished_requests() and llm.block_manager.num_free_blocks == llm.config.num_blocks
    waits, run = [], 0  # consecutive steps with a free slot and nobody admitted
    for free, admitted in steps:
        if free and not admitted:
            run += 1
        else:
            waits.append(run)
            run = 0
    if hold:
        assert any(free == 1 and not admitted for free, admitted in steps)  # one slot free: held
        assert max(waits) <= hold  # never longer than the hold
        assert all(admitted >= 2 or free < 2 for free, admitted in steps if admitted and free)
    else:
        assert max(waits) == 0


def test_no_hold_when_no_running_request_speculates(monkeypatch, many_reference):
    """Requests with a penalty never verify drafts: holding their admissions gains nothing, so free slots are
    filled at once."""
    llm = LLM("tiny", speculative_method="mtp", num_speculative_tokens=2, spec_schedule="confidence",
              max_num_seqs=16, spec_admit_hold=8)
    llm.scheduler.spec_pays = lambda n: True
    steps = _admissions(monkeypatch)
    params = [SamplingParams(max_tokens=p.max_tokens, temperature=0.0, ignore_eos=True, presence_penalty=0.3)
              for p in MANY_SP]
    outs = llm.generate(MANY, params)
    assert all(len(o.token_ids) == p.max_tokens for o, p in zip(outs, params))
    assert not any(free and not admitted for free, admitted in steps)


def test_spec_admit_hold_must_be_a_count():
    from deepinfer.config import EngineConfig

    for bad in (-1, 1.5, True, "8"):
        with pytest.raises(ValueError, match="spec_admit_hold"):
            EngineConfig(spec_admit_hold=bad).validate()


@pytest.fixture(scope="module")
def long_reference():
    llm = LLM("tiny", max_num_seqs=8)
    sp = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    return sp, [o.token_ids for o in llm.generate(PROMPTS, sp)]


@pytest.mark.parametrize("drafter", ["never-accepted", "oracle"])
def test_a_drafter_never_accepted_leaves_the_schedule_to_plain_steps(monkeypatch, long_reference, drafter):
    """The engine with the schedule's rule over graph costs (off CUDA, eager replays; replay times set by hand:
    a verification of no draft 1.05 s against a plain step's 1 s, each draft 0.06 s more). A drafter whose
    drafts are always wrong, at confidence 1e-4 (random weights): after the first verification every choice
    verifies nothing, so the acceptance rates stay near their prior and promise a gain; the choices' own gain
    turns the rule to plain steps (the refusals' probes aside). The oracle (right at 0.9 but every third draft):
    speculation stays. Greedy outputs equal speculation off either way; nothing leaks."""
    from deepinfer.spec_graphs import SpecGraphs, spec_buckets

    sp, ref = long_reference
    refs = {tuple(p): r for p, r in zip(PROMPTS, ref)}
    if drafter == "oracle":
        _use_oracle(monkeypatch, refs)
    else:
        real = sd.SpecDecoder._draw

        def draw(self, logits, states, counters, greedy_pre=None):
            toks, conf, probs = real(self, logits, states, counters, greedy_pre)
            for n, (st, c) in enumerate(zip(states, counters)):
                r = refs[tuple(st.token_ids[:st.num_prompt_tokens])]
                toks[n] = (r[c] + 1) % 1000 if c < len(r) else toks[n]
                conf[n] = 1e-4
            return toks, conf, probs

        monkeypatch.setattr(sd.SpecDecoder, "_draw", draw)
    llm = LLM("tiny", speculative_method="mtp", num_speculative_tokens=3, spec_schedule="confidence",
              max_num_seqs=8)
    spec = llm.runner.spec
    spec.graphs = SpecGraphs(llm.runner, 3, spec_buckets(8), 512, confidences=True)
    for g in [*spec.graphs.verify.values(), *spec.graphs.draft.values(), *spec.graphs.mtp.values()]:
        spec.graphs.seconds[(g.kind, g.bucket, g.q)] = {"verify": 1.0 + 0.01 * (g.q - 1)}.get(g.kind, 0.05)
    spec.plain_cost = {b: 1.0 for b in spec_buckets(8)}
    llm.scheduler.spec_pays = spec.pays
    outs = llm.generate(PROMPTS, sp)
    assert [o.token_ids for o in outs] == ref
    st = spec.stats
    if drafter == "oracle":
        assert st.accepted > 0 and st.plain_steps < st.graph_steps
    else:
        # one uninformed choice verifies (the requests' first drafts); six choices of nothing take the gain from
        # 1.3 below 1; then plain steps, and three probes of three steps each (the 8th, 16th and 32nd refusals)
        assert st.verifications <= len(PROMPTS) and st.accepted == 0 and st.plain_steps > st.graph_steps
        assert list(spec._gain) == [4] and spec._gain[4] < 1.0
        gain = dict(spec._gain)
        spec._gain.clear()
        assert spec.estimate_pays(4)  # the acceptance rates alone (one rejection per position) promise a gain
        spec._gain.update(gain)
        assert not spec.estimate_pays(4)
    assert not llm.engine.has_unfinished_requests() and llm.block_manager.num_free_blocks == llm.config.num_blocks
